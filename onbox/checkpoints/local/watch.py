"""Which entries of the checkpoint dir the trainer finished, as the kernel saw it: inotify (through ctypes: nothing
to install, nothing in the pyz) on the dir's top level, read without blocking at each scan.

  IN_MOVED_TO    an entry renamed into the dir (the save-to-a-temp-name-then-rename recipe): finished, "renamed"
  IN_CLOSE_WRITE a file closed after writing: finished, "closed"
  IN_CREATE, IN_MODIFY: being written (again): not finished until its next close or rename
  IN_DELETE, IN_MOVED_FROM: gone
  IN_Q_OVERFLOW  events were lost: nothing is known to be finished (the quiet rule decides, as without inotify)

Where inotify is not there (not Linux, a filesystem without it such as most network mounts, the watch limit
reached), `available` is False and finished() answers None for every name: the caller judges by stability across
scans (size, mtime, inode unchanged for the settle period). A network filesystem may also show no event for a
write made on another host: the quiet rule still applies there.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
from typing import Dict, Optional

IN_MODIFY = 0x00000002
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000
MASK = IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF
EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name, NUL-padded)
READ_BYTES = 64 * 1024
MAX_NAMES = 100_000  # names remembered; past it the oldest are forgotten (they fall back to the quiet rule)


def _libc() -> Optional[ctypes.CDLL]:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.inotify_init1.argtypes = [ctypes.c_int]
        lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        return lib
    except (OSError, AttributeError):
        return None


class DirWatch:
    """The finishing events of one directory's top-level entries. Not thread-safe: read from one thread."""

    def __init__(self, path: str, enabled: bool = True) -> None:
        self.path = path
        self.fd = -1
        self.problem: Optional[str] = None  # why there is no watch (for the status line), or None
        self._state: Dict[str, str] = {}  # name -> "renamed" | "closed"
        if not enabled:
            self.problem = "inotify turned off"
            return
        self._start()

    @property
    def available(self) -> bool:
        return self.fd >= 0

    def _start(self) -> None:
        lib = _libc()
        if lib is None:
            self.problem = "no inotify in this C library"
            return
        fd = lib.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            self.problem = "inotify_init1: %s" % os.strerror(ctypes.get_errno())
            return
        if lib.inotify_add_watch(fd, os.fsencode(self.path), MASK | IN_ONLYDIR) < 0:
            self.problem = "inotify_add_watch %s: %s" % (self.path, os.strerror(ctypes.get_errno()))
            os.close(fd)
            return
        self.fd = fd

    def poll(self) -> None:
        """Read every event queued since the last poll, without blocking."""
        while self.fd >= 0:
            try:
                buf = os.read(self.fd, READ_BYTES)
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                self.problem = "reading inotify events: %s" % e
                self.close()
                return
            if not buf:
                return
            self._take(buf)

    def _take(self, buf: bytes) -> None:
        at = 0
        while at + EVENT.size <= len(buf):
            _wd, mask, _cookie, n = EVENT.unpack_from(buf, at)
            name = buf[at + EVENT.size:at + EVENT.size + n].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            at += EVENT.size + n
            if mask & IN_Q_OVERFLOW:
                self._state.clear()  # events were lost: nothing is known to be finished
            elif mask & (IN_DELETE_SELF | IN_IGNORED):
                self.problem = "the checkpoint dir was removed or replaced"
                self._state.clear()
                self.close()
                return
            elif not name:
                continue
            elif mask & IN_MOVED_TO:
                self._remember(name, "renamed")
            elif mask & IN_CLOSE_WRITE:
                self._remember(name, "closed")
            elif mask & (IN_CREATE | IN_MODIFY | IN_DELETE | IN_MOVED_FROM):
                self._state.pop(name, None)

    def _remember(self, name: str, how: str) -> None:
        self._state.pop(name, None)
        self._state[name] = how
        if len(self._state) > MAX_NAMES:
            del self._state[next(iter(self._state))]

    def finished(self, name: str) -> Optional[str]:
        """How the entry `name` was finished ("renamed" or "closed") with nothing written to it since, or None
        (being written, gone, never seen finishing, or no watch)."""
        return self._state.get(name)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:
            pass
