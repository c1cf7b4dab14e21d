"""Format checks for checkpoint files, without torch. The package also holds:

  torchpickle.py  the layouts torch.save writes and a safe unpickler (imports nothing, runs nothing)
  stepread.py   the step a checkpoint records about itself (trainer_state.json, global_step, iter_num ...)
  layouts.py    what a checkpoint directory is (HF Trainer, save_pretrained, DCP, DeepSpeed) and its last file

May import: the shared leaves and onbox.checkpoints (the base). Nothing else of the package.

A file named like a torch checkpoint (.pt .pth .ckpt .bin) must be one of the two layouts torch.save writes
(torchpickle.py): a torch zip or a legacy torch pickle. Anything else — zero-filled, text, random, cut short —
is a problem with a reason, because handing it to a trainer as the checkpoint to resume from crash-loops the run.

Two depths:
  structural (full=False, cheap: the ends and headers of a file, never its payload; detection and restore use it):
    torch zip: the central directory (written last) is there, every member's local header is where the directory
      says and its data ends inside the file, the torch layout (one top dir, data.pkl, version) holds;
    legacy torch pickle: the magic number, protocol version and sys_info pickles parse, the object pickle and the
      storage key list parse (a growing prefix read, up to torchpickle.PICKLE_LIMIT), and every storage record
      lies inside the file with the element count its tensor says;
    safetensors: the header parses and its tensors cover exactly the buffer;
    JSON: a small file parses (JSON Lines too); a large one starts with { or [ and ends with the matching bracket.
  full (full=True, reads every byte; `onbox verify`): also the CRC-32 of every zip member (torch.load skips them),
    and data.pkl parses and names storages that exist with the size their tensors need; JSON parses whatever
    its size. check_json(path) is the strict parse for a JSON file a format requires (HF trainer_state.json). A legacy pickle has no checksums: the manifest hash is what covers its bytes.
Other files (.pkl, .npy, .distcp, tokenizer files) have no self-check: the manifest hash covers them.
"""
from __future__ import annotations

import json
import os
import stat
import struct
import zipfile
from typing import NamedTuple, Optional

from onbox import untrusted
from onbox.checkpoints.formats import torchpickle

ZIP_MAGIC = b"PK\x03\x04"
SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's limit
SAFETENSORS_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}
CHUNK = 8 * 1024 * 1024
TORCH_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")  # what torch.save writes (zip since torch 1.6, pickle before)
JSON_PARSE_ALWAYS = 1024 * 1024  # a JSON file up to this size is parsed even by the structural check
DESCRIBE_WHOLE = 1024 * 1024  # a non-torch file up to this size is read whole to say what it is
ZIP_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature ... name length, extra length (30 bytes)


class FormatResult(NamedTuple):
    kind: str  # "torch-zip" | "torch-legacy" | "safetensors" | "json" | "zip" | "other"
    problem: Optional[str]  # None when the checks passed (or the format has none)
    note: str = ""  # what could not be checked, when something could not (e.g. a pickle over the size limit)

    @property
    def ok(self) -> bool:
        return self.problem is None


def sniff(path: str) -> str:
    """The format of a file by its first bytes (and the .safetensors / .json suffixes): "zip", "torch-legacy",
    "safetensors", "json" or "other"."""
    with open(path, "rb", buffering=0) as f:
        head = f.read(64)
    if head[:4] == ZIP_MAGIC:
        return "zip"
    if path.endswith(".safetensors"):
        return "safetensors"
    if torchpickle.looks_legacy(head):
        return "torch-legacy"
    if len(head) >= 9:
        n = struct.unpack("<Q", head[:8])[0]
        if 2 <= n <= SAFETENSORS_MAX_HEADER and head[8:9] == b"{":
            return "safetensors"
    if path.endswith(".json"):
        return "json"
    return "other"


# how a problem that is this box's, not the file's, begins: never called torn (the bytes may be whole)
UNREADABLE = ("cannot read", "not a regular file")


