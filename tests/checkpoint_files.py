"""Checkpoint-shaped files for tests, without torch: a torch-style zip (stored members under archive/, with the
data.pkl and version records torch.load requires, like torch.save writes) and a safetensors file; and the
complete candidates the detector finds among them (`complete_cands`). Tests of the format checks themselves use
real torch.save files (tests/unit/test_ckpt_formats.py)."""
from __future__ import annotations

import json
import os
import struct
import zipfile
from typing import Any, Dict, List, Optional

from onbox.checkpoints.local.completion import CompletionTracker
from onbox.checkpoints.local.detect import scan


def torch_zip_bytes(payload: bytes = b"\x01" * 4096, members: int = 2, obj: Optional[Dict] = None) -> bytes:
    """`obj` (plain Python values only, e.g. {"iter_num": 60}) is what data.pkl pickles; the data members hold
    `payload` each (torch would reference them from data.pkl; no tensor here does)."""
    import io
    import pickle

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pickle.dumps(obj or {}, protocol=2))
        zf.writestr("archive/byteorder", b"little")
        for i in range(members):
            zf.writestr("archive/data/%d" % i, payload)
        zf.writestr("archive/version", b"3\n")
    return buf.getvalue()


def write_torch_zip(path: str, payload: bytes = b"\x01" * 4096, members: int = 2, obj: Optional[Dict] = None) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(torch_zip_bytes(payload, members, obj))
    return path


def safetensors_bytes(tensors: Optional[Dict[str, int]] = None) -> bytes:
    """F32 1-D tensors {name: length}."""
    tensors = tensors or {"w": 16, "b": 4}
    header, off = {}, 0
    for name, n in tensors.items():
        header[name] = {"dtype": "F32", "shape": [n], "data_offsets": [off, off + 4 * n]}
        off += 4 * n
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"\x00" * off


def write_safetensors(path: str, tensors: Optional[Dict[str, int]] = None) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(safetensors_bytes(tensors))
    return path


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def truncate(path: str, keep: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)


def complete_cands(ckpt_dir: str, settle: float = 0.0, progress: Any = None) -> list:
    """The candidates in `ckpt_dir` that the detector takes for complete after one look, `settle` s of quiet."""
    tr = CompletionTracker(settle)
    return [c for c in tr.update(scan(ckpt_dir), 0.0, 0.0, progress) if c.complete]


def committed_steps(durable: str, run: str) -> List[int]:
    """The steps of the checkpoints committed for `run` in a mounted durable dir (those with a MANIFEST.json),
    sorted: what a reader sees, read the way a test reads it (no onbox code in between)."""
    d = os.path.join(durable, run, "checkpoints")
    steps = []
    for name in os.listdir(d) if os.path.isdir(d) else []:
        m = os.path.join(d, name, "MANIFEST.json")
        if os.path.isfile(m):
            with open(m) as f:
                steps.append(json.load(f).get("step"))
    return sorted(s for s in steps if isinstance(s, int))
