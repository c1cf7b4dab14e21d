"""The loop's hang watch: the trainer's cadence judged at every step (onbox/telemetry/cadence.py: the rule and its
bounds), and, once it says hung, the evidence kept BEFORE anything is stopped, then what --on-hang says.

  check()    each loop step while an attempt runs: feeds the detector the signs of life only the loop sees (a new
             attempt, output bytes, the checkpoint dir being written) and returns its verdict, once per quiet period
  respond()  the verdict acted on: the Python stacks of every process of the attempt (stacks.py), the GPU state
             (the reaper hook's `gpu_state`), both in <run dir>/hang-stacks.<attempt>.txt, and a `hang_detected`
             event with the evidence; then
               alert    nothing more: the run goes on (the `hang` warning is critical until the trainer reports a
                        step again, then says it came back)
               restart  the attempt stopped (every process of it: its session, its tree, its marker, in the one
                        escalation, leftovers.py) with its exit classified `hung`; the loop hands that exit to the
                        restart policy (backoff, restore of the newest durable checkpoint, the reaper before the
                        next attempt), bounded by max_restarts and the crash-loop threshold
               stop     the same stop, the GPU memory reaped, the run ends FAILED (`hung`); a multi-node group is told
                        to stop (its peers end `stopped`)
             the stacks file goes to durable storage with the run's logs (Hooks.logs) right after the stop
  acted()    the `hang_action` event: what was done, and what comes next
A `hang_recovered` event says when the trainer reported a new step again, how long after the detection.

A multi-node group restarts together (Hooks.nodes, onbox/multinode/hooks.py): a node that judges its own attempt
hung (--on-hang restart) tells its peers once its stacks are kept and before it stops anything, so the peers take
their stacks of the group as it hung; a peer's word (`peer_word`) is a verdict of its own at the next check:
this node's stacks, then its attempt stopped and restarted under the restart policy, whatever its own --on-hang
says (the judging node decided for the group), and never sent on. So a node whose trainer reports no step (a rank
stopped, or one that logs from rank 0 only), which its own cadence can never judge, is covered by node K's.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from onbox import fsutil, paths, vocab
from onbox.clock import Clock
from onbox.config import RunConfig
from onbox.proc import ProcessSeam, ProcRef
from onbox.supervisor import exits as cls
from onbox.supervisor import stacks as st
from onbox.supervisor.rundir import RunDir
from onbox.telemetry.cadence import HangDetector, HangSettings, HangVerdict
from onbox.telemetry.progress import ProgressFeed

Capture = Callable[[List[ProcRef]], List[st.ProcessStacks]]
MAX_CAPTURES = 20  # stacks files a run writes at most (an --on-hang alert run that hangs again and again)
MAX_SCAN = 20000  # entries of the checkpoint dir one look reads
MAX_DEPTH = 6


def newest_write(root: str, limit: int = MAX_SCAN, depth: int = MAX_DEPTH) -> Optional[Tuple[float, int, int]]:
    """(the newest mtime (wall clock), entries, bytes) of the dir `root` and what lies under it, bounded; None when
    unreadable. A save in progress writes (its files' mtime and size move), a rename of a finished one touches its
    dir."""
    newest: Optional[float] = None
    todo = [(root, 0)]
    seen = size = 0
    while todo and seen < limit:
        path, level = todo.pop()
        try:
            newest = max(newest or 0.0, os.stat(path).st_mtime)
            entries = os.scandir(path)
        except OSError:
            continue
        with entries:
            for e in entries:
                seen += 1
                if seen >= limit:
                    break
                try:
                    if e.is_dir(follow_symlinks=False):
                        if level + 1 < depth:
                            todo.append((e.path, level + 1))
                        continue
                    info = e.stat(follow_symlinks=False)
                    newest, size = max(newest or 0.0, info.st_mtime), size + info.st_size
                except OSError:
                    continue
    return None if newest is None else (newest, seen, size)


class HangWatch:
    """The hang watch of one run. `capture(refs)`: the stacks of those processes (stacks.capture on the box)."""

    def __init__(self, cfg: RunConfig, rd: RunDir, ckpt_dir: str, clock: Clock, emit: Callable[..., None],
                 log: Callable[[str], None], proc: ProcessSeam, feed: ProgressFeed, environ: Dict[str, str],
                 attempt: Callable[[], int], capture: Optional[Capture] = None) -> None:
        self.cfg = cfg
        self.rd = rd
        self.ckpt_dir = ckpt_dir
        self.clock = clock
        self.emit = emit
        self.log = log
        self.attempt = attempt
        self.detector = HangDetector(HangSettings.of(cfg), reported=feed.progress.values.get("step") is not None)
        self.stacks_dir = rd.file(paths.STACKS_DIR)
        self.capture: Capture = capture or (lambda refs: st.capture(proc, refs, self.stacks_dir,
                                                                     st.find_py_spy(environ), clock))
        self._child: Optional[tuple] = None  # (pid, start time) of the attempt the detector follows
        self._offset: Optional[int] = None
        self._written: Optional[Tuple[float, int, int]] = None  # the checkpoint dir at the last look
        self.pending: Optional[Dict[str, Any]] = None  # the last hang, until a step comes again
        self.count = 0
        self.last: Dict[str, Any] = {}  # the last hang_detected event's fields
        self.feed = feed
        self.peer: Optional[Tuple[int, Dict[str, Any]]] = None  # (attempt, a peer's restart) until the next check
        self._acting: Optional[Dict[str, Any]] = None  # the peer's restart the verdict being acted on comes from
        self.action = cfg.on_hang  # what the last verdict got: --on-hang, or restart for a peer's

    def peer_word(self, name: str, detail: str, launcher: Any, state: str) -> None:
        """A peer's agent restarts the group (its hang watch judged node `name`, "node<K>", hung; `detail`: the
        JSON of its judgement): the attempt under way (the run `state` is "running" and its child runs) is stopped
        at the next check, its own stacks taken first. With none (a backoff, a stop) the word is ignored: the next
        attempt joins the group's restart anyway."""
        node: Any = int(name[4:]) if name.startswith("node") and name[4:].isdigit() else name
        if state != vocab.RUNNING or not launcher.running:
            self.emit("peer_restart_ignored", node=node, state=state,
                      reason="no attempt runs here: the next one joins the group's restart")
            return
        try:
            info = json.loads(detail)
        except ValueError:
            info = None
        self.peer = (launcher.number, dict(info if isinstance(info, dict) else {}, node=node))

    # ---- what the loop hands on ---------------------------------------------------------------------------
    def on_line(self, line: str) -> None:
        self.detector.line(line, self.clock.monotonic())

    def on_record(self, fields: Dict[str, Any]) -> None:
        now = self.clock.monotonic()
        if not self.detector.record(fields, now) or self.pending is None:
            return
        if self.attempt() > self.pending["attempt"] or self.cfg.on_hang == "alert":
            self.emit("hang_recovered", step=fields.get("step"), hung_attempt=self.pending["attempt"],
                      hung_step=self.pending["step"], after_s=round(now - self.pending["at"], 3))
            self.pending = None

    def check(self, now: float, launcher: Any, ending: bool = False) -> Optional[HangVerdict]:
        """The verdict on the attempt under way (None while its child is not running or a phase end stops it)."""
        child = launcher.child
        if child is None or not launcher.running or ending:
            return None
        if (child.pid, child.start_time) != self._child:
            self._child, self._offset = (child.pid, child.start_time), launcher.tailer.offset
            self.detector.attempt_started(now)
        if launcher.tailer.offset != self._offset:  # bytes, not lines: a tqdm bar redrawn with \r is output
            self._offset = launcher.tailer.offset
            self.detector.alive(now)
        peer, self.peer = self.peer, None
        if peer is not None and peer[0] == launcher.number:  # an earlier attempt's is over already
            self._acting = peer[1]
            return HangVerdict("group", _num(peer[1].get("quiet_s")), _num(peer[1].get("bound_s")),
                               "node %s judged the group hung (%s)" % (peer[1]["node"], peer[1].get("rule")),
                               _step(self.feed.progress.values.get("step")), None)
        return self.detector.check(now, self._probe)

    def _probe(self) -> Optional[float]:
        """When the checkpoint dir was last written, as monotonic time: now when it changed since the last look,
        else its newest mtime (one in the future, a skewed clock's, tells nothing: only a change counts then)."""
        found, before = newest_write(self.ckpt_dir), self._written
        self._written = found
        if found is None:
            return None
        if before is not None and found != before:
            return self.clock.monotonic()
        age = self.clock.time() - found[0]
        return self.clock.monotonic() - age if age >= 0 else None

    # ---- the verdict acted on ------------------------------------------------------------------------------
    def respond(self, verdict: HangVerdict, launcher: Any, hooks: Any, hook: Callable[..., Any]
                ) -> Optional[cls.Classification]:
        """Evidence first, then --on-hang (a peer's restart: restart): None for `alert`; else the stopped attempt's
        exit (classified hung). A verdict of this node's own, restarted, is told to the peers before the stop."""
        peer, self._acting = self._acting, None
        fields = self._evidence(verdict, launcher, hooks, hook, peer)
        self.action = "restart" if peer is not None else self.cfg.on_hang
        self.pending = {"attempt": launcher.number, "at": self.clock.monotonic(), "step": verdict.step}
        if self.action == "alert":
            self.acted("running", "only alerted (--on-hang alert): the trainer was left as it is")
            return None
        tell = getattr(hooks.nodes, "on_restart", None)
        if peer is None and self.action == "restart" and tell is not None:
            hook("nodes.on_restart", tell, {k: fields.get(k) for k in ("step", "quiet_s", "bound_s", "rule", "phase",
                                                                       "stacks")})
        result = launcher.finish(hung=fields)
        if hooks.logs is not None:  # the stacks to durable storage now, with the run's logs
            hook("logs.sync", hooks.logs)
        if self.action == "stop":
            hook("reaper.before_attempt", hooks.reaper.before_attempt, launcher.sessions())
            hook("nodes.on_notice", hooks.nodes.on_notice, "stop", "node hung: stopping the group",
                 float(self.cfg.term_timeout))
        return result  # type: ignore[no-any-return]

    def acted(self, state: str, message: str, restarts: Optional[int] = None, max_restarts: Optional[int] = None,
              restart_in_s: Optional[float] = None) -> None:
        """The `hang_action` event: what --on-hang did and what comes next, in words the warning repeats. `message`:
        the run's own (state.json's), kept as `detail`."""
        said = message
        group = self.last.get("peer")
        if state == vocab.BACKOFF and group:
            said = ("the attempt was stopped (all its processes) with its group: node %s judged it hung; it restarts "
                    "from the newest checkpoint in %.1f s (restart %s of at most %s)" % (
                        group.get("node"), restart_in_s or 0.0, restarts, max_restarts))
        elif state == vocab.BACKOFF:
            said = ("the attempt was stopped (all its processes); it restarts from the newest checkpoint in %.1f s "
                    "(restart %s of at most %s)" % (restart_in_s or 0.0, restarts, max_restarts))
        elif state == vocab.FAILED and self.action == "stop":
            said = "the attempt was stopped (all its processes) and the run ended failed (--on-hang stop)"
        elif state == vocab.FAILED:
            said = "the attempt was stopped (all its processes); the restart policy ends the run: %s" % message[:300]
        self.emit("hang_action", action=self.action, state=state, message=said, detail=message[:1000],
                  stacks=self.last.get("stacks"), restarts=restarts, max_restarts=max_restarts,
                  restart_in_s=restart_in_s, peer=group.get("node") if group else None)

    def _evidence(self, verdict: HangVerdict, launcher: Any, hooks: Any, hook: Callable[..., Any],
                  peer: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        refs = launcher.processes()
        started = self.clock.monotonic()
        self.count += 1
        taken: List[st.ProcessStacks] = []
        path: Optional[str] = None
        problem = None
        if self.count > MAX_CAPTURES:
            problem = "not captured: %d hangs in this run already have their stacks files" % MAX_CAPTURES
        else:
            try:
                taken = self.capture(refs)
            except Exception as e:  # a bug in the capture must not keep the hang from being acted on
                problem = "capture failed: %r" % (e,)
        gpus = getattr(hooks.reaper, "gpu_state", None)
        gpu_state = hook("reaper.gpu_state", gpus) if gpus is not None else None
        if problem is None:
            path = self._write(verdict, launcher.number, taken, gpu_state)
            problem = None if path else "the run directory refused the stacks file"
        self.last = dict(verdict.to_dict(), stacks=path, stacks_problem=problem, on_hang=self.cfg.on_hang,
                         processes=[s.summary() for s in taken[:32]], process_count=len(refs),
                         gpus=_gpu_summary(gpu_state), capture_s=round(self.clock.monotonic() - started, 3),
                         **({"peer": peer} if peer is not None else {}))
        self.log("hung: %s for %.1f s at step %s (bound %.1f s: %s); stacks %s" % (
            verdict.phase, verdict.quiet_s, verdict.step, verdict.bound_s, verdict.rule, path or problem))
        self.emit("hang_detected", **self.last)
        return self.last

    def _write(self, verdict: HangVerdict, attempt: int, taken: List[st.ProcessStacks], gpus: Any) -> Optional[str]:
        name = paths.HANG_STACKS_FILE % attempt
        n = 1
        while os.path.exists(self.rd.file(name)):  # this attempt hung before (--on-hang alert): keep both
            n += 1
            name = "%s.%d.txt" % ((paths.HANG_STACKS_FILE % attempt)[:-len(".txt")], n)
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.clock.time()))
        if verdict.phase == "group":  # a peer's word: its judgement, this node's evidence
            said = ["detected: %s by a peer: %s (no new step for %.1f s there, bound %.1f s); this node at step %s"
                    % (when, verdict.rule, verdict.quiet_s, verdict.bound_s, verdict.step),
                    "action: this node's attempt stopped and restarted with its group"]
        else:
            said = ["detected: %s; phase %s, step %s: no new step, no output and no checkpoint write for %.1f s, "
                    "past its bound %.1f s (%s)" % (when, verdict.phase, verdict.step, verdict.quiet_s,
                                                    verdict.bound_s, verdict.rule),
                    "action: --on-hang %s" % self.cfg.on_hang]
        header = ["onbox hang evidence: run %s, attempt %d" % (self.rd.name, attempt), *said]
        try:
            fsutil.atomic_write(self.rd.file(name), st.render(header, gpus, taken))
        except OSError as e:
            if fsutil.disk_fault(e) is None:
                raise
            return None
        return self.rd.file(name)


def _gpu_summary(state: Any) -> Any:
    """The GPUs in the event: each one's utilisation and memory (the stacks file has all of it)."""
    if not isinstance(state, dict):
        return None
    if not state.get("available"):
        return {"available": False, "reason": state.get("reason")}
    return [{k: g.get(k) for k in ("index", "util_percent", "memory_used_bytes", "verdict")}
            for g in state.get("gpus") or [] if isinstance(g, dict)]


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _step(value: Any) -> Optional[int]:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
