"""The two layouts torch.save writes, read without torch and without running any of the file's code.

  zip (torch >= 1.6, the default): every member lives under one top-level dir `<archive>/` (the file's stem, or
    "archive" when saved to a buffer, as Lightning does). `<archive>/data.pkl` pickles the object with each tensor
    storage as a persistent id ('storage', <type>, <key>, <location>, <numel>); `<archive>/data/<key>` holds that
    storage's raw bytes; `<archive>/version` (or `.data/version`) is what torch.load requires besides data.pkl.
    torch 2.x adds `byteorder`, `.format_version`, `.storage_alignment`, `.data/serialization_id`. The central
    directory is written last, so a save cut short has none.
  legacy (`_use_new_zipfile_serialization=False`): pickles back to back — the magic number, the protocol version
    1001, a sys_info dict, the object (storages as persistent ids, as above, plus a view field), the sorted storage
    keys — then each storage in key order: its element count as an int64, then its bytes. Nothing checksums it.

Pickles are read by SafeUnpickler: every global becomes an inert placeholder class that records its arguments and
imports nothing, persistent ids become StorageRef records, so no code of the file runs and no storage is read.
"""
from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from onbox.checkpoints.formats.base import StepReading, step_in

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER
LEGACY_PROTOCOL = 1001  # torch.serialization.PROTOCOL_VERSION
MAGIC_PICKLE = pickle.dumps(MAGIC_NUMBER, protocol=2)  # what torch.save's default pickle_protocol=2 writes first
# data.pkl holds the object graph only (tensors live in their own members): ~14 KB for a 6-layer nanoGPT ckpt.pt
# with its AdamW state, ~27 KB for GPT-2 124M's, 3 KB for a small Lightning .ckpt; about 90 bytes per tensor, so
# ~5 MB for a 55k-tensor MoE model with its optimizer state. Unpickling costs ~0.12 s and ~25 MB per MB here;
# 16 MiB (~180k tensors) bounds it to ~2 s. A pickle past it inlines something big (numpy arrays, a dataset).
PICKLE_LIMIT = 16 * 1024 * 1024
LEGACY_FIRST_READ = 64 * 1024  # enough for the legacy object pickle of most checkpoints in one read

# bytes per element of each storage type a pickle can name (UntypedStorage counts bytes: torch 2.x uses it for
# the dtypes without a typed storage class, float8, uint16 ...)
STORAGE_ELEMENT_BYTES = {
    "UntypedStorage": 1, "ByteStorage": 1, "CharStorage": 1, "BoolStorage": 1, "QInt8Storage": 1,
    "QUInt8Storage": 1, "QUInt4x2Storage": 1, "QUInt2x4Storage": 1, "ShortStorage": 2, "HalfStorage": 2,
    "BFloat16Storage": 2, "IntStorage": 4, "FloatStorage": 4, "QInt32Storage": 4, "LongStorage": 8,
    "DoubleStorage": 8, "ComplexFloatStorage": 8, "ComplexDoubleStorage": 16,
}


class Unreadable(Exception):
    """The bytes are not what the layout says (a damaged or foreign file)."""


class Truncated(Unreadable):
    """The layout runs past the end of the file."""


class _BadHeader(Unreadable):
    """The legacy header pickles parse but say this is not a torch file (no point reading more bytes)."""


class TooLarge(Exception):
    """A pickle over PICKLE_LIMIT: not read (bounded work)."""


class Inert:
    """What a pickled global becomes: calling it, constructing it or restoring its state only records data."""

    __slots__ = ("args", "elements", "entries", "state")  # light: a checkpoint's pickle makes ~3 per tensor
    global_name = "?"
    args: Tuple[Any, ...]
    entries: Dict[Any, Any]  # set on first use, like the two below
    elements: List[Any]
    state: Any

    def __new__(cls, *args: Any, **kwargs: Any) -> "Inert":
        obj = object.__new__(cls)
        obj.args = args
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:  # SETITEM(S): an OrderedDict, a defaultdict ...
        if not hasattr(self, "entries"):
            self.entries = {}
        self.entries[key] = value

    def __setstate__(self, state: Any) -> None:  # BUILD
        self.state = state

    def __call__(self, *args: Any, **kwargs: Any) -> "Inert":
        return Inert(*args)  # an attribute fetched with getattr, then called: still nothing runs

    def append(self, value: Any) -> None:  # APPEND(S), ADDITEMS
        self.extend([value])

    def extend(self, values: Any) -> None:
        if not hasattr(self, "elements"):
            self.elements = []
        self.elements.extend(values)

    add = append

    def __repr__(self) -> str:
        return "<%s>" % self.global_name


