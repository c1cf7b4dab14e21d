"""Format checks on real torch.save files (zip and legacy), and on what a torn or foreign file looks like:
zero-filled, text, random, truncated at every offset, one flipped byte, a zip that is not torch's. Then the
`onbox verify` CLI on each bad input (exit code and message), and --load where torch cannot be imported."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import struct
import subprocess
import zipfile
from pathlib import Path

import pytest

from onbox.checkpoints import formats
from onbox.checkpoints.formats import torchpickle
from onbox.checkpoints.verify import NO_MANIFEST, verify_path
from tests.checkpoint_files import flip_byte, safetensors_bytes, write_torch_zip
from tests.conftest import subprocess_env
from tests.torch_checkpoints import lightning_checkpoint, nanogpt_checkpoint, save

torch = pytest.importorskip("torch")

BOTH = pytest.mark.parametrize("full", [False, True])


def member_data_ranges(path: str):
    """{member: (start, end)} of each zip member's data, from its local header."""
    out = {}
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        for info in zf.infolist():
            f.seek(info.header_offset)
            _sig, n, m = struct.unpack("<4s22xHH", f.read(30))
            start = info.header_offset + 30 + n + m
            out[info.filename] = (start, start + info.compress_size)
    return out


@pytest.fixture
def nano(tmp_path):
    torch.manual_seed(0)
    return save(nanogpt_checkpoint(iter_num=60), str(tmp_path / "ckpt.pt"))


@pytest.fixture
def legacy(tmp_path):
    torch.manual_seed(0)
    return save(nanogpt_checkpoint(iter_num=60, n_layer=1, n_embd=8, block=8, vocab=11),
                str(tmp_path / "old.pt"), legacy=True)


# -- what torch.save writes passes -------------------------------------------------------------------------------
@BOTH
def test_real_torch_saves_pass_both_depths(tmp_path, nano, legacy, full):
    last = save(lightning_checkpoint(), str(tmp_path / "last.ckpt"), via_buffer=True)
    odd = save({"f8": torch.zeros(3, dtype=torch.float8_e4m3fn), "u16": torch.zeros(2, dtype=torch.uint16),
                "view": torch.arange(10)[2:5], "c": torch.zeros(2, dtype=torch.complex64)}, str(tmp_path / "odd.pth"))
    odd_legacy = save({"s": torch.zeros(2).untyped_storage(), "h": torch.zeros(3, dtype=torch.half)},
                      str(tmp_path / "odd.bin"), legacy=True)
    for p, kind in ((nano, "torch-zip"), (last, "torch-zip"), (odd, "torch-zip"), (legacy, "torch-legacy"),
                    (odd_legacy, "torch-legacy")):
        assert formats.check_file(p, full=full) == formats.FormatResult(kind, None), p


def test_torch_2_13_zip_layout_is_what_the_checks_require(nano):
    with zipfile.ZipFile(nano) as zf:
        names = set(zf.namelist())
    # what torch 2.13 writes; `version` (not .format_version) is the record torch.load insists on
    assert {"ckpt/data.pkl", "ckpt/version", "ckpt/.format_version", "ckpt/byteorder"} <= names
    assert all(n.startswith("ckpt/") for n in names)


# -- what is not a torch checkpoint fails, with a reason ---------------------------------------------------------
@BOTH
def test_zero_filled_text_random_and_empty_files_named_like_torch_fail(tmp_path, full):
    z = tmp_path / "step_00010.pt"
    z.write_bytes(bytes(5632))
    assert formats.check_file(str(z), full=full).problem == (
        "not a torch checkpoint: the file is 5,632 zero bytes (its data never reached the disk)")
    big = tmp_path / "big.pth"
    big.write_bytes(bytes(3 * 1024 * 1024))
    assert "first and last 4,096 bytes are zeros" in formats.check_file(str(big), full=full).problem
    t = tmp_path / "ckpt.ckpt"
    t.write_text('{"step": 5, "time": 1712345678.1}\n')
    assert formats.check_file(str(t), full=full).problem == (
        'not a torch checkpoint: text ("{"step": 5, "time": 1712345678.1}")')
    r = tmp_path / "pytorch_model.bin"
    r.write_bytes(b"\x13\x37" + os.urandom(4000))
    assert formats.check_file(str(r), full=full).problem.startswith(
        "not a torch checkpoint: unrecognised content (4,002 bytes, starting 13 37")
    e = tmp_path / "e.pt"
    e.write_bytes(b"")
    assert "empty file" in formats.check_file(str(e), full=full).problem
    st = tmp_path / "model.bin"
    st.write_bytes(safetensors_bytes())
    assert "a safetensors file" in formats.check_file(str(st), full=full).problem
    marker = tmp_path / "COMPLETE"  # an empty marker of unknown format stays fine
    marker.write_bytes(b"")
    assert formats.check_file(str(marker), full=full) == formats.FormatResult("other", None)