def check_file(path: str, full: bool = False) -> FormatResult:
    """Check one file; `full` also reads every byte (zip CRCs, the whole of a large JSON)."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):  # a device, FIFO or socket (often behind a symlink): never read it
            return FormatResult("other", "%s: %s is %s%s" % (UNREADABLE[1],
                os.path.basename(path), untrusted.describe_mode(st.st_mode),
                " (through a symlink to %s)" % os.path.realpath(path) if os.path.islink(path) else ""))
        size = st.st_size
        torch_named = path.endswith(TORCH_SUFFIXES)
        if size == 0 and (torch_named or path.endswith((".safetensors", ".json"))):
            # torch.save buffers its first write: a save killed early (OOM, SIGKILL) leaves 0 bytes, which would
            # otherwise pass as a quiet file and be committed, then handed to the trainer
            return FormatResult("other", "empty file (torn: its save was killed before any byte reached the disk)")
        kind = sniff(path)
        if kind == "zip":
            return _check_zip(path, size, full, torch_named)
        if kind == "torch-legacy":
            return _check_legacy(path, size)
        if torch_named:
            what = "a safetensors file (torch.load cannot read it)" if kind == "safetensors" else describe(path, size)
            return FormatResult(kind, "not a torch checkpoint: %s" % what)
        if kind == "safetensors":
            return FormatResult("safetensors", _check_safetensors(path, size))
        if kind == "json":
            return _check_json(path, size, full)
        return FormatResult("other", None)
    except OSError as e:
        return FormatResult("other", "%s: %s" % (UNREADABLE[0], e.strerror or e))


def check_json(path: str) -> FormatResult:
    """Parse a JSON file a known format requires (Hugging Face's trainer_state.json, written last)."""
    try:
        return _check_json(path, os.path.getsize(path), full=True, strict=True)
    except OSError as e:
        return FormatResult("json", "cannot read: %s" % (e.strerror or e))


def describe(path: str, size: int) -> str:
    """What a file that is not a torch checkpoint holds, in words a user recognises."""
    with open(path, "rb") as f:
        if size <= DESCRIBE_WHOLE:
            whole = f.read()
            if not whole.strip(b"\x00"):
                return "the file is %s zero bytes (its data never reached the disk)" % format(size, ",")
            head = whole[:4096]
        else:
            head = f.read(4096)
            f.seek(size - 4096)
            tail = f.read(4096)
            if not head.strip(b"\x00") and not tail.strip(b"\x00"):
                return "the file's first and last 4,096 bytes are zeros (%s bytes; its data never reached the " \
                       "disk)" % format(size, ",")
    if not head[:64].strip(b"\x00"):
        return "it starts with zero bytes where a torch zip or pickle header belongs (%s bytes; torn)" % format(
            size, ",")
    text = _as_text(head)
    if text is not None:
        first = " ".join(text.split())[:60]
        return 'text ("%s%s")' % (first, "..." if len(text) > 60 else "")
    return "unrecognised content (%s bytes, starting %s): neither a torch zip nor a torch pickle" % (
        format(size, ","), head[:8].hex(" "))


def _as_text(head: bytes) -> Optional[str]:
    if b"\x00" in head:
        return None
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 3:  # not just a character cut at the end of the sample
            return None
        text = head[:e.start].decode("utf-8")
    printable = sum(c.isprintable() or c in "\t\r\n" for c in text)
    return text if text and printable >= 0.95 * len(text) else None


def _check_zip(path: str, size: int, full: bool, torch_named: bool) -> FormatResult:
    kind = "torch-zip" if torch_named else "zip"
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as e:
        what = "torch zip" if torch_named else "zip"
        return FormatResult(kind, "%s truncated: its central directory (written last) is missing or damaged "
                                  "(%s bytes; the save was cut short or is still being written): %s" % (
                                      what, format(size, ","), e))
    with zf:
        layout = torchpickle.zip_layout(zf)
        if layout.problem is None:
            kind = "torch-zip"
        elif torch_named:
            return FormatResult("zip", "not a torch checkpoint: %s" % layout.problem)
        problem = _check_zip_members(path, size, zf)
        if problem or not full:
            return FormatResult(kind, problem)
        for info in zf.infolist():
            try:
                with zf.open(info) as member:
                    while member.read(CHUNK):
                        pass
            except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as e:
                return FormatResult(kind, "zip member %s is damaged: %s" % (info.filename, e))  # "Bad CRC-32 ..."
        if kind != "torch-zip":
            return FormatResult(kind, None)
        return _check_zip_storages(zf, layout)


def _check_zip_members(path: str, size: int, zf: zipfile.ZipFile) -> Optional[str]:
    """Every member's local header is where the central directory says, and its data ends before the directory."""
    end = min(size, getattr(zf, "start_dir", size))
    with open(path, "rb", buffering=0) as f:
        for info in zf.infolist():
            f.seek(info.header_offset)
            raw = f.read(ZIP_LOCAL_HEADER.size)
            if len(raw) < ZIP_LOCAL_HEADER.size:
                return "zip member %s starts past the end of the file (truncated)" % info.filename
            sig, name_len, extra_len = ZIP_LOCAL_HEADER.unpack(raw)
            if sig != ZIP_MAGIC:
                return "zip member %s: no local header at byte %d (overwritten or zero-filled)" % (
                    info.filename, info.header_offset)
            data_end = info.header_offset + ZIP_LOCAL_HEADER.size + name_len + extra_len + info.compress_size
            if data_end > end:
                return "zip member %s extends past the end of the file (truncated)" % info.filename
    return None


def _check_zip_storages(zf: zipfile.ZipFile, layout: torchpickle.ZipLayout) -> FormatResult:
    """data.pkl parses (safely) and every storage it names is a member with the bytes its tensor needs."""
    try:
        _obj, storages = torchpickle.read_zip_object(zf, layout)
    except torchpickle.TooLarge as e:
        return FormatResult("torch-zip", None, "data.pkl not parsed, its storages not matched (%s, over the "
                                               "limit of %s bytes)" % (e, format(torchpickle.PICKLE_LIMIT, ",")))
    except torchpickle.Unreadable as e:
        return FormatResult("torch-zip", "%s does not parse: %s" % (layout.data_pkl.filename, e))
    members = {i.filename: i for i in zf.infolist()}
    for ref in storages:
        name = "%s/data/%s" % (layout.archive, ref.key)
        info = members.get(name)
        if info is None:
            return FormatResult("torch-zip", "tensor storage %s is missing (data.pkl refers to it)" % name)
        if ref.element_bytes is not None and info.file_size != ref.numel * ref.element_bytes:
            return FormatResult("torch-zip", "tensor storage %s holds %d bytes; its tensor needs %d (%d x %s)" % (
                name, info.file_size, ref.numel * ref.element_bytes, ref.numel, ref.type_name))
    return FormatResult("torch-zip", None)


def _check_legacy(path: str, size: int) -> FormatResult:
    try:
        lf = torchpickle.read_legacy(path)
    except torchpickle.TooLarge as e:
        return FormatResult("torch-legacy", None, "storages not walked: %s (over the limit of %s bytes)" % (
            e, format(torchpickle.PICKLE_LIMIT, ",")))
    except torchpickle.Truncated as e:
        return FormatResult("torch-legacy", "torch pickle truncated: %s" % e)
    except torchpickle.Unreadable as e:
        return FormatResult("torch-legacy", "torch pickle damaged: %s" % e)
    problem = torchpickle.walk_legacy_storages(path, lf)
    return FormatResult("torch-legacy", "torch pickle %s" % problem if problem else None)


def _check_json(path: str, size: int, full: bool, strict: bool = False) -> FormatResult:
    """`strict`: one JSON document (a file a format requires). Else JSON Lines under a .json name pass too (some
    loggers write them): a checkpoint dir must not be held back forever by a file no loader of it reads whole."""
    if size == 0:
        return FormatResult("json", "empty file (torn: its save was killed before any byte reached the disk)")
    if full or strict or size <= JSON_PARSE_ALWAYS:
        with open(path, "rb") as f:
            raw = f.read()
        try:
            json.loads(raw.decode("utf-8"))
            return FormatResult("json", None)
        except (UnicodeDecodeError, ValueError) as e:
            error = e
        if not strict and _json_lines(raw):
            return FormatResult("json", None, "JSON Lines, not one JSON document")
        return FormatResult("json", "not valid JSON (torn or still being written?): %s" % error)
    with open(path, "rb", buffering=0) as f:
        head = f.read(4096).lstrip()
        f.seek(max(0, size - 4096))
        tail = f.read().rstrip()
    closer = {b"{": b"}", b"[": b"]"}.get(head[:1])
    if closer is None or not tail.endswith(closer):
        return FormatResult("json", "not a whole JSON document: it %s (torn or still being written?)" % (
            "ends with %r" % tail[-16:].decode("utf-8", "replace") if closer else "does not start with { or ["))
    return FormatResult("json", None, "large JSON: only its ends checked (full=False)")


def _json_lines(raw: bytes) -> bool:
    lines = [line for line in raw.splitlines() if line.strip()]
    try:
        return len(lines) > 1 and all(isinstance(json.loads(line.decode("utf-8")), (dict, list)) for line in lines)
    except (UnicodeDecodeError, ValueError):
        return False


def _check_safetensors(path: str, size: int) -> Optional[str]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "safetensors file shorter than its 8-byte header length (truncated)"
        n = struct.unpack("<Q", head)[0]
        if n > SAFETENSORS_MAX_HEADER or 8 + n > size:
            return "safetensors header length %d does not fit in the file of %d bytes (truncated?)" % (n, size)
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        return "safetensors header is not valid JSON: %s" % e
    if not isinstance(header, dict):
        return "safetensors header is not a JSON object"
    buffer_len = size - 8 - n
    end_max = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = meta["data_offsets"]
            width = SAFETENSORS_DTYPE_BYTES.get(meta["dtype"])
            count = 1
            for dim in meta["shape"]:
                count *= int(dim)
        except (KeyError, TypeError, ValueError):
            return "safetensors tensor %s has a malformed entry" % name
        if not (0 <= begin <= end <= buffer_len):
            return "safetensors tensor %s data [%d, %d) lies outside the %d-byte buffer (truncated?)" % (
                name, begin, end, buffer_len)
        if width is not None and end - begin != count * width:
            return "safetensors tensor %s: %d bytes for shape %s of %s" % (name, end - begin, meta["shape"], meta["dtype"])
        end_max = max(end_max, end)
    if end_max != buffer_len:
        return "safetensors buffer is %d bytes but the tensors cover %d" % (buffer_len, end_max)
    return None
