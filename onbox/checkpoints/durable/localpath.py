"""The durable target on a mounted filesystem (network volume, NFS, a platform's shared FS): payload copied into a
staging dir, renamed into place (atomic here), manifest last.

Whoever can write the durable dir (another box of the fleet, anyone with the volume) could plant a symlink where
onbox writes: `<run>/leases`, `logs`, `quarantine` or `checkpoints` pointing elsewhere once redirected the agent's
lease files, logs, quarantined checkpoints and commits there, as root. So every directory onbox writes under the
durable root is checked right before the write (`_real_dir`): each part below the root a real directory, none a
symlink. The root itself (`--durable`) is the user's choice and may be a link.
"""
from __future__ import annotations

import os
import shutil
import stat
from typing import Any, Callable, Dict, List, Optional, Tuple

from onbox import fsutil, untrusted
from onbox.checkpoints import INDEX, MANIFEST, NotARealDir, sync_failed_from_oserror
from onbox.checkpoints.durable import (
    LEASE_MAX_BYTES,
    LEASES_DIR,
    PARTIAL_MARKER,
    QUARANTINE_DIR,
    STAGING_PREFIX,
    FileHashes,
    foreign_entry,
    hashcopy,
    manifest,
    steptimes,
)
from onbox.checkpoints.durable.manifest import check_files as manifest_check_files


