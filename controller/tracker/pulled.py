"""What the tracker can say about "pulled home and verified" for a run's newest durable checkpoint.

Two sources meet here, and neither is the box itself:
- the box's newest heartbeat: `checkpoint.latest_durable` {name, step, committed_at, digest} (the commit's content
  digest over every file, as written in its MANIFEST.json) and `checkpoint.verified` (the box verified it);
- this machine's pulls record (`onboxctl pull` writes $ONBOX_CONFIG_DIR/pulls.json): each pulled checkpoint with
  its local path and whether `onbox verify` passed on it here.

A pulled checkpoint counts as the box's newest only when the MANIFEST.json of the local copy carries the same
digest as the beat (U33: trust the artifact you have, not a line that says it was synced). What the tracker
cannot know: a pull made on another machine (another pulls record), a commit after the box's newest beat, and
whether the box's manifest changed since. The teardown gate (`onboxctl down`) asks the box over ssh and is the
one that decides.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, Optional, Tuple

from controller.results.pull import read_pulls
from onbox import untrusted

log = logging.getLogger("onbox.tracker")

CANNOT_KNOW = ("from the box's newest beat and this machine's pulls record (%s): a pull made on another machine, "
               "or a commit after the newest beat, is not seen here; `onboxctl down` checks the box itself")


class PullsView:
    """Reads the pulls record when it changed (size and mtime) and each pulled manifest's digest once."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = path
        self._stamp: Optional[Tuple[int, int]] = None
        self._pulls: Dict[str, Any] = {}
        self._problem: Optional[str] = None
        self._digests: Dict[str, Tuple[Tuple[int, int], Optional[str]]] = {}

    @property
    def caveat(self) -> str:
        return CANNOT_KNOW % (self.path or "none")

    def refresh(self) -> None:
        """Read the pulls record again if it changed (one stat when it did not)."""
        if not self.path:
            return
        try:
            st = os.stat(self.path)
        except OSError:
            self._stamp, self._pulls, self._problem = None, {}, None
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self._pulls, self._problem = read_pulls(self.path)["pulls"], None
        except (OSError, ValueError) as e:
            # served without the pulled data ("unknown" on every run, `pulls_problem` in the answer), never a 500
            self._pulls = {}
            self._problem = "the pulls record %s is unreadable: %s" % (self.path, untrusted.reason(e))
            log.warning("onbox tracker: %s; runs show their pull as unknown until it is fixed", self._problem)

    @property
    def problem(self) -> Optional[str]:
        """Why the pulls record could not be used (as of the last refresh()), else None."""
        return self._problem

    def _manifest_digest(self, path: Any) -> Optional[str]:
        """The `digest` of <path>/MANIFEST.json (the local copy), None when it is gone or has none."""
        if not isinstance(path, str):
            return None
        manifest = os.path.join(path, "MANIFEST.json")
        try:
            st = os.stat(manifest)
        except OSError:
            return None
        stamp = (st.st_mtime_ns, st.st_size)
        cached = self._digests.get(manifest)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        try:
            doc = untrusted.read_json(manifest, untrusted.MANIFEST_MAX_BYTES, "pulled manifest")
            digest = doc.get("digest") if isinstance(doc, dict) else None
        except (OSError, ValueError):  # a refused one (a FIFO, too deep) too: no digest, the pull shows as stale
            digest = None
        digest = digest if isinstance(digest, str) else None
        self._digests[manifest] = (stamp, digest)
        return digest

    def verdict(self, box: Optional[str], run: str, durable: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        """{status, text}: verified | stale | failed | older | not_pulled | no_checkpoint | unknown (as of the
        last refresh())."""
        if not durable or not durable.get("name"):
            return {"status": "no_checkpoint", "text": "no durable checkpoint reported yet"}
        if not self.path or self._problem:
            return {"status": "unknown", "text": self._problem or "no pulls record on this tracker"}
        name = str(durable["name"])
        entry = self._pulls.get("%s/%s" % (box, run))
        pulled = entry.get("checkpoints") if isinstance(entry, dict) else None
        pulled = pulled if isinstance(pulled, dict) else {}
        rec = pulled.get(name)
        if not isinstance(rec, dict):
            if pulled:
                return {"status": "older", "text": "newest %s not pulled; pulled here: %s" % (
                    name, ", ".join(sorted(str(k) for k in pulled)[-3:]))}
            return {"status": "not_pulled", "text": "%s not pulled to this machine" % name}
        if not rec.get("ok"):
            return {"status": "failed", "text": "pulled %s, verification failed: %s" % (
                name, str(rec.get("error") or "see `onboxctl pull`")[:300])}
        local = self._manifest_digest(rec.get("path"))
        want = durable.get("digest")
        at = rec.get("verified_at")
        if local is None:
            return {"status": "stale", "text": "pulled and verified %s, but its local copy is gone from %s" % (
                name, rec.get("path")), "verified_at": at}
        if isinstance(want, str) and want and local != want:
            return {"status": "stale", "text": "pulled %s differs from the box's (re-committed since): pull again"
                    % name, "verified_at": at}
        if not want:
            return {"status": "verified", "text": "pulled and verified %s (the beat carries no digest to match)"
                    % name, "verified_at": at}
        return {"status": "verified", "text": "pulled and verified %s, same digest as the box's" % name,
                "verified_at": at}
