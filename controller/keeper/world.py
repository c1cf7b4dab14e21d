"""What the keeper does to the world, behind one seam (`World`): ask a box about a run, ask the tracker about the
beats, check a spare, run the provision command, push, launch. The keeper (loop.py, recovery.py) gets a World;
tests pass a scripted one (tests/unit/test_keeper.py), as the elastic agent's tests script their observations.

Every remote call is an `onbox ... --json` command over ssh (controller/boxes/agent.py), never a script; an ssh that
does not reach the box (BoxUnreachable, or no answer within the probe timeout) is an observation, never an error
(`silent` when nothing answered at all: a timeout, no route; a refused connection is the box's kernel answering).
Any other failure (no ssh client here, a bug) is raised: it must never read as "every box is lost".
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from controller.boxes.agent import REMOTE_PUSHED, REMOTE_PYZ, ask
from controller.boxes.inventory import Box, Inventory
from controller.boxes.ssh import BoxUnreachable, RemoteTimeout, Ssh
from controller.keeper.answers import (
    beats_from_tracker,
    observation_from_status,
    on_this_machine,
    tracker_problem,
)
from controller.keeper.decide import UNREADABLE, Beats, Observation
from controller.keeper.policy import LaunchRecord
from controller.keeper.provision import Note, run_provision
from controller.launch.start import LaunchResult
from onbox import untrusted, vocab
from onbox.errors import OnboxError

HEARD = ("refused", "closed", "auth", "host_key_changed", "host_key_unknown")  # ssh failed, the box's host answered
PUSH_FRESH = 60.0  # seconds a push this keeper verified on a box stands for the next one (without a code dir)
PUSHED_MAX = 64 * 1024  # bytes of a box's push record read (ours are ~200 bytes)
AUDIT_SCHEMA = vocab.SCHEMA_AUDIT


class World:
    """The real one: ssh, the tracker, the provision command, the inventory."""

    def __init__(self, ssh: Ssh, inventory: Inventory, probe_timeout: float = 20.0,
                 tracker: Optional[str] = None, token: Optional[str] = None) -> None:
        self.ssh = ssh
        self.inv = inventory
        self.probe_timeout = probe_timeout
        self.tracker = tracker
        self.token = token
        self.tracker_elsewhere_answered = False  # in the newest beats(): a tracker beyond this machine answered
        self._pushed: Dict[Tuple[str, str, Optional[str]], float] = {}  # (box, pyz, code): when pushed and verified
        self._guard = threading.Lock()
        self._pushing: Dict[str, threading.Lock] = {}  # box -> held while a push to it runs (one at a time)

    # -- looking ---------------------------------------------------------------------------------------------
    def box(self, name: str) -> Box:
        return self.inv.resolve(name)

    def boxes(self) -> Dict[str, Box]:
        return self.inv.load()

    def observe(self, box_name: str, run: str) -> Observation:
        try:
            box = self.box(box_name)
            doc, res, _what = ask(self.ssh, box, ["status", run, "--json"], timeout=self.probe_timeout)
        except (BoxUnreachable, RemoteTimeout) as e:
            kind = getattr(e, "kind", None)
            return Observation(box_name, run, reached=False, error=untrusted.printable(e.message),
                               silent=isinstance(e, RemoteTimeout) or kind in ("timeout", "no_route"),
                               heard=kind in HEARD)
        return observation_from_status(box_name, run, doc, res.returncode, res.err_text or res.text)

    def beats(self, runs: Sequence[LaunchRecord]) -> Dict[str, Beats]:
        """The tracker's view of every run's node runs (one request per tracker); none for a run without a tracker
        (ssh alone decides: `unknown`). A tracker that is configured but cannot be read (down, an error, an answer
        runview refuses or the keeper cannot use) makes each of its runs `unreadable`, never absent or late."""
        from controller.tracker.runview import fetch_tracker_runs

        by_url: Dict[str, List[str]] = {}
        for rec in runs:
            url = self.tracker or rec.tracker
            if url:
                by_url.setdefault(url, []).extend(rec.node_runs())
        out: Dict[str, Beats] = {}
        elsewhere = False
        for url in sorted(by_url):
            read: Dict[str, Beats] = {}
            try:
                doc = fetch_tracker_runs(url, self.token, timeout=10.0)
            except (OnboxError, ValueError, OSError, RecursionError) as e:  # down, HTTP errors, refused bodies
                problem: Optional[str] = untrusted.printable(getattr(e, "message", None) or e)
            else:
                read, why = beats_from_tracker(doc), tracker_problem(doc)
                problem = "the tracker at %s answered, but %s" % (url, why) if why else None
                elsewhere = elsewhere or not on_this_machine(url)
            for run in by_url[url]:
                b = read.get(run)
                if b is not None and b.unreadable:
                    b = dataclasses.replace(b, problem="the tracker at %s answered, but %s" % (url, b.problem))
                out[run] = b or (Beats(liveness=UNREADABLE, problem=problem) if problem else Beats(liveness="absent"))
        self.tracker_elsewhere_answered = elsewhere
        return out

    def spare_problem(self, name: str, rec: LaunchRecord, push: bool = True) -> Optional[str]:
        """Why box `name` cannot take the run now (None: healthy and idle): it must answer ssh, pass `onbox audit`
        for the run's durable and checkpoint dirs, and run no live agent. Its pyz is pushed first when missing (not
        with `push` False: then a box without one cannot be checked, and says so). What the box said is shown with
        its control characters as escapes."""
        problem = self._spare_problem(name, rec, push)
        return untrusted.printable(problem)[:600] if problem else None

    def _spare_problem(self, name: str, rec: LaunchRecord, push: bool = True) -> Optional[str]:
        try:
            box = self.box(name)
            asked = time.monotonic()
            doc, res, _ = ask(self.ssh, box, ["status", "--json"], timeout=self.probe_timeout)
            said = res.err_text or res.text
            if "can't open file" in said and "onbox.pyz" in said and not push:
                return ("has no onbox.pyz yet, so `onbox audit` cannot run there (`onboxctl push %s` puts it there; "
                        "the keeper does at a loss)" % name)
            if "can't open file" in said and "onbox.pyz" in said:
                self.push(box, rec, code=False, again=True, unless_since=asked)
                doc = []  # no onbox.pyz a moment ago: no agent of any run there (not asked again: a python less)
            if not isinstance(doc, list):
                return "its agent did not list its runs (exit %d)" % res.returncode
            live = [str(d.get("run")) for d in doc if isinstance(d, dict) and d.get("agent_alive")]
            if live:
                return "runs a live agent (%s)" % ", ".join(live[:3])
            args = ["audit", "--json"] + (["--durable", rec.durable] if rec.durable else []) + (
                ["--ckpt-dir", rec.ckpt_dir] if rec.ckpt_dir else [])
            doc, res, _ = ask(self.ssh, box, args, timeout=max(self.probe_timeout, 60.0))
        except OnboxError as e:
            return e.message
        if not isinstance(doc, dict) or doc.get("schema") != AUDIT_SCHEMA:
            lines = [ln.strip() for ln in (res.err_text or res.text).splitlines() if ln.strip()]
            return "`onbox audit` refused (exit %d): %s" % (res.returncode, lines[-1][:300] if lines else "no output")
        if res.returncode != 0 or doc.get("fit") is not True:
            fails = [c for c in doc.get("checks") or []
                     if isinstance(c, dict) and str(c.get("verdict")).lower() == "fail"]
            first = fails[0] if fails else {}
            return "fails `onbox audit`: %s" % (first.get("summary") or "unfit (exit %d)" % res.returncode)
        return None

    def publish(self, rec: LaunchRecord, events: List[Dict[str, Any]]) -> Optional[str]:
        """The events to the tracker (`POST /api/v1/events`, controller/tracker/API.md); None when stored, else
        why not (they stay in recovery.json and are sent again on a later pass)."""
        import json
        import urllib.error
        import urllib.request

        url = self.tracker or rec.tracker
        if not url:
            return "no tracker"
        body = json.dumps({"events": [dict(e, source="keeper") for e in events]}).encode("utf-8")
        req = urllib.request.Request(url.rstrip("/") + "/api/v1/events", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        if self.token:
            req.add_header("Authorization", "Bearer " + self.token)
        try:
            with urllib.request.urlopen(req, timeout=10.0) as r:
                r.read(65536)
        except urllib.error.HTTPError as e:
            return "the tracker at %s answered HTTP %d%s" % (url, e.code, " (an older tracker without events?)"
                                                             if e.code in (404, 405) else "")
        except (urllib.error.URLError, OSError, ValueError) as e:
            return "cannot reach the tracker at %s: %s" % (url, getattr(e, "reason", e))
        return None

    # -- acting ----------------------------------------------------------------------------------------------
    def provision(self, rec: LaunchRecord, key: str, node: int, note: Optional[Note] = None) -> Box:
        """One try of the run's provision command (provision.py); `note` hears what it left running or printed
        too much of."""
        assert rec.policy.provision
        env = {"ONBOX_RUN": rec.run, "ONBOX_POOL": rec.policy.pool, "ONBOX_NODE": str(node),
               "ONBOX_PROVISION_KEY": key}
        return run_provision(rec.policy.provision, rec.policy.provision_timeout, env, rec.policy.pool, note=note)

    def add_box(self, box: Box) -> None:
        """Into the inventory; a name already there for the same host and port is kept (a script that found its
        box again), one for another host is refused."""
        have = self.inv.load().get(box.name)
        if have is not None:
            if (have.host, have.port) == (box.host, box.port):
                return
            from controller.keeper.provision import ProvisionFailed

            raise ProvisionFailed("the provision command printed box %s (%s), but the inventory already has %s for "
                                  "%s" % (box.name, box.host, box.name, have.host),
                                  hint="let the script name its boxes uniquely (e.g. after ONBOX_PROVISION_KEY)")
        self.inv.add(box)

    def push(self, box: Box, rec: LaunchRecord, code: bool = True, again: bool = False,
             unless_since: Optional[float] = None) -> None:
        """onbox.pyz (and, with `code`, the run's code dir) to `box`, verified there; one push to a box at a time.
        Without the code dir (and unless `again`), no push is made where this keeper made and verified one within
        PUSH_FRESH seconds (the spare's check pushed it a moment before the recovery's push phase), nor where the
        box has this onbox.pyz already, recorded by a push without a code dir (`landed`: one ssh call instead of a
        push's five and a start of the pyz). `unless_since` (monotonic): none is made where this keeper's push of
        the same finished after then (the box was seen without one before another push, a warming, put it there)."""
        from controller.launch.push import default_pyz, push

        pyz = rec.pyz or default_pyz()
        if not os.path.isfile(pyz):
            from onbox.errors import UsageError

            raise UsageError("no onbox.pyz to push to %s at %s" % (box.name, pyz),
                             hint="build it (`make zipapp`) or set ONBOX_PYZ for the keeper")
        code_dir = rec.code if code else None
        key = (box.name, pyz, code_dir)
        with self._guard:
            one_at_a_time = self._pushing.setdefault(box.name, threading.Lock())
        with one_at_a_time:
            with self._guard:
                at = self._pushed.get(key)
            if unless_since is not None and at is not None and at >= unless_since:
                return
            fresh = at is not None and time.monotonic() - at < PUSH_FRESH
            if code_dir is None and not again and (fresh or self.landed(box, pyz)):
                with self._guard:
                    self._pushed[key] = time.monotonic()
                return
            # the secret-looking files the user sent on purpose (`onboxctl run --include-secret`) go to a
            # replacement box too: without them the relaunched trainer would miss a file its first box had
            push(self.ssh, box, pyz, code_dir=code_dir, include_secrets=rec.include_secrets if code_dir else ())
            with self._guard:
                self._pushed[key] = time.monotonic()

    def warm(self, name: str, rec: LaunchRecord) -> bool:
        """Idle spare `name` given this onbox.pyz when it has none and no push record at all (spares.py): a
        recovery onto it later pays neither the push nor the pyz's first start (the push runs `onbox --version`
        there). A spare with any onbox.pyz or push record (a person's push, maybe with a code dir) is left as it
        is. True when pushed."""
        box = self.box(name)
        res = self.ssh.run(box.target(), script="test -e %s || test -e %s; echo $?" % (REMOTE_PYZ, REMOTE_PUSHED),
                           check=False, timeout=30, what="look for onbox.pyz")
        if res.returncode != 0 or res.text.strip() != "1":
            return False
        self.push(box, rec, code=False, again=True)
        return True

    def landed(self, box: Box, pyz: str) -> bool:
        """Whether `box` has this onbox.pyz (its sha256, by sha256sum there: the bytes never vouch for themselves,
        U42) and its push record says so, with no code dir (a launch there would run in that dir)."""
        from controller.launch.push import sha256_file

        # the record is the box's word: at most PUSHED_MAX bytes of it are read (a larger one is no record of ours)
        script = "sha256sum -- %s 2>/dev/null | cut -c1-64; echo; head -c %d %s 2>/dev/null" % (
            REMOTE_PYZ, PUSHED_MAX + 1, REMOTE_PUSHED)
        res = self.ssh.run(box.target(), script=script, check=False, timeout=30, what="read the push record")
        sha, _, record = res.text.partition("\n")
        if len(record.encode("utf-8", "replace")) > PUSHED_MAX:
            return False
        try:
            pushed = untrusted.loads_json(record, "the push record") if record.strip() else {}
        except ValueError:  # untrusted.UntrustedInput too: a record nested too deep
            return False
        local = sha256_file(pyz)
        return (res.returncode == 0 and sha.strip() == local and isinstance(pushed, dict)
                and pushed.get("pyz_sha256") == local and not pushed.get("code"))

    def launch_in_flight(self, rec: LaunchRecord, boxes: Sequence[str]) -> Optional[bool]:
        """Whether an ssh carrying an `onbox run` of the run to one of `boxes` still runs on this machine (an earlier
        keeper's launch: its ssh, in a session of its own, outlives the keeper); None when this cannot be known."""
        try:
            import psutil
        except ImportError:
            return None
        try:
            dests = {self.box(n).target().destination for n in boxes}
            mark = "run --json --name %s " % shlex.quote(rec.run)
            for p in psutil.process_iter(["cmdline"]):
                argv = p.info.get("cmdline") or []
                if not argv or os.path.basename(argv[0]) != "ssh" or "--" not in argv:
                    continue
                i = argv.index("--")
                if argv[i + 1:i + 2] and argv[i + 1] in dests and any(mark in a for a in argv[i + 2:]):
                    return True
        except (psutil.Error, OSError, OnboxError):
            return None
        return False

    def launch(self, rec: LaunchRecord, boxes: Sequence[Box], take_over: bool) -> List[LaunchResult]:
        """`onbox run` of the recorded run on `boxes` (node 0 first for a group), as `onboxctl run` did."""
        from controller.launch.nodes import launch_group
        from controller.launch.start import launch

        args = list(rec.onbox_args) + (["--take-over"] if take_over else [])
        tunnel_to = rec.tracker if rec.tunnel else None
        if rec.nodes:
            return launch_group(self.ssh, list(boxes), rec.command, rec.run, args, workdir=rec.workdir,
                                timeout=rec.timeout, onbox_env=rec.onbox_env, tunnel_to=tunnel_to)
        return [launch(self.ssh, boxes[0], rec.command, rec.run, args, rec.workdir, rec.timeout, rec.onbox_env,
                       tunnel_to, probe_after=False)]  # recovery.py asks the box itself, when it needs to