class LocalPathTarget:
    """A mounted filesystem: network volume, NFS, a platform's shared FS. Rename is atomic here."""

    def __init__(self, base: str, run: str) -> None:
        self.base = os.path.abspath(os.path.expanduser(base))
        self.run_root = os.path.join(self.base, run)
        self.ckpts = os.path.join(self.run_root, "checkpoints")
        self.url = self.run_root

    def _ensure(self) -> None:
        try:
            os.makedirs(self.base, exist_ok=True)
            self._real_dir(self.ckpts)
        except OSError as e:  # U33: mkdir on an inode-exhausted disk fails; say so
            raise sync_failed_from_oserror(self.ckpts, e)

    def _real_dir(self, path: str, create: bool = True) -> bool:
        """Check (and make, with `create`) `path`, the durable root or a dir below it, as real directories all the
        way down from the root: a part that is a symlink or not a directory is a NotARealDir naming it, and nothing
        is written. False when a part is missing and `create` is not set."""
        rel = os.path.relpath(path, self.base)
        parts = [] if rel == "." else rel.split(os.sep)
        if parts and parts[0] == "..":
            raise AssertionError("%s is not under the durable root %s" % (path, self.base))
        cur = self.base
        for part in parts:
            cur = os.path.join(cur, part)
            try:
                st = os.lstat(cur)
            except FileNotFoundError:
                if not create:
                    return False
                try:
                    os.mkdir(cur)
                except FileExistsError:  # made at the same moment by another writer: judged below
                    pass
                st = os.lstat(cur)
            if stat.S_ISLNK(st.st_mode):
                try:
                    to = " (to %s)" % untrusted.printable(os.readlink(cur))
                except OSError:
                    to = ""
                raise NotARealDir("refusing to write under %s: %s is a symlink%s, and onbox writes only into real "
                                  "directories below the durable root %s" % (path, cur, to, self.base),
                                  hint="someone with write access to the durable storage may be redirecting "
                                       "onbox's writes: remove the link (onbox makes the directory again) and check "
                                       "who can write there", errno_name="ELOOP")
            if not stat.S_ISDIR(st.st_mode):
                what = "a regular file" if stat.S_ISREG(st.st_mode) else untrusted.describe_mode(st.st_mode)
                raise NotARealDir("refusing to write under %s: %s is %s, where onbox keeps a directory of the run"
                                  % (path, cur, what), hint="move it aside; onbox makes the directory again",
                                  errno_name="ENOTDIR")
        return True

    def free_space(self) -> Optional[fsutil.FreeSpace]:
        return fsutil.free_space(self.ckpts)

    def list_names(self) -> List[str]:
        try:
            return sorted(n for n in os.listdir(self.ckpts) if not n.startswith("."))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def read_manifest(self, name: str) -> Optional[Dict[str, Any]]:
        """The checked manifest, None when there is none, BadManifest when one is there and refused."""
        if untrusted.name_problem(name):
            return None  # never a name listdir gives; not a path to follow
        path = os.path.join(self.ckpts, name, MANIFEST)
        try:
            raw = untrusted.read_bytes(path, untrusted.MANIFEST_MAX_BYTES, "MANIFEST.json")
        except (FileNotFoundError, NotADirectoryError):
            return None
        except untrusted.UntrustedInput as e:
            raise manifest.BadManifest("MANIFEST.json of %s refused: %s" % (name, e))
        except OSError as e:
            if not os.path.lexists(path):
                return None
            raise manifest.BadManifest("MANIFEST.json of %s refused: cannot read it (%s)" % (name, e.strerror or e))
        return manifest.parse(raw, name)

    def has_manifest(self, name: str) -> bool:
        """A MANIFEST.json is there (committed, or refused by read_manifest: either way not a leftover)."""
        return os.path.lexists(os.path.join(self.ckpts, name, MANIFEST))

    def put_payload(self, name: str, root: str, files: List[str], hash_name: str) -> FileHashes:
        self._ensure()
        final = os.path.join(self.ckpts, name)
        staging = os.path.join(self.ckpts, fsutil.fit_name(name, ".%d" % os.getpid(), prefix=STAGING_PREFIX))
        out: FileHashes = {}
        try:
            os.mkdir(staging)
            with open(os.path.join(staging, PARTIAL_MARKER), "wb"):
                pass
            made = {staging}
            for rel in files:
                parent = os.path.dirname(os.path.join(staging, rel))
                if parent not in made:
                    os.makedirs(parent, exist_ok=True)
                    while parent not in made:  # every new level, so each gets its fsync below
                        made.add(parent)
                        parent = os.path.dirname(parent)
            out = copy_files(root, staging, files, hash_name)
            with steptimes.phase("fsync dirs"):
                for d in sorted(made, key=len, reverse=True):
                    fsutil.fsync_dir(d)
            hashcopy.fault_point("before-rename")
            if os.path.lexists(final):  # a manifest-less leftover of an interrupted commit
                if self.has_manifest(name):
                    raise FileExistsError("refusing to replace committed checkpoint %s" % final)
                if os.path.islink(final) or not os.path.lexists(os.path.join(final, PARTIAL_MARKER)):
                    raise foreign_entry(self.run_root, name)
                self._discard(name)
            with steptimes.phase("rename"):
                os.rename(staging, final)
                fsutil.fsync_dir(self.ckpts)
            hashcopy.fault_point("after-rename")
        except OSError as e:
            shutil.rmtree(staging, ignore_errors=True)  # clean the partial temp; never touch committed ones
            raise sync_failed_from_oserror(self.ckpts, e)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return out

    def put_manifest(self, name: str, manifest: Dict[str, Any]) -> None:
        try:
            if not self._real_dir(os.path.join(self.ckpts, name), create=False):
                raise FileNotFoundError(2, "the checkpoint's payload is gone", os.path.join(self.ckpts, name))
            fsutil.atomic_write_json(os.path.join(self.ckpts, name, MANIFEST), manifest)
        except OSError as e:
            raise sync_failed_from_oserror(self.ckpts, e)
        try:  # committed: the marker has done its job (a leftover one is harmless: the manifest rules)
            os.unlink(os.path.join(self.ckpts, name, PARTIAL_MARKER))
        except OSError:
            pass

    def remove(self, name: str) -> None:
        if not self._real_dir(self.ckpts, create=False):
            return
        try:
            self._discard(name)
        except FileNotFoundError:
            return

    def _discard(self, name: str) -> None:
        """Delete checkpoints/<name> (a checkpoint, or an interrupted commit's leftover): one atomic rename to a
        staging name first, so that it stops existing at once and a kill during the delete leaves a staging dir
        that the next start cleans. An in-place delete could remove the `.onbox-partial` marker first and be killed
        after it: the manifest-less dir left then reads as not onbox's, is never removed, and blocks every later
        commit of that name. (Unique: a leftover of a killed removal under the same pid, common in containers,
        must not block this one.)"""
        doomed = os.path.join(self.ckpts, fsutil.fit_name(name, ".del.%d.%s" % (os.getpid(), os.urandom(4).hex()),
                                                          prefix=STAGING_PREFIX))
        hashcopy.fault_point("before-discard")
        os.rename(os.path.join(self.ckpts, name), doomed)
        fsutil.fsync_dir(self.ckpts)
        hashcopy.fault_point("after-discard")
        _delete(doomed)

    def quarantine(self, name: str, stamp: str) -> str:
        qdir = os.path.join(self.run_root, QUARANTINE_DIR)
        dest = os.path.join(qdir, fsutil.fit_name(name, "." + stamp))
        try:
            self._real_dir(self.ckpts, create=False)
            self._real_dir(qdir)
            os.rename(os.path.join(self.ckpts, name), dest)  # one atomic rename: gone for readers at once
            fsutil.fsync_dir(self.ckpts)
            fsutil.fsync_dir(qdir)
        except OSError as e:
            raise sync_failed_from_oserror(self.ckpts, e)
        return dest

    def read_index(self) -> Optional[Dict[str, Any]]:
        try:
            doc = untrusted.read_json(os.path.join(self.run_root, INDEX), untrusted.INDEX_MAX_BYTES, INDEX)
        except (OSError, ValueError):
            return None  # the manifests are the truth: an index that cannot be read is rebuilt from them
        return doc if isinstance(doc, dict) else None

    def write_index(self, doc: Dict[str, Any]) -> None:
        try:
            self._real_dir(self.run_root)
            fsutil.atomic_write_json(os.path.join(self.run_root, INDEX), doc)
        except OSError as e:
            raise sync_failed_from_oserror(self.run_root, e)

    def clean_leftovers(self, before_write: Optional[Callable[[], None]] = None) -> List[str]:
        checked = [before_write is None]

        def writing() -> None:
            if not checked[0]:
                checked[0] = True
                assert before_write is not None
                before_write()
        try:
            if not self._real_dir(self.ckpts, create=False):
                return []
            return self._clean_leftovers(writing)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise sync_failed_from_oserror(self.ckpts, e)

    def _clean_leftovers(self, writing: Callable[[], None]) -> List[str]:
        removed = []
        names = os.listdir(self.ckpts)
        for n in names:
            path = os.path.join(self.ckpts, n)
            if os.path.islink(path):
                continue  # not ours (onbox never makes one here): never followed, never deleted
            if n.startswith(fsutil.TMP_PREFIX) and os.path.isfile(path):  # an atomic_write temp
                writing()
                os.unlink(path)
                removed.append(n)
            elif os.path.isdir(path) and n.startswith(STAGING_PREFIX):
                writing()
                _delete(path)  # a kill here leaves it under its staging name: the next start goes on
                removed.append(n)
            elif os.path.isdir(path) and not self.has_manifest(n) and \
                    os.path.lexists(os.path.join(path, PARTIAL_MARKER)):
                writing()
                self._discard(n)
                removed.append(n)
            elif os.path.isdir(path) and not self.has_manifest(n):
                continue  # not ours (no marker): never deleted, never listed as committed
            elif os.path.isdir(path):
                for m in os.listdir(path):
                    if m.startswith(fsutil.TMP_PREFIX):
                        writing()
                        os.unlink(os.path.join(path, m))
        for n in os.listdir(self.run_root):
            if n.startswith(fsutil.TMP_PREFIX):
                writing()
                os.unlink(os.path.join(self.run_root, n))
        return sorted(removed)

    def fetch(self, name: str, files: List[str], dest: str, hash_name: str) -> FileHashes:
        src = os.path.join(self.ckpts, name)
        for rel in files:
            # a payload entry that is a symlink out of the checkpoint (to /etc/shadow, say) would copy a file of
            # this box into the trainer's dir, and the next commit would publish it: read only what lies inside
            untrusted.join_under(src, rel, "checkpoint file")
            untrusted.join_under(dest, rel, "restored file")
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        return copy_files(src, dest, files, hash_name)

    def _put_log(self, local_path: str, name: str) -> None:
        dest = os.path.join(self.run_root, "logs", name)
        logs = os.path.dirname(dest)
        tmp = os.path.join(logs, fsutil.fit_name(os.path.basename(name), prefix=fsutil.TMP_PREFIX))
        try:
            self._real_dir(logs)
            shutil.copyfile(local_path, tmp)
            hashcopy.fsync_file(tmp)
            os.replace(tmp, dest)
            fsutil.fsync_dir(logs)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise sync_failed_from_oserror(logs, e)

    def put_logs(self, local_dir: str, names: List[str], subdir: str) -> None:
        for n in names:
            self._put_log(os.path.join(local_dir, n), "%s/%s" % (subdir, n))

    def list_leases(self) -> List[str]:
        leases = os.path.join(self.run_root, LEASES_DIR)
        try:
            # fail closed: a `leases` that is a file or a link must not read as "no leases" (nothing fenced)
            if not self._real_dir(leases, create=False):
                return []
            return sorted(os.listdir(leases))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise sync_failed_from_oserror(leases, e)

    def read_lease(self, name: str) -> bytes:
        path = os.path.join(self.run_root, LEASES_DIR, name)
        try:
            return untrusted.read_bytes(path, LEASE_MAX_BYTES, "lease file")
        except (FileNotFoundError, untrusted.UntrustedInput, IsADirectoryError):
            raise
        except OSError as e:
            raise sync_failed_from_oserror(path, e)

    def put_lease(self, name: str, doc: Dict[str, Any]) -> None:
        leases = os.path.join(self.run_root, LEASES_DIR)
        try:
            os.makedirs(self.base, exist_ok=True)
            self._real_dir(leases)
            fsutil.atomic_write_json(os.path.join(leases, name), doc)
        except OSError as e:
            raise sync_failed_from_oserror(leases, e)

    def verify(self, name: str, manifest: Dict[str, Any]) -> List[str]:
        return manifest_check_files(os.path.join(self.ckpts, name), manifest)