class StorageRef(NamedTuple):
    """A tensor storage a pickle refers to; its bytes are never read."""

    type_name: str  # "FloatStorage", "UntypedStorage" ...
    key: str
    numel: int  # elements of that type (bytes for UntypedStorage)

    @property
    def element_bytes(self) -> Optional[int]:
        return STORAGE_ELEMENT_BYTES.get(self.type_name)


class SafeUnpickler(pickle.Unpickler):
    """Unpickles without importing or calling anything from the file (find_class returns placeholders)."""

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self._classes: Dict[Tuple[str, str], type] = {}
        self.storages: List[StorageRef] = []

    def find_class(self, module: str, name: str) -> Any:
        # a class, not an instance: NEWOBJ requires a type; REDUCE and INST just call it
        key = (module, name)
        if key not in self._classes:
            self._classes[key] = type("Global", (Inert,), {"__slots__": (), "global_name": "%s.%s" % key})
        return self._classes[key]

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] in ("storage", b"storage"):
            stype, key, numel = pid[1], pid[2], pid[4]
            type_name = getattr(stype, "global_name", "?").rpartition(".")[2]
            if isinstance(key, bytes):
                key = key.decode("ascii", "replace")
            if isinstance(numel, int):
                self.storages.append(StorageRef(type_name, str(key), numel))
        return Inert()


def safe_load(f: Any) -> Tuple[Any, List[StorageRef]]:
    """One pickle from a binary file object: (the object, the storages it refers to)."""
    u = SafeUnpickler(f)
    try:
        obj = u.load()
    except RecursionError as e:
        raise Unreadable("pickle nests too deep: %s" % e)
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            UnicodeDecodeError, OverflowError, struct.error, MemoryError) as e:
        # any malformed pickle ends here; no opcode reaches code outside this module (find_class above)
        raise Unreadable("%s: %s" % (type(e).__name__, e))
    return obj, u.storages


# ---------------------------------------------------------------------------------------------------- zip layout
class ZipLayout(NamedTuple):
    archive: str  # the top-level dir, without the slash
    data_pkl: zipfile.ZipInfo
    problem: Optional[str]  # why this zip is not a torch checkpoint, or None


def zip_layout(zf: zipfile.ZipFile) -> ZipLayout:
    """The torch layout of an open zip (what torch.load requires of it)."""
    infos = zf.infolist()
    if not infos:
        return ZipLayout("", zipfile.ZipInfo(), "an empty zip archive")
    archive = infos[0].filename.partition("/")[0]
    if "/" not in infos[0].filename:
        return ZipLayout("", zipfile.ZipInfo(), "a zip archive whose members are not under one top-level dir "
                                                "(%s)" % infos[0].filename)
    strays = [i.filename for i in infos if not i.filename.startswith(archive + "/")]
    if strays:
        return ZipLayout(archive, zipfile.ZipInfo(), "a zip archive with members outside %s/ (%s)" % (
            archive, strays[0]))
    names = {i.filename: i for i in infos}
    pkl = names.get(archive + "/data.pkl")
    if pkl is None:
        return ZipLayout(archive, zipfile.ZipInfo(), "a zip archive without %s/data.pkl" % archive)
    if archive + "/version" not in names and archive + "/.data/version" not in names:
        return ZipLayout(archive, pkl, "a zip archive without %s/version" % archive)
    return ZipLayout(archive, pkl, None)


def read_zip_object(zf: zipfile.ZipFile, layout: ZipLayout, limit: Optional[int] = None
                    ) -> Tuple[Any, List[StorageRef]]:
    """The object data.pkl pickles (placeholders for globals and storages); TooLarge past `limit` bytes."""
    limit = limit or PICKLE_LIMIT
    if layout.data_pkl.file_size > limit:
        raise TooLarge("%s is %d bytes" % (layout.data_pkl.filename, layout.data_pkl.file_size))
    try:
        raw = zf.read(layout.data_pkl)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as e:
        raise Unreadable("%s: %s" % (layout.data_pkl.filename, e))
    return safe_load(io.BytesIO(raw))


# ------------------------------------------------------------------------------------------------- legacy layout
class LegacyFile(NamedTuple):
    obj: Any
    storages: List[StorageRef]  # as the object pickle refers to them
    keys: List[str]  # the storage keys in file order
    data_offset: int  # where the first storage record starts
    little_endian: bool


def looks_legacy(head: bytes) -> bool:
    """Whether `head` starts with torch's legacy magic-number pickle (any pickle protocol), or is the start of the
    one torch writes (a file cut inside its first 15 bytes)."""
    if head and len(head) < len(MAGIC_PICKLE) and MAGIC_PICKLE.startswith(head):
        return True
    if head[:1] not in (b"\x80", b"L"):  # PROTO (protocol 2+), or protocol 0/1's text LONG
        return False
    try:
        obj, _ = safe_load(io.BytesIO(head))
    except Unreadable:
        return False
    return obj == MAGIC_NUMBER


