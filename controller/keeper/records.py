"""The keeper's files: per run, `$ONBOX_CONFIG_DIR/runs/<run>/launch.json` (what `onboxctl run --recover` did;
policy.py) and `recovery.json` (what `onboxctl keep` knows and decided: its state, where the run lives now, the
recovery in flight with the time of each phase, past recoveries, and the events).

Every decision is written here (atomically, 0600) BEFORE it is acted on, so a keeper killed at any point and
started again finds the recovery where it stood and finishes it (recovery.py). Both files are read back through
onbox.untrusted (a regular file, 4 MiB, 64 levels deep): a damaged one is a `RecordProblem` naming the file and
what to do; it is never rewritten or deleted by the keeper.
"""
from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any, Dict, List, Optional, Tuple

from controller.keeper.policy import MAX_NUMBER, LaunchRecord, box_names, finite, launch_from_dict
from onbox import untrusted, vocab
from onbox.errors import UsageError
from onbox.fsutil import atomic_write_json

RECOVERY_SCHEMA = vocab.SCHEMA_RECOVERY
PHASES = ("detected", "declared_lost", "box_chosen", "pushed", "relaunched", "first_new_step")
MAX_EVENTS = 200  # newest kept; older ones are in the tracker's and the agent's own logs
MAX_HISTORY = 50


class KeepState(str, enum.Enum):
    """What the keeper knows of one run. Transitions (anything else raises ValueError naming the allowed ones):

    WATCHING   -> SUSPECT (its box failed an ssh probe) | RECOVERING (preempted, or its agent is gone, on a box that
                  answers: relaunched there) | ENDED (done, stopped, failed by its own policy, fenced)
                  | FAILED_MAX_RECOVERIES (one more recovery was needed)
    SUSPECT    -> WATCHING (the box answers again) | RECOVERING (declared lost: recovered elsewhere)
                  | FAILED_MAX_RECOVERIES | ENDED
    RECOVERING -> WATCHING (relaunched; the recovery stays open until its first new step) | FAILED_NO_RESOURCE
                  (no box after `tries` tries) | FAILED_LAUNCH (every launch failed) | ENDED
    FAILED_* and ENDED are final: the keeper leaves the run alone until `onboxctl run --recover` launches it again.
    """

    WATCHING = "watching"
    SUSPECT = "suspect"
    RECOVERING = "recovering"
    FAILED_NO_RESOURCE = "failed_no_resource"
    FAILED_MAX_RECOVERIES = "failed_max_recoveries"
    FAILED_LAUNCH = "failed_launch"
    ENDED = "ended"

    @property
    def final(self) -> bool:
        return self in (KeepState.FAILED_NO_RESOURCE, KeepState.FAILED_MAX_RECOVERIES, KeepState.FAILED_LAUNCH,
                        KeepState.ENDED)


_S = KeepState
TRANSITIONS = {
    _S.WATCHING: (_S.SUSPECT, _S.RECOVERING, _S.ENDED, _S.FAILED_MAX_RECOVERIES),
    _S.SUSPECT: (_S.WATCHING, _S.RECOVERING, _S.FAILED_MAX_RECOVERIES, _S.ENDED),
    _S.RECOVERING: (_S.WATCHING, _S.FAILED_NO_RESOURCE, _S.FAILED_LAUNCH, _S.ENDED),
}


