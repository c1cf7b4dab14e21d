"""The copy+hash of one file (hashcopy.copy_and_hash) on real files: the O_DIRECT path writes the very bytes it
hashed, its tail and anything unaligned buffered, and falls back when the filesystem or the device refuses; the
split a commit records (phases.py). Seams: a spy around os.pwrite that records whether each write went direct (and
passes it on), and, for a filesystem or device that refuses O_DIRECT, fcntl/pwrite answering EINVAL as their
manuals say such a one does."""
from __future__ import annotations

import errno
import fcntl
import os
import threading

import pytest

from onbox.checkpoints import hashcopy, phases
from onbox.checkpoints.commit import CheckpointCommitter
from onbox.checkpoints.localpath import LocalPathTarget
from onbox.clock import FakeClock
from tests.checkpoint_files import complete_cands, write_torch_zip
from tests.fakes.recorders import EventRecorder

CHUNK = 64 * 1024


@pytest.fixture
def small_chunks(monkeypatch, tmp_path):
    """64 KiB buffers (fresh ones: each thread keeps its own), on a filesystem that takes O_DIRECT."""
    monkeypatch.setattr(hashcopy, "DIRECT_CHUNK", CHUNK)
    monkeypatch.setattr(hashcopy, "_local", threading.local())
    fd = os.open(str(tmp_path / "probe"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError as e:
        pytest.skip("the filesystem of the test's tmp dir does no direct I/O (%s)" % e)
    finally:
        os.close(fd)
        os.unlink(str(tmp_path / "probe"))


@pytest.fixture
def writes(monkeypatch):
    """Every pwrite: (went direct, offset, length), the write itself done by the real os.pwrite."""
    real = os.pwrite
    seen = []

    def spy(fd, data, offset):
        seen.append((bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT), offset, len(data)))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", spy)
    return seen


def _copy(tmp_path, size, **kw):
    src, dst = tmp_path / ("src-%d" % size), tmp_path / ("dst-%d" % size)
    src.write_bytes(os.urandom(size))
    got = hashcopy.copy_and_hash(str(src), str(dst), direct=True, **kw)
    assert got == hashcopy.hash_file(str(src)) == hashcopy.hash_file(str(dst))
    assert dst.read_bytes() == src.read_bytes()
    return got


@pytest.mark.parametrize("size", [0, 1, 4096, 3 * CHUNK, 3 * CHUNK + 100, 2 * CHUNK + 3 * 4096 + 5])
def test_a_direct_copy_writes_its_aligned_chunks_direct_and_only_the_files_last_bytes_buffered(
        tmp_path, small_chunks, writes, size):
    assert _copy(tmp_path, size)[0] == size
    tail = size % 4096
    assert [w for w in writes if not w[0]] == ([(False, size - tail, tail)] if tail else [])
    assert sum(n for direct, _o, n in writes if direct) == size - tail
    assert all(o % 4096 == 0 and n % 4096 == 0 for direct, o, n in writes if direct)


def test_a_filesystem_that_refuses_o_direct_gets_the_buffered_copy(tmp_path, small_chunks, writes, monkeypatch):
    real = fcntl.fcntl

    def no_direct_io(fd, cmd, arg=0):  # fcntl(2): EINVAL when O_DIRECT is asked of a file that cannot do it
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(hashcopy.fcntl, "fcntl", no_direct_io)
    _copy(tmp_path, 5 * CHUNK + 7)
    assert not [w for w in writes if w[0]]


def test_a_device_wanting_a_larger_alignment_gets_the_rest_buffered(tmp_path, small_chunks, writes, monkeypatch):
    spy = os.pwrite

    def big_blocks(fd, data, offset):  # a device of 32 KiB blocks: EINVAL for a direct write not aligned to them
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and (offset % 32768 or len(data) % 32768):
            raise OSError(errno.EINVAL, "Invalid argument")
        return spy(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", big_blocks)
    size = 3 * CHUNK + 8192  # the last chunk is 4 KiB-aligned, so it is tried direct first
    _copy(tmp_path, size)
    assert writes == [(True, 0, CHUNK), (True, CHUNK, CHUNK), (True, 2 * CHUNK, CHUNK), (False, 3 * CHUNK, 8192)]


def test_a_source_cut_short_while_copied_gives_a_short_copy_described_by_its_hash(tmp_path, small_chunks):
    # nanoGPT's torch.save reopens ckpt.pt with O_TRUNC: the source is read, never mapped (a mapped page past the new
    # end of the file is a SIGBUS that kills the agent); the commit then finds the size short and the source changed
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(os.urandom(4 * CHUNK))

    def trainer_saves_again(label):
        if label == "copy-chunk":
            os.truncate(str(src), CHUNK // 2)

    hashcopy.fault_hook = trainer_saves_again
    try:
        size, digest = hashcopy.copy_and_hash(str(src), str(dst), direct=True)
    finally:
        hashcopy.fault_hook = None
    assert size == CHUNK and (size, digest) == hashcopy.hash_file(str(dst))


def test_o_direct_only_where_a_block_device_holds_the_filesystem(tmp_path):
    assert not hashcopy.direct_io_suits("/proc")  # procfs, like tmpfs, NFS and FUSE, has no device number
    assert not hashcopy.direct_io_suits(str(tmp_path / "missing"))


def test_a_commit_records_where_its_time_went_and_its_event_carries_it(tmp_path):
    write_torch_zip(str(tmp_path / "ck" / "checkpoint-5" / "model.pt"), payload=os.urandom(200_000))
    emit = EventRecorder()
    com = CheckpointCommitter(LocalPathTarget(str(tmp_path / "dur"), "r1"), "r1", FakeClock(), emit)
    [cand] = complete_cands(str(tmp_path / "ck"))
    assert com.commit(cand).status == "committed"
    com.apply_retention(keep_last=2)
    steps = {"look-up", "fingerprint", "preflight", "lease checks", "copy+hash", "fsync files", "fsync dirs",
             "rename", "manifest", "index"}
    assert set(com.last_phases.seconds) == steps | {"format check", "retention"}
    assert all(s >= 0 for s in com.last_phases.seconds.values())
    [ev] = emit.of("checkpoint_committed")
    assert steps <= set(ev["phases"]) and "retention" not in ev["phases"]  # retention comes after the event
    with phases.phase("outside a commit"):  # records nowhere, runs its block
        pass
    assert "outside a commit" not in com.last_phases.seconds