def read_legacy(path: str, limit: Optional[int] = None, header_only: bool = False) -> LegacyFile:
    """The pickles at the start of a legacy torch file. Reads a growing prefix (64 KiB, then x4 up to `limit`)
    until the object pickle and the key list are whole; never the storages."""
    limit = limit or PICKLE_LIMIT
    size = os.path.getsize(path)
    want = min(LEGACY_FIRST_READ, limit)
    with open(path, "rb") as f:
        while True:
            f.seek(0)
            buf = f.read(want)
            bio = io.BytesIO(buf)
            try:
                return _parse_legacy(bio, header_only)
            except Unreadable as e:
                if bio.tell() < len(buf) or isinstance(e, _BadHeader):
                    raise  # broken where the bytes are, not short of them
                if len(buf) >= size:
                    raise Truncated("the file ends inside its pickles (%d bytes)" % size)
                if want >= limit:
                    raise TooLarge("its pickles exceed %d bytes" % limit)
                want = min(want * 4, limit)


def _parse_legacy(bio: io.BytesIO, header_only: bool) -> LegacyFile:
    magic, _ = safe_load(bio)
    if magic != MAGIC_NUMBER:
        raise _BadHeader("no torch magic number at the start")
    proto, _ = safe_load(bio)
    if proto != LEGACY_PROTOCOL:
        raise _BadHeader("protocol version %r, torch writes %d" % (proto, LEGACY_PROTOCOL))
    sys_info, _ = safe_load(bio)
    if not isinstance(sys_info, dict) or not isinstance(sys_info.get("little_endian"), bool):
        raise _BadHeader("sys_info is not the dict torch writes")
    little = sys_info["little_endian"]
    if header_only:
        return LegacyFile(None, [], [], bio.tell(), little)
    obj, storages = safe_load(bio)
    keys, _ = safe_load(bio)
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise _BadHeader("the storage key list is not a list of strings")
    return LegacyFile(obj, storages, keys, bio.tell(), little)


def walk_legacy_storages(path: str, lf: LegacyFile) -> Optional[str]:
    """Follow the storage records after the pickles (an 8-byte count each, then the data): a problem, or None
    when every storage lies inside the file with the element count its pickle gave."""
    by_key: Dict[str, StorageRef] = {}
    for s in lf.storages:  # the first reference is the one torch wrote the storage for
        by_key.setdefault(s.key, s)
    size = os.path.getsize(path)
    off = lf.data_offset
    fmt = "<q" if lf.little_endian else ">q"
    with open(path, "rb", buffering=0) as f:
        for i, key in enumerate(lf.keys):
            ref = by_key.get(key)
            if ref is None:
                return "storage %s is in the key list but no tensor refers to it" % key
            if ref.element_bytes is None:
                return "storage %s has type %s, which torch does not define" % (key, ref.type_name)
            f.seek(off)
            head = f.read(8)
            if len(head) < 8:
                return "truncated: storage %d of %d starts at byte %d, past the end of the file (%d bytes)" % (
                    i + 1, len(lf.keys), off, size)
            (numel,) = struct.unpack(fmt, head)
            if numel != ref.numel:
                return "storage %s records %d elements where its tensor says %d" % (key, numel, ref.numel)
            off += 8 + numel * ref.element_bytes
            if off > size:
                return "truncated: storage %d of %d ends at byte %d, past the end of the file (%d bytes)" % (
                    i + 1, len(lf.keys), off, size)
    return None


def step_of_torch_file(path: str, label: str) -> Optional[StepReading]:
    """The step a torch checkpoint file (zip or legacy pickle) records in its top-level dict, or None (not a torch
    file, unreadable, torn or too large to read cheaply: the caller falls back to other evidence). Cost: a zip's
    central directory and data.pkl (the tensors are separate members, never read), or a legacy file's leading
    pickles, both bounded by PICKLE_LIMIT."""
    try:
        with open(path, "rb", buffering=0) as f:
            head = f.read(64)
        if head[:4] == b"PK\x03\x04":
            with zipfile.ZipFile(path) as zf:
                layout = zip_layout(zf)
                if layout.problem is not None:
                    return None
                obj, _ = read_zip_object(zf, layout)
        elif looks_legacy(head):
            obj = read_legacy(path).obj
        else:
            return None
    except (OSError, zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, Unreadable, TooLarge):
        return None
    found = step_in(obj)
    return StepReading(found.step, "%s:%s" % (label, found.source)) if found else None