@dataclasses.dataclass
class Recovery:
    """One recovery: why, from where to where, and when each phase was reached (wall-clock seconds)."""

    id: int
    kind: str  # "same_box": relaunched where it was; "elsewhere": on a spare or a provisioned box
    reason: str
    from_boxes: List[str]
    to_boxes: List[str] = dataclasses.field(default_factory=list)
    phases: Dict[str, float] = dataclasses.field(default_factory=dict)
    tries: int = 0  # failed tries to find boxes (spares, then the provision command)
    next_try_at: Optional[float] = None
    launch_started_at: Optional[float] = None  # a launch may be in flight since then (a keeper killed mid-launch)
    launch_failures: int = 0
    rejected: List[str] = dataclasses.field(default_factory=list)  # boxes found unfit during this recovery
    provisioned: List[str] = dataclasses.field(default_factory=list)
    needs_push: bool = True
    take_over: bool = False  # launched with `onbox run --take-over` (the old holder was declared lost)
    resume_step: Optional[int] = None  # the step it resumed from (its agent's word; before that, the newest known)
    first_step: Optional[int] = None
    error: Optional[str] = None
    lost: List[str] = dataclasses.field(default_factory=list)  # the boxes declared lost (asked again before take-over)
    cancelled: Optional[str] = None  # why it was called off before its launch (a lost box answered again)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class RunKeep:
    """recovery.json: the keeper's record of one run."""

    run: str
    state: KeepState
    boxes: List[str]  # where the run lives now, node 0 first
    recoveries: int = 0
    suspect_since: Optional[float] = None  # the first failed ssh probe of this suspicion
    last_ok: Optional[float] = None  # the last time its agent answered alive
    last_seen: Dict[str, Any] = dataclasses.field(default_factory=dict)  # step, durable step and time, state
    current: Optional[Recovery] = None  # the recovery in flight (open until its first new step)
    history: List[Recovery] = dataclasses.field(default_factory=list)
    events: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    message: Optional[str] = None  # why the state is what it is, for `onboxctl status`
    updated_at: float = 0.0
    event_seq: int = 0  # the number of the newest event (`n`; only grows)
    published: int = 0  # the newest event a tracker acknowledged (`n`)
    tracker_unreadable_since: Optional[float] = None  # the run's beats could not be read since then (said once)
    blind_since: Optional[float] = None  # the keeper could not see this run's boxes since then (said once)

    def move(self, new: KeepState, message: Optional[str] = None) -> None:
        if new != self.state:
            allowed = TRANSITIONS.get(self.state, ())
            if new not in allowed:
                raise ValueError("illegal keeper transition %s -> %s; allowed from %s: %s" % (
                    self.state.value, new.value, self.state.value,
                    ", ".join(s.value for s in allowed) or "none (final)"))
            self.state = new
        if message is not None:
            self.message = untrusted.printable(message)  # it holds what boxes and commands said: shown as escapes

    def event(self, now: float, kind: str, text: str, **fields: Any) -> Dict[str, Any]:
        self.event_seq += 1
        ev = dict(fields, time=round(now, 3), run=self.run, kind=kind, text=text, n=self.event_seq)
        self.events.append(ev)
        del self.events[:-MAX_EVENTS]
        return ev

    def close_current(self) -> None:
        if self.current is not None:
            self.history.append(self.current)
            del self.history[:-MAX_HISTORY]
            self.current = None

    @property
    def recovering(self) -> bool:
        """RECOVERING, or relaunched and waiting for the first new step; never in a final state (a run that ended
        failed_no_resource keeps its last recovery as `current`, and may train on where it was, unwatched)."""
        if self.state.final:
            return False
        return self.state == KeepState.RECOVERING or (self.current is not None
                                                      and "first_new_step" not in self.current.phases)

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["state"] = self.state.value
        d["schema"] = RECOVERY_SCHEMA
        return d


def recovery_from_dict(doc: Any, where: str) -> Recovery:
    """One recovery read back (ValueError naming what is wrong): every box name as policy.box_name_problem wants
    it, every time and count a finite number."""
    if not isinstance(doc, dict):
        raise ValueError("%s: a recovery must be an object" % where)
    fields = {f.name for f in dataclasses.fields(Recovery)}
    unknown = sorted(repr(k)[:40] for k in set(doc) - fields)
    if unknown:
        raise ValueError("%s: unknown key(s) %s" % (where, ", ".join(unknown[:5])))
    try:
        rec = Recovery(**doc)
    except TypeError as e:
        raise ValueError("%s: %s" % (where, e))
    if not _whole(rec.id) or rec.kind not in ("same_box", "elsewhere") or not isinstance(rec.phases, dict):
        raise ValueError("%s: id, kind or phases is wrong" % where)
    for key in ("from_boxes", "to_boxes", "rejected", "provisioned", "lost"):
        setattr(rec, key, box_names(getattr(rec, key), where, key))
    for phase, t in rec.phases.items():
        if phase not in PHASES or _time(t, where, "phase") is None:
            raise ValueError("%s: phase %s is not one of %s with a time" % (where, repr(phase)[:40], ", ".join(PHASES)))
    for key in ("tries", "launch_failures"):
        _count(getattr(rec, key), where, key)
    for key in ("next_try_at", "launch_started_at"):
        _time(getattr(rec, key), where, key)
    for key in ("resume_step", "first_step"):
        if getattr(rec, key) is not None and not _whole(getattr(rec, key)):
            raise ValueError("%s: %s must be a step" % (where, key))
    if not isinstance(rec.reason, str) or any(v is not None and not isinstance(v, str) for v in (rec.error,
                                                                                                    rec.cancelled)):
        raise ValueError("%s: reason, error and cancelled must be text" % where)
    rec.reason, rec.error = untrusted.printable(rec.reason), rec.error and untrusted.printable(rec.error)
    rec.cancelled = rec.cancelled and untrusted.printable(rec.cancelled)
    rec.needs_push, rec.take_over = rec.needs_push is True, rec.take_over is True
    return rec


