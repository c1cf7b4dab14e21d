"""The guards of a take-over: a recovery elsewhere launches with `--take-over`, which fences whatever still runs the
run on the lost box, so right before it (and before each new try to find a box) the lost box is asked once more;
and a keeper started again after a crash mid-launch finds out whether the earlier launch can still land before it
launches again (recovery.py's docstring says when each is asked).
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

from controller.keeper.decide import Observation
from controller.keeper.policy import LaunchRecord
from controller.keeper.records import KeepState, Recovery, RunKeep
from onbox import untrusted, vocab
from onbox.clock import Clock

LAUNCH_GRACE = 30.0  # seconds beyond the launch timeout that an earlier keeper's launch may still land in


class Recoverer(Protocol):
    """What the guards use of recovery.Recoverer."""

    world: Any
    clock: Clock
    emit: Any
    save: Callable[[RunKeep], None]
    recheck: Callable[[str, str], Observation]

    def unclaim(self, box: str) -> None: ...


def lost_box_lives(r: "Recoverer", rec: LaunchRecord, keep: RunKeep, cur: Recovery) -> bool:
    """Each box declared lost asked once more: one that answers with its agent alive calls the recovery off
    (True), and the run is watched where it was."""
    runs = dict(zip(cur.from_boxes, rec.node_runs() if rec.nodes else [rec.run]))
    for box in cur.lost or cur.from_boxes:
        obs = r.recheck(box, runs.get(box, rec.run))
        if not (obs.reached and obs.known and obs.agent_alive):
            continue
        why = "%s answers again and its agent of %s is alive (%s)" % (box, obs.run, obs.state)
        cur.cancelled = untrusted.printable(why)
        keep.suspect_since = None
        keep.last_ok = r.clock.time()
        r.emit(keep, "recovery_cancelled", "recovery %d called off before its take-over: %s; watching it there%s"
               % (cur.id, why, " (%s was prepared for it, and is left as it is)" % ", ".join(cur.to_boxes)
                  if cur.to_boxes else ""))
        for b in cur.to_boxes:
            r.unclaim(b)
        keep.close_current()
        keep.move(KeepState.WATCHING, "recovery %d called off: %s" % (cur.id, why))
        r.save(keep)
        return True
    return False


def landed_nowhere(r: "Recoverer", rec: LaunchRecord, keep: RunKeep, cur: Recovery, obs: Observation,
                   waited: float) -> bool:
    """A launch an earlier keeper started `waited` s ago, not seen on the box (`obs`): True when nothing of it can
    still be on its way (launch again now), False while it may be (said once, then waited for)."""
    ask = getattr(r.world, "launch_in_flight", None)  # a scripted world may not say: then wait, as always
    on_way = ask(rec, cur.to_boxes) if ask is not None and obs.reached else None
    if on_way is False:
        r.emit(keep, "launch_in_flight", "the launch an earlier keeper started %.0f s ago on %s did not land: %s "
                                         "answers without a live agent of %s, and no ssh of that launch runs here; "
                                         "launching again now (a second agent under a live name is refused there)"
               % (waited, ", ".join(cur.to_boxes), cur.to_boxes[0], rec.run))
        return True
    said = [e for e in keep.events[-20:] if e.get("kind") == vocab.KEPT_LAUNCH_IN_FLIGHT and e.get("recovery") == cur.id]
    if not said:
        why = ("its ssh still runs here" if on_way else "this machine cannot tell" if obs.reached
               else "%s cannot say: %s" % (cur.to_boxes[0], obs.error or "it does not answer"))
        r.emit(keep, "launch_in_flight", "a launch an earlier keeper started %.0f s ago on %s may still be on its way "
                                         "(%s): waiting for it up to %.0f s more, never launching twice"
               % (waited, ", ".join(cur.to_boxes), why, rec.timeout + LAUNCH_GRACE - waited))
        r.save(keep)
    return False
