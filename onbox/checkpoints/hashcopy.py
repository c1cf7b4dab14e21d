"""One read pass that copies and hashes a file, and the hash every manifest uses.

The hash is SHA-256. Measured on this project's machines (x86-64 with SHA-NI, OpenSSL-backed hashlib):
sha256 1.5 GB/s, blake2b 0.75 GB/s, md5 0.58 GB/s, sha512 0.67 GB/s on one core (tests/bench/bench_checkpoints.py
prints the figures again). Every x86 CPU since ~2017-2019 (Zen, Ice Lake) and ARMv8 servers have SHA-256
instructions; blake2b in hashlib is portable C without them. SHA-256 also lets a user check a file with plain
`sha256sum` and rclone backends that support it. The manifest names its algorithm, so verify accepts others.

Three ways to copy, the first the filesystems allow:
- direct (a destination on a block device): the source is read into page-aligned buffers, hashed there, and the
  very same buffers are written with O_DIRECT by a second thread while the next one is read and hashed. The bytes
  handed to the disk are the bytes hashed, with no second copy through the page cache and no writeback left for
  the fsync: the hash is the only real CPU cost (tests/bench/bench_checkpoints.py prints the split).
- in-kernel copy_file_range (both files on one filesystem that does not take O_DIRECT): the copy is opaque (a
  server-side copy on a network filesystem, a FUSE daemon's), so the hasher reads what landed, the
  destination's pages through mmap, in a second thread; then POSIX_FADV_DONTNEED starts their writeback.
- through user space (EXDEV across mounts): big reads, hashed in a thread, written, writeback started as above.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
import queue
import threading
from typing import Any, Callable, List, Optional, Tuple

HASH_NAME = "sha256"
CHUNK = 8 * 1024 * 1024  # large reads: fewer syscalls, full-speed sequential I/O
CFR_CHUNK = 64 * 1024 * 1024  # per copy_file_range call: one hasher hand-off each
WRITEBACK_EVERY = 64 * 1024 * 1024
DIRECT_CHUNK = 8 * 1024 * 1024  # per read and O_DIRECT write (2 GiB measured here: 1.00 s, 1.12-1.19 s at 32 MiB)
DIRECT_BUFFERS = 3  # one being read and hashed, one being written, one spare: the two sides never wait on a buffer
DIRECT_ALIGN = 4096  # O_DIRECT wants offsets, lengths and memory aligned to the device's block (512 or 4096 bytes)

PAUSE_ENV = "ONBOX_TEST_PAUSE_AT"  # TEST ONLY: see pause_from_env
PAUSE_MAX_S = 120.0


def pause_from_env(spec: Optional[str]) -> Optional[Callable[[str], None]]:
    """TEST ONLY (never set it on a real run): `ONBOX_TEST_PAUSE_AT=LABEL:N:GATE` makes the agent stop at the N-th
    time it passes the fault point LABEL (before-manifest comes right after a commit's lease check, before-lease
    right before a launch writes its lease, after-lease right after it took it, before its first write), create
    GATE.waiting and wait until GATE exists (at most 120 s): a real-process test holds an agent inside the race
    window between its lease check and its manifest write. Anything malformed is ignored."""
    import time

    label, _, rest = (spec or "").partition(":")
    count, _, gate = rest.partition(":")
    if not label or not count.isdigit() or not gate:
        return None
    seen = [0]

    def pause(at: str) -> None:
        if at != label:
            return
        seen[0] += 1
        if seen[0] != int(count):
            return
        with open(gate + ".waiting", "w"):
            pass
        deadline = time.monotonic() + PAUSE_MAX_S
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.02)

    return pause


# tests inject a crash point: called with a label at each step of a commit (see tests/unit/test_ckpt_crash.py)
fault_hook: Optional[Callable[[str], None]] = pause_from_env(os.environ.get(PAUSE_ENV))


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


def direct_io_suits(path: str) -> bool:
    """Whether copies into the directory `path` should use O_DIRECT: only on a filesystem that sits on a block
    device (a disk, a cloud volume, LVM; st_dev has a major number). On NFS and FUSE a direct write waits for the
    server or the daemon, with no write-behind (FUSE ones may also refuse it), and tmpfs has no disk: they keep
    the buffered copy."""
    try:
        return os.major(os.stat(path).st_dev) != 0
    except OSError:
        return False


def copy_and_hash(src: str, dst: str, hash_name: str = HASH_NAME, fsync: bool = True,
                  direct: bool = False) -> Tuple[int, str]:
    """Copy src to a NEW file dst (O_EXCL), fsync it unless told not to (the caller then must, see
    fsync_file); return (size, hex digest of the bytes in dst). `direct`: try O_DIRECT first (direct_io_suits).

    The digest always describes what landed (U33): the buffers written with O_DIRECT are the ones hashed; an
    in-kernel copy_file_range is checked by hashing the destination's pages; a user-space copy hashes what it
    writes. See the module's docstring for which path runs where.
    """
    sfd = os.open(src, os.O_RDONLY)
    try:
        _advise(sfd, "POSIX_FADV_SEQUENTIAL")
        dfd = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            size, digest = _copy_direct(sfd, dfd, hash_name) if direct else (-1, "")
            if size < 0:
                size, digest = _copy_hashing_in_thread(sfd, dfd, hash_name)
            if fsync:
                os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
    return size, digest


def _copy_hashing_in_thread(sfd: int, dfd: int, hash_name: str) -> Tuple[int, str]:
    hasher = _Hasher(hash_name)
    hasher.start()
    try:
        size = _copy_in_kernel(sfd, dfd, hasher)
        if size < 0:
            size = _copy_through_user_space(sfd, dfd, hasher)
    finally:
        hasher.q.put(None)  # the hasher still reads dfd: drain it before dfd is closed
        hasher.join()
    if hasher.error is not None:
        raise hasher.error
    return size, hasher.h.hexdigest()


class _DirectWriter(threading.Thread):
    """Writes (buffer, offset, length) items to fd in order, with O_DIRECT while the pieces are aligned, and hands
    each buffer back on `free` once written. The first error stops the writes; the reader sees `error`."""

    def __init__(self, fd: int, buffers: List[mmap.mmap]) -> None:
        super().__init__(daemon=True)
        self.fd = fd
        self.direct = True
        self.free: "queue.Queue[mmap.mmap]" = queue.Queue()
        for b in buffers:
            self.free.put(b)
        self.q: "queue.Queue[Any]" = queue.Queue()
        self.error: Optional[OSError] = None

    def run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            buf, offset, length = item
            if self.error is None:
                try:
                    self._write(buf, offset, length)
                except OSError as e:
                    self.error = e
            self.free.put(buf)

    def _write(self, buf: mmap.mmap, offset: int, length: int) -> None:
        done = 0
        with memoryview(buf) as whole:
            while done < length:
                n = length - done
                if self.direct and (done % DIRECT_ALIGN or (offset + done) % DIRECT_ALIGN):
                    self._buffered()  # after a short read of a file still growing: no aligned piece follows
                elif self.direct and n % DIRECT_ALIGN:
                    n -= n % DIRECT_ALIGN  # the aligned head direct; the file's last bytes buffered, next round
                    if n == 0:
                        self._buffered()
                        continue
                try:
                    with whole[done:done + n] as part:
                        wrote = os.pwrite(self.fd, part, offset + done)
                except OSError as e:
                    if not (self.direct and e.errno == errno.EINVAL):
                        raise
                    self._buffered()  # a device that wants a larger alignment: nothing was written, write it again
                    continue
                if wrote <= 0:
                    raise OSError(errno.EIO, "write of %d bytes at offset %d wrote nothing" % (n, offset + done))
                done += wrote

    def _buffered(self) -> None:
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self.direct = False


def _copy_direct(sfd: int, dfd: int, hash_name: str) -> Tuple[int, str]:
    """Read, hash and write with O_DIRECT (module docstring): (size, digest), or (-1, "") when dfd refuses
    O_DIRECT (nothing written then)."""
    flag = getattr(os, "O_DIRECT", 0)
    try:
        if not flag:
            return -1, ""
        fcntl.fcntl(dfd, fcntl.F_SETFL, fcntl.fcntl(dfd, fcntl.F_GETFL) | flag)
    except OSError:  # EINVAL: this filesystem does no direct I/O
        return -1, ""
    h = hashlib.new(hash_name)
    writer = _DirectWriter(dfd, _thread_buffers())
    writer.start()
    off = 0
    try:
        while writer.error is None:
            buf = writer.free.get()
            n = _read_into(sfd, buf, off)
            if n == 0:
                writer.free.put(buf)
                break
            writer.q.put((buf, off, n))
            with memoryview(buf) as whole, whole[:n] as part:
                h.update(part)  # while the writer writes these same bytes (both only read the buffer)
            off += n
            fault_point("copy-chunk")
    finally:
        writer.q.put(None)
        writer.join()
    if writer.error is not None:
        raise writer.error
    return off, h.hexdigest()


_local = threading.local()


def _thread_buffers() -> List[mmap.mmap]:
    """This thread's direct-copy buffers (anonymous maps: page-aligned), made once and reused for every file it
    copies: fresh ones cost a page fault and a zeroed page every 4 KiB, each time. Unmapped when the thread ends."""
    bufs = getattr(_local, "buffers", None)
    if bufs is None:
        bufs = _local.buffers = [mmap.mmap(-1, DIRECT_CHUNK) for _ in range(DIRECT_BUFFERS)]
    return bufs


def _read_into(fd: int, buf: mmap.mmap, offset: int) -> int:
    """Fill buf from fd at offset; fewer bytes only at the end of the file."""
    got = 0
    with memoryview(buf) as whole:
        while got < len(whole):
            with whole[got:] as rest:
                n = os.preadv(fd, [rest], offset + got)
            if n == 0:
                break
            got += n
    return got


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