def keep_from_dict(doc: Any, where: str) -> RunKeep:
    """recovery.json read back; ValueError naming what is wrong."""
    if not isinstance(doc, dict) or doc.get("schema") != RECOVERY_SCHEMA:
        raise ValueError("%s is not a recovery record (schema %s)" % (where, RECOVERY_SCHEMA))
    try:
        state = KeepState(doc.get("state"))
    except (ValueError, TypeError):
        raise ValueError("%s: state %s is not one of %s" % (where, repr(doc.get("state"))[:40],
                                                            ", ".join(s.value for s in KeepState)))
    boxes = doc.get("boxes")
    if not isinstance(boxes, list) or not boxes:
        raise ValueError("%s: boxes must be a non-empty list of box names" % where)
    rc = _count(doc.get("recoveries"), where, "recoveries")
    for key in ("events", "history"):
        if not isinstance(doc.get(key, []), list):
            raise ValueError("%s: %s must be a list" % (where, key))
    cur = doc.get("current")
    message = doc.get("message")
    return RunKeep(
        run=str(doc.get("run")), state=state, boxes=box_names(boxes, where, "boxes"), recoveries=rc,
        suspect_since=_time(doc.get("suspect_since"), where, "suspect_since"),
        last_ok=_time(doc.get("last_ok"), where, "last_ok"),
        last_seen=_last_seen(doc.get("last_seen")),
        current=recovery_from_dict(cur, where + " current") if cur is not None else None,
        history=[recovery_from_dict(h, where + " history") for h in doc.get("history", [])],
        events=[e for e in doc.get("events", []) if isinstance(e, dict)],
        message=untrusted.printable(message) if isinstance(message, str) else None,
        updated_at=_time(doc.get("updated_at"), where, "updated_at") or 0.0,
        event_seq=_count(doc.get("event_seq", 0), where, "event_seq"),
        published=_count(doc.get("published", 0), where, "published"),
        tracker_unreadable_since=_time(doc.get("tracker_unreadable_since"), where, "tracker_unreadable_since"),
        blind_since=_time(doc.get("blind_since"), where, "blind_since"))


def _last_seen(v: Any) -> Dict[str, Any]:
    """What the keeper last knew of the run (work at risk, the resume point): the values of the right kind only, the
    rest dropped (a hand edit must not become a TypeError in `onboxctl status`)."""
    if not isinstance(v, dict):
        return {}
    out: Dict[str, Any] = {}
    for key in ("step", "durable_step"):
        if _whole(v.get(key)):
            out[key] = v[key]
    for key in ("durable_at", "time"):
        x = v.get(key)
        if finite(x):
            out[key] = x
    if isinstance(v.get("state"), str):
        out["state"] = untrusted.printable(v["state"])[:64]
    return out


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_NUMBER * 1000


def _count(v: Any, where: str, key: str) -> int:
    if not _whole(v):
        raise ValueError("%s: %s must be a whole number >= 0" % (where, key))
    return int(v)


def _time(v: Any, where: str, key: str) -> Optional[float]:
    """A wall-clock time in seconds (None stays None); nan, inf and 1e400 are refused."""
    if v is None:
        return None
    if not finite(v):
        raise ValueError("%s: %s must be a time in seconds" % (where, key))
    return float(v)


class RecordProblem(UsageError):
    """A launch or recovery record that cannot be read: named, never rewritten, never deleted."""