def _delete(path: str) -> None:
    """rmtree that never follows a link: a staging name that is a symlink (planted) is unlinked, not followed."""
    if os.path.islink(path):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def copy_files(root: str, dest: str, files: List[str], hash_name: str, workers: int = 2) -> FileHashes:
    """Copy+hash files into dest (dirs exist), two at a time (one core hashes each), then fsync them all: the disk
    writes everything in one stream of writeback, like `cp` + `sync`, instead of stopping after each file.
    (O_DIRECT writes of the hashed buffers were tried: 15-20% less CPU, but 1.10-1.17x cp+sync against 0.99-1.00x
    for this page-cache copy on an idle 2-core box, and no faster beside two busy processes: a synchronous write
    per chunk keeps the disk's queue shallower than writeback does.)"""
    from concurrent.futures import ThreadPoolExecutor

    def one(rel: str) -> Tuple[int, str]:
        hashcopy.fault_point("before-file")
        return hashcopy.copy_and_hash(os.path.join(root, rel), os.path.join(dest, rel), hash_name, fsync=False)

    order = sorted(files, key=lambda r: -os.path.getsize(os.path.join(root, r)))
    with steptimes.phase("copy+hash"), ThreadPoolExecutor(max_workers=max(1, min(workers, len(files)))) as pool:
        futures = [(rel, pool.submit(one, rel)) for rel in order]
        out = {rel: f.result() for rel, f in futures}
    with steptimes.phase("fsync files"):
        for rel in order:
            hashcopy.fsync_file(os.path.join(dest, rel))
    return {rel: out[rel] for rel in files}