@BOTH
def test_a_head_overwritten_with_zeros_fails(tmp_path, nano, full):
    with open(nano, "r+b") as f:
        f.write(bytes(4096))
    res = formats.check_file(nano, full=full)
    assert res.problem == ("not a torch checkpoint: it starts with zero bytes where a torch zip or pickle header "
                           "belongs (%s bytes; torn)" % format(os.path.getsize(nano), ","))


def test_a_torch_zip_truncated_anywhere_fails_the_cheap_check(nano):
    data = Path(nano).read_bytes()
    cut = nano + ".cut.pt"
    offsets = sorted(set(range(1, len(data), max(1, len(data) // 1500))) | set(range(len(data) - 64, len(data))))
    for n in offsets:
        with open(cut, "wb") as f:
            f.write(data[:n])
        res = formats.check_file(cut, full=False)
        assert res.problem and ("truncated" in res.problem or "not a torch checkpoint" in res.problem), (n, res)
    assert "central directory" in formats.check_file(cut).problem


def test_a_legacy_pickle_truncated_at_every_offset_fails_the_cheap_check(tmp_path):
    torch.manual_seed(0)
    small = save({"model": {"w": torch.randn(3, 3), "b": torch.zeros(3)}, "step": 3, "lr": torch.tensor(0.1)},
                 str(tmp_path / "small.pt"), legacy=True)
    data = Path(small).read_bytes()
    cut = small + ".cut.pt"
    for n in range(1, len(data)):
        with open(cut, "wb") as f:
            f.write(data[:n])
        res = formats.check_file(cut, full=False)
        assert res.kind == "torch-legacy" and res.problem and "truncated" in res.problem, (n, res)
    assert "storage" in res.problem and "past the end of the file" in res.problem


def test_a_flipped_byte_in_any_member_is_caught_by_the_full_check_only(nano):
    ranges = member_data_ranges(nano)
    targets = [(name, start + (end - start) // 2) for name, (start, end) in ranges.items() if end > start]
    assert {"ckpt/data.pkl", "ckpt/data/0", "ckpt/version"} <= {name for name, _ in targets}
    for name, off in targets:
        flip_byte(nano, off)
        assert formats.check_file(nano, full=False).ok, name  # structure intact: the cheap check cannot know
        res = formats.check_file(nano, full=True)
        assert res.problem and name in res.problem and "CRC" in res.problem, (name, res)
        flip_byte(nano, off)
    assert formats.check_file(nano, full=True).ok


def test_a_zip_that_is_not_torch(tmp_path):
    def zip_of(path, members):
        with zipfile.ZipFile(path, "w") as zf:
            for n, b in members.items():
                zf.writestr(n, b)
        return str(path)

    plain = zip_of(tmp_path / "model.pt", {"weights.npy": b"x" * 100})
    assert formats.check_file(plain).problem == ("not a torch checkpoint: a zip archive whose members are not "
                                                 "under one top-level dir (weights.npy)")
    no_pkl = zip_of(tmp_path / "a.pt", {"a/data/0": b"x", "a/version": b"3\n"})
    assert formats.check_file(no_pkl).problem == "not a torch checkpoint: a zip archive without a/data.pkl"
    no_version = zip_of(tmp_path / "b.pt", {"b/data.pkl": pickle.dumps({}, protocol=2)})
    assert formats.check_file(no_version).problem == "not a torch checkpoint: a zip archive without b/version"
    for bad in (no_pkl, no_version):  # what torch.load itself says about them: it cannot read either
        with pytest.raises(RuntimeError):
            torch.load(bad, weights_only=True)
    # the same bytes under a name that is not torch's: a zip, checked as one (central directory, CRCs)
    os.rename(plain, str(tmp_path / "extra.zip"))
    assert formats.check_file(str(tmp_path / "extra.zip"), full=True) == formats.FormatResult("zip", None)


def test_full_check_matches_data_pkl_to_its_storages(tmp_path, nano):
    def rewrite(src, dst, drop=None, resize=None):
        with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
            for info in zin.infolist():
                if info.filename == drop:
                    continue
                data = zin.read(info)
                zout.writestr(info.filename, data[:-4] if info.filename == resize else data)
        return dst

    assert formats.check_file(rewrite(nano, str(tmp_path / "same.pt")), full=True).ok
    res = formats.check_file(rewrite(nano, str(tmp_path / "drop.pt"), drop="ckpt/data/0"), full=True)
    assert res.problem == "tensor storage ckpt/data/0 is missing (data.pkl refers to it)"
    res = formats.check_file(rewrite(nano, str(tmp_path / "short.pt"), resize="ckpt/data/1"), full=True)
    assert res.problem.startswith("tensor storage ckpt/data/1 holds") and "FloatStorage" in res.problem
    bad_pkl = rewrite(nano, str(tmp_path / "pkl.pt"), resize="ckpt/data.pkl")  # a data.pkl cut (CRC re-made)
    assert "ckpt/data.pkl does not parse" in formats.check_file(bad_pkl, full=True).problem


def test_legacy_header_damage_is_named(tmp_path, legacy):
    data = Path(legacy).read_bytes()
    proto_at = data.index(pickle.dumps(1001, protocol=2))
    p = tmp_path / "x.pt"
    p.write_bytes(data[:proto_at] + pickle.dumps(1002, protocol=2) + data[proto_at + 6:])
    assert formats.check_file(str(p)).problem == "torch pickle damaged: protocol version 1002, torch writes 1001"
    p.write_bytes(data[:6] + bytes([data[6] ^ 0xFF]) + data[7:])  # inside the magic number
    assert formats.check_file(str(p)).problem.startswith("not a torch checkpoint")


def test_over_the_pickle_limit_the_check_says_what_it_skipped(monkeypatch, nano, legacy):
    monkeypatch.setattr(torchpickle, "PICKLE_LIMIT", 1024)
    res = formats.check_file(nano, full=True)
    assert res.ok and "data.pkl not parsed" in res.note
    res = formats.check_file(legacy, full=False)
    assert res.ok and "storages not walked" in res.note


def test_json(tmp_path):
    good = tmp_path / "trainer_state.json"
    good.write_text(json.dumps({"global_step": 40, "log_history": [{"loss": float("nan")}]}))
    assert formats.check_json(str(good)) == formats.FormatResult("json", None)
    torn = tmp_path / "t.json"
    torn.write_text('{"global_step": 40, "log_hist')
    assert "not valid JSON" in formats.check_json(str(torn)).problem
    assert "not valid JSON" in formats.check_file(str(torn)).problem
    (tmp_path / "e.json").write_bytes(b"")
    assert "empty file" in formats.check_json(str(tmp_path / "e.json")).problem
    big = tmp_path / "tokenizer.json"
    big.write_text(json.dumps({"vocab": {"t%d" % i: i for i in range(120_000)}}))
    assert os.path.getsize(big) > formats.JSON_PARSE_ALWAYS
    assert formats.check_file(str(big)).ok and formats.check_file(str(big), full=True).ok
    with open(big, "r+b") as f:
        f.truncate(os.path.getsize(big) - 100)
    assert "not a whole JSON document" in formats.check_file(str(big)).problem
    assert "not valid JSON" in formats.check_file(str(big), full=True).problem
    lines = tmp_path / "log.json"  # JSON Lines under a .json name: no loader reads it whole; not held against it
    lines.write_text('{"step": 1}\n{"step": 2}\n')
    assert formats.check_file(str(lines), full=True) == formats.FormatResult("json", None,
                                                                             "JSON Lines, not one JSON document")
    assert "not valid JSON" in formats.check_json(str(lines)).problem  # a file a format requires: one document


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io")
def test_the_cheap_check_reads_headers_not_the_payload(tmp_path):
    torch.manual_seed(0)
    p = save(nanogpt_checkpoint(n_layer=4, n_embd=192, vocab=512, block=256), str(tmp_path / "ckpt.pt"))
    q = save(torch.load(p, weights_only=True), str(tmp_path / "legacy.pt"), legacy=True)
    for path in (p, q):
        size = os.path.getsize(path)
        assert size > 20 * 1024 * 1024
        before = rchar()
        assert formats.check_file(path, full=False).ok
        assert rchar() - before < size / 100, path  # a bound on bytes read, not on time


def test_the_safe_unpickler_runs_nothing_and_imports_nothing(tmp_path):
    sentinel = tmp_path / "ran"
    evil = (b"\x80\x02}q\x00(X\x08\x00\x00\x00iter_numK<X\x04\x00\x00\x00evil"
            b"cos\nsystem\nX" + struct.pack("<I", len("touch %s" % sentinel)) + ("touch %s" % sentinel).encode()
            + b"\x85RX\x03\x00\x00\x00modconboxtest_never_imported\nThing\n)\x81u.")
    with zipfile.ZipFile(str(tmp_path / "evil.pt"), "w") as zf:
        zf.writestr("evil/data.pkl", evil)
        zf.writestr("evil/version", b"3\n")
    res = formats.check_file(str(tmp_path / "evil.pt"), full=True)
    assert res == formats.FormatResult("torch-zip", None)
    obj, _ = torchpickle.read_zip_object(zipfile.ZipFile(str(tmp_path / "evil.pt")),
                                         torchpickle.zip_layout(zipfile.ZipFile(str(tmp_path / "evil.pt"))))
    assert obj["iter_num"] == 60 and repr(obj["evil"]) == "<os.system>" and repr(obj["mod"]) == (
        "<onboxtest_never_imported.Thing>")
    import sys

    assert not sentinel.exists() and "onboxtest_never_imported" not in sys.modules


# -- verify ------------------------------------------------------------------------------------------------------
def write_manifest(d, step=None):
    files = []
    for name in sorted(os.listdir(d)):
        data = Path(d, name).read_bytes()
        files.append({"path": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    with open(os.path.join(d, "MANIFEST.json"), "w") as f:
        json.dump({"schema": "onbox.manifest/1", "hash": "sha256", "files": files, "step": step}, f)


def test_verify_report_has_the_step_and_says_what_it_checked(tmp_path, nano):
    rep = verify_path(nano)
    assert rep.ok and (rep.step, rep.step_source) == (60, "ckpt.pt:iter_num")
    assert rep.checked == ["torch zip: central directory, CRC-32 of every member, data.pkl and its storages"]
    d = tmp_path / "ckpt.pt.step-60"
    d.mkdir()
    os.rename(nano, str(d / "ckpt.pt"))
    (d / "notes.txt").write_text("free text")
    write_manifest(str(d))
    rep = verify_path(str(d))
    assert rep.ok and rep.has_manifest and rep.step == 60
    assert rep.checked[0] == "size and sha256 of 2 file(s) against MANIFEST.json"
    assert {r["path"]: r["note"] for r in rep.files}["notes.txt"] == "hash only"
    lone = tmp_path / "notes.txt"
    lone.write_text("free text")
    rep = verify_path(str(lone))  # nothing checkable, no manifest: not verified
    assert not rep.ok and "nothing to verify" in rep.problems[0]


def onbox_verify(*args, extra_env=None):
    import sys

    return subprocess.run([sys.executable, "-m", "onbox", "verify", *args], capture_output=True, text=True,
                          env=subprocess_env(extra_env), timeout=120)


@pytest.mark.integration
def test_verify_cli_fails_on_each_bad_input(tmp_path, nano):
    zero = tmp_path / "step_00010.pt"
    zero.write_bytes(bytes(5632))
    r = onbox_verify(str(zero))
    assert r.returncode == 1 and "verified:" not in r.stdout and "NOT VERIFIED" in r.stdout
    assert "not a torch checkpoint: the file is 5,632 zero bytes" in r.stderr
    text = tmp_path / "last.pt"
    text.write_text("hello\n")
    r = onbox_verify("--json", str(text))
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and doc["ok"] is False and doc["problems"] == [
        'last.pt: not a torch checkpoint: text ("hello")']
    d = tmp_path / "checkpoint-40"  # a good file in a dir without a manifest: listed ok, and the dir fails
    d.mkdir()
    os.rename(nano, str(d / "model.pt"))
    r = onbox_verify(str(d))
    assert r.returncode == 1 and NO_MANIFEST in r.stderr and "ok   model.pt [torch-zip]" in r.stdout
    assert "verified:" not in r.stdout
    run = tmp_path / "dur" / "r1"  # a durable run dir where no checkpoint is committed
    (run / "checkpoints" / "step_3.pt").mkdir(parents=True)
    r = onbox_verify(str(run))
    assert r.returncode == 1 and "no committed checkpoint" in r.stderr
    write_manifest(str(d), step=58)  # a manifest whose step was guessed wrong: verify shows both
    r = onbox_verify(str(d))
    assert r.returncode == 0 and r.stdout.splitlines()[-1].startswith("verified: %s (size and sha256" % d)
    assert "step 60 (read from model.pt:iter_num; the manifest says 58)" in r.stdout


@pytest.mark.integration
def test_verify_load_without_torch_fails_unless_no_load_ok(tmp_path):
    good = write_torch_zip(str(tmp_path / "ck" / "model.pt"), obj={"step": 3})
    fake = tmp_path / "notorch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('torch is broken on this box (test)')\n")
    env = {"PYTHONPATH": "%s%s%s" % (tmp_path / "notorch", os.pathsep, subprocess_env()["PYTHONPATH"])}
    r = onbox_verify("--load", good, extra_env=env)
    assert r.returncode == 3 and "verified:" not in r.stdout
    assert "not loaded: torch is not importable here (ImportError: torch is broken on this box (test))" in r.stdout
    assert "--no-load-ok" in r.stderr
    r = onbox_verify("--load", "--json", good, extra_env=env)
    doc = json.loads(r.stdout)
    assert r.returncode == 3 and doc["ok"] is False and doc["loaded"] is None and doc["load_unavailable"] is True
    assert doc["load_note"].startswith("not loaded: torch is not importable here")
    r = onbox_verify("--load", "--no-load-ok", good, extra_env=env)
    assert r.returncode == 0 and "--no-load-ok: format and hash checks only" in r.stdout
    assert r.stdout.splitlines()[-1].startswith("verified: ")
    flip_byte(good, 300)  # corruption wins over the missing torch: exit 1
    r = onbox_verify("--load", good, extra_env=env)
    assert r.returncode == 1 and "CRC" in r.stderr


def test_a_load_that_loads_nothing_is_never_claimed(tmp_path):
    """--load on a checkpoint with no torch or safetensors file (or only files weights_only refuses): `loaded` stays
    None, the note says why, nothing in `checked` says "load"; the other checks stand (ok). One loadable file among
    them: loaded 1."""
    d = tmp_path / "step_100"
    d.mkdir()
    (d / "model.dat").write_bytes(os.urandom(4096))
    (d / "meta.json").write_text('{"step": 100}')
    write_manifest(str(d), step=100)
    rep = verify_path(str(d), load=True)
    assert rep.ok and rep.loaded is None
    assert rep.load_note == "not loaded: no torch or safetensors file to load"
    assert not any("load" in c for c in rep.checked) and rep.checkpoints[0]["checked"] == ["size", "sha256", "format"]
    os.unlink(d / "MANIFEST.json")
    with open(d / "objects.pt", "wb") as f:  # a pickle of a Python object: weights_only refuses it by design
        torch.save({"rng": Path("x")}, f)
    write_manifest(str(d), step=100)
    rep = verify_path(str(d), load=True)
    assert rep.ok and rep.loaded is None and rep.load_note.startswith("not loaded: weights_only refused (")
    os.unlink(d / "MANIFEST.json")
    torch.save({"w": torch.zeros(2)}, str(d / "weights.pt"))
    write_manifest(str(d), step=100)
    rep = verify_path(str(d), load=True)
    assert rep.ok and rep.loaded is True and rep.load_note.startswith("loaded 1 file(s) with torch ")
    assert "weights_only refused (Python objects, not corruption; format checks only): objects.pt" in rep.load_note