class RecordStore:
    """The runs directory under the onboxctl config dir."""

    def __init__(self, directory: Optional[str] = None) -> None:
        if directory is None:
            from controller.boxes.inventory import config_dir

            directory = config_dir()
        self.root = os.path.join(directory, "runs")

    def run_dir(self, run: str) -> str:
        from controller.launch.start import check_name

        return os.path.join(self.root, check_name(run))

    def launch_path(self, run: str) -> str:
        return os.path.join(self.run_dir(run), "launch.json")

    def keep_path(self, run: str) -> str:
        return os.path.join(self.run_dir(run), "recovery.json")

    def runs(self) -> List[str]:
        """Every run with a launch record, sorted."""
        try:
            names = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            raise RecordProblem("%s is not a directory" % self.root,
                                hint="it holds the launch and recovery records of runs `onboxctl keep` watches")
        return [n for n in names if os.path.lexists(os.path.join(self.root, n, "launch.json"))]

    def _read(self, path: str, what: str) -> Any:
        others = _others_may_write(path)
        if others:
            raise RecordProblem("%s %s is %s: refused (the keeper would run its provision command, push its code dir "
                                "and launch on its boxes as you)" % (what, path, others),
                                hint="chmod go-w %s %s (onboxctl writes its records 0600 in a 0700 dir), if its "
                                     "content is yours" % (path, os.path.dirname(path)))
        try:
            return untrusted.read_json(path, untrusted.CONFIG_MAX_BYTES, what)
        except (ValueError, OSError) as e:  # refused (UntrustedInput), not JSON, not UTF-8, unreadable
            raise RecordProblem("%s %s cannot be read: %s" % (what, path, untrusted.reason(e)), hint=hint_for(path))

    def load_launch(self, run: str) -> LaunchRecord:
        path = self.launch_path(run)
        doc = self._read(path, "launch record")
        try:
            rec = launch_from_dict(doc, "launch record %s" % path)
        except ValueError as e:
            raise RecordProblem(str(e), hint=hint_for(path))
        if rec.run != run:
            raise RecordProblem("launch record %s names run %r, not %r" % (path, rec.run, run), hint=hint_for(path))
        return rec

    def load_keep(self, run: str) -> Optional[RunKeep]:
        """recovery.json, or None before the keeper or `onboxctl run` wrote one."""
        path = self.keep_path(run)
        if not os.path.lexists(path):
            return None
        doc = self._read(path, "recovery record")
        try:
            keep = keep_from_dict(doc, "recovery record %s" % path)
        except ValueError as e:
            raise RecordProblem(str(e), hint=hint_for(path))
        if keep.run != run:
            raise RecordProblem("recovery record %s names run %r, not %r" % (path, keep.run, run),
                                hint=hint_for(path))
        return keep

    def load(self, run: str) -> Tuple[LaunchRecord, RunKeep]:
        from controller.launch.start import check_name

        try:
            check_name(run)
        except UsageError:
            raise RecordProblem("%s holds %s, which is not a run name: no record of `onboxctl run --recover`"
                                % (self.root, repr(run)[:80]), hint="move it out of %s" % self.root)
        launch = self.load_launch(run)
        keep = self.load_keep(run)
        if keep is None:
            keep = RunKeep(run=run, state=KeepState.WATCHING, boxes=list(launch.boxes))
        return launch, keep

    def save_launch(self, rec: LaunchRecord) -> None:
        os.makedirs(self.run_dir(rec.run), mode=0o700, exist_ok=True)
        atomic_write_json(self.launch_path(rec.run), rec.to_dict())

    def save_keep(self, keep: RunKeep, now: float) -> None:
        keep.updated_at = round(now, 3)
        os.makedirs(self.run_dir(keep.run), mode=0o700, exist_ok=True)
        atomic_write_json(self.keep_path(keep.run), keep.to_dict())


def _others_may_write(path: str) -> Optional[str]:
    """Why a record (or its dir) is not the user's alone (None: it is): owned by another user than this one or
    root, or writable by its group or others. ssh's StrictModes, for a file whose content the keeper acts on."""
    me = os.geteuid()
    for p in (path, os.path.dirname(path)):
        try:
            st = os.stat(p)
        except OSError:
            return None  # missing or unreadable: the read says so
        if st.st_uid not in (me, 0):
            return "owned by uid %d%s" % (st.st_uid, "" if p == path else " (its dir %s)" % p)
        if st.st_mode & 0o022:
            return "writable by others (mode %04o%s)" % (st.st_mode & 0o7777, "" if p == path else ", its dir %s" % p)
    return None


def hint_for(path: str) -> str:
    """What to do about a damaged record (the keeper leaves the run alone meanwhile)."""
    if path.endswith("recovery.json"):
        return ("the keeper leaves this run alone until it is fixed; moved aside (`mv %s %s.bad`), the keeper starts "
                "over from launch.json and finds the run where it was launched" % (path, path))
    return ("the keeper leaves this run alone until it is fixed; or move the run's record dir %s aside and launch the "
            "run again with `onboxctl run --recover ...` (its checkpoints in durable storage are untouched)"
            % os.path.dirname(path))
