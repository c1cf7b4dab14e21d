"""One read pass that copies and hashes a file, and the hash every manifest uses.

The hash is SHA-256. Measured on this project's machines (x86-64 with SHA-NI, OpenSSL-backed hashlib):
sha256 1.5 GB/s, blake2b 0.75 GB/s, md5 0.58 GB/s, sha512 0.67 GB/s on one core (tests/bench/bench_checkpoints.py
prints the figures again). Every x86 CPU since ~2017-2019 (Zen, Ice Lake) and ARMv8 servers have SHA-256
instructions; blake2b in hashlib is portable C without them. SHA-256 also lets a user check a file with plain
`sha256sum` and rclone backends that support it. The manifest names its algorithm, so verify accepts others.

The copy runs the hash in a second thread (hashlib releases the GIL on large buffers) while the main thread
copies, and asks the kernel to start writeback of what was written (POSIX_FADV_DONTNEED on the destination) so
the disk works during the copy instead of all at the final fsync.
"""
from __future__ import annotations

import errno
import hashlib
import mmap
import os
import queue
import threading
from typing import Any, Callable, Optional, Tuple

HASH_NAME = "sha256"
CHUNK = 8 * 1024 * 1024  # large reads: fewer syscalls, full-speed sequential I/O
CFR_CHUNK = 64 * 1024 * 1024  # per copy_file_range call: one hasher hand-off each
WRITEBACK_EVERY = 64 * 1024 * 1024

# The seam tests set (never a real run): called with a label at each step of a commit and of a lease's take
# (before-manifest comes right after a commit's lease check, before-lease right before a launch writes its lease,
# after-lease right after it took it, before its first write). Unit tests inject a crash or a race there
# (tests/unit/test_ckpt_edges.py); real-agent tests start the agent through a driver that sets it before the
# agent forks (tests/integration/test_fencing.py, PAUSED_AGENT).
fault_hook: Optional[Callable[[str], None]] = None


def fault_point(label: str) -> None:
    if fault_hook is not None:
        fault_hook(label)


class _Hasher(threading.Thread):
    """Hashes what the main thread hands it, in order: bytes, or (fd, offset, length) ranges read via mmap."""

    def __init__(self, hash_name: str) -> None:
        super().__init__(daemon=True)
        self.h = hashlib.new(hash_name)
        self.q: "queue.Queue[Any]" = queue.Queue(maxsize=4)
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            if self.error is not None:
                continue
            try:
                if isinstance(item, bytes):
                    self.h.update(item)
                else:
                    fd, offset, length = item
                    start = offset - offset % mmap.ALLOCATIONGRANULARITY
                    with mmap.mmap(fd, length + offset - start, offset=start, access=mmap.ACCESS_READ) as mm:
                        if hasattr(mm, "madvise"):
                            mm.madvise(mmap.MADV_SEQUENTIAL)
                        view = memoryview(mm)
                        try:
                            self.h.update(view[offset - start:])
                        finally:
                            view.release()
                    # start writeback of what is hashed now; only after the hash, or the kernel could drop the
                    # clean pages first and the hash would read them back from the disk
                    _advise(fd, "POSIX_FADV_DONTNEED", offset, length)
            except (OSError, ValueError) as e:
                self.error = e


def hash_file(path: str, hash_name: str = HASH_NAME) -> Tuple[int, str]:
    """(size, hex digest) of a file, read in large chunks."""
    h = hashlib.new(hash_name)
    size = 0
    with open(path, "rb", buffering=0) as f:
        _advise(f.fileno(), "POSIX_FADV_SEQUENTIAL")
        while True:
            data = f.read(CHUNK)
            if not data:
                break
            h.update(data)
            size += len(data)
    return size, h.hexdigest()


def copy_and_hash(src: str, dst: str, hash_name: str = HASH_NAME, fsync: bool = True) -> Tuple[int, str]:
    """Copy src to a NEW file dst (O_EXCL), fsync it unless told not to (the caller then must, see
    fsync_file); return (size, hex digest of the bytes in dst).

    In-kernel copy_file_range where the two files share a filesystem type that supports it (no user-space copy),
    hashing the destination's pages through mmap while the next chunk copies: the digest describes what landed
    (U33). Elsewhere (EXDEV across mounts on most kernels): read big chunks, hash in a thread, write.
    """
    hasher = _Hasher(hash_name)
    size = 0
    sfd = os.open(src, os.O_RDONLY)
    try:
        _advise(sfd, "POSIX_FADV_SEQUENTIAL")
        dfd = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            hasher.start()
            try:
                size = _copy_in_kernel(sfd, dfd, hasher)
                if size < 0:
                    size = _copy_through_user_space(sfd, dfd, hasher)
            finally:
                hasher.q.put(None)  # the hasher still reads dfd: drain it before dfd is closed
                hasher.join()
            if fsync:
                os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
    if hasher.error is not None:
        raise hasher.error
    return size, hasher.h.hexdigest()


def _copy_in_kernel(sfd: int, dfd: int, hasher: _Hasher) -> int:
    """copy_file_range loop; -1 when the kernel/filesystems cannot do it (nothing written then)."""
    cfr = getattr(os, "copy_file_range", None)
    if cfr is None:
        return -1
    off = 0
    while True:
        try:
            n = cfr(sfd, dfd, CFR_CHUNK, off, off)
        except OSError as e:
            if off == 0 and e.errno in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF):
                return -1
            raise
        if n == 0:
            if off >= os.fstat(sfd).st_size:
                return off
            if off == 0:  # some FUSE/network filesystems "copy" nothing: do it ourselves
                return -1
            # a short in-kernel copy: finish through user space from where it stopped
            os.lseek(sfd, off, os.SEEK_SET)
            os.lseek(dfd, off, os.SEEK_SET)
            return off + _copy_through_user_space(sfd, dfd, hasher)
        hasher.q.put((dfd, off, n))  # the hasher also starts the writeback of this range once hashed
        off += n
        fault_point("copy-chunk")


def _copy_through_user_space(sfd: int, dfd: int, hasher: _Hasher) -> int:
    size = pending = 0
    while True:
        data = os.read(sfd, CHUNK)
        if not data:
            return size
        hasher.q.put(data)
        view = memoryview(data)
        while view:
            n = os.write(dfd, view)
            view = view[n:]
        size += len(data)
        pending += len(data)
        if pending >= WRITEBACK_EVERY:
            _advise(dfd, "POSIX_FADV_DONTNEED", size - pending, pending)
            pending = 0
            fault_point("copy-chunk")


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _advise(fd: int, advice: str, offset: int = 0, length: int = 0) -> None:
    fn = getattr(os, "posix_fadvise", None)
    if fn is None or not hasattr(os, advice):
        return
    try:
        fn(fd, offset, length, getattr(os, advice))
    except OSError:
        pass
