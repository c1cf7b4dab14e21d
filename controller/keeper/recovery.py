"""One recovery, phase by phase, each decision written to recovery.json before it is acted on.

    detected -> declared_lost (elsewhere only) -> box_chosen -> pushed -> relaunched -> first_new_step

`advance()` does the next step of the run's open recovery and returns; the keeper calls it again on its next pass
(or at once when a step finished). What makes it safe to kill the keeper anywhere and start it again:
- box_chosen is recorded before anything is pushed to the box, a provisioned box is in the inventory (in the run's
  pool) before anything else is done with it;
- `launch_started_at` is recorded BEFORE `onbox run` is called. Before launching again, the chosen box is asked
  whether it already runs the run: then the recovery is marked relaunched and nothing is launched. A keeper started
  again after a crash mid-launch says so (`launch_in_flight`) and asks what can tell whether the earlier launch is
  still on its way: the box (its agent takes the run's lock, and says it alive, within a second of starting) and
  this machine (the earlier keeper's ssh carrying the launch outlives it: World.launch_in_flight). With none on
  its way it launches at once: the launch is idempotent by the agent's lock and lease (a second `onbox run` under
  a live name is refused, and that refusal reads as the launch landed). Only where neither can be asked is the
  earlier launch waited for up to the launch timeout + LAUNCH_GRACE.
- a recovery elsewhere launches with `--take-over` (the old box was declared lost; its agent, if it still runs
  behind a partition, is fenced by the newer lease); a relaunch on the same box does not (its agent is gone).
  Right before that take-over, and before each new try to find a box, the lost box is asked once more (at most
  --suspect-timeout): if it answers and its agent lives, the recovery is called off (`recovery_cancelled`) and the
  run is watched where it was.
- recoveries of several runs go on at once, each in a thread of its own: a spare is claimed, under one lock, before
  it is checked, so two recoveries never choose the same box.
Nothing is ever torn down: a box provisioned for a recovery that then fails stays in the inventory, and says so.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Protocol, Sequence, Set, Tuple

from controller.keeper.decide import Observation, first_new_step
from controller.keeper.policy import LaunchRecord
from controller.keeper.records import KeepState, Recovery, RunKeep
from controller.keeper.spares import SpareChecks
from controller.keeper.takeover import LAUNCH_GRACE, landed_nowhere, lost_box_lives
from onbox import untrusted
from onbox.clock import Clock
from onbox.errors import OnboxError

if TYPE_CHECKING:
    from controller.keeper.world import World




class Emit(Protocol):
    """(record, kind, text, fields) -> the event is recorded and told. The fields are what a reader should not have
    to parse out of the text (the dashboard marks recoveries with them): `to_boxes` (and which of them were
    `provisioned`) on box_chosen, relaunched and first_new_step; `first_step`, `resume_step` and `took_s` (from
    detected to the first new step) on first_new_step."""

    def __call__(self, keep: RunKeep, kind: str, text: str, **fields: Any) -> None: ...


class Recoverer:
    """Advances open recoveries. `world`: controller/keeper/world.World or a test's scripted one. `recheck` asks a
    lost box once more, bounded (the keeper's probes); without it, World.observe."""

    def __init__(self, world: "World", clock: Clock, save: Callable[[RunKeep], None], emit: Emit,
                 recheck: Optional[Callable[[str, str], Observation]] = None) -> None:
        self.world = world
        self.clock = clock
        self.save = save
        self.emit = emit
        self.recheck = recheck or world.observe
        self._claims: Dict[str, str] = {}  # box -> the run whose recovery holds it (chosen, or being checked)
        self._lock = threading.Lock()
        self.spares = SpareChecks(lambda name, rec: self.world.spare_problem(name, rec), clock)  # checked ahead while a run is in doubt (spares.py)

    def _claim(self, box: str, run: str) -> bool:
        with self._lock:
            if self._claims.get(box, run) != run:
                return False
            self._claims[box] = run
            return True

    def unclaim(self, box: str) -> None:
        with self._lock:
            self._claims.pop(box, None)

    def release(self, run: str) -> None:
        """The boxes run `run` held while its recovery chose them: its record names them from now on."""
        with self._lock:
            for box in [b for b, r in self._claims.items() if r == run]:
                del self._claims[box]

    def _candidates(self, rec: LaunchRecord, skip: Set[str]) -> List[str]:
        """The pool's spares a recovery of `rec` would try, in its order: those prepared for it first, then the
        others by name, those prepared for another run last."""
        def order(name: str) -> Tuple[int, str]:
            planned = self.spares.planned_for(name)
            return (0 if planned == rec.run else 2 if planned else 1), name

        return sorted((n for n, b in self.world.boxes().items() if b.pool == rec.policy.pool and n not in skip),
                      key=order)

    def prepare(self, rec: LaunchRecord, keep: RunKeep, in_use: Set[str]) -> None:
        """A box of `rec` is silent: the spares its recovery would try are checked ahead (spares.py), nothing
        claimed."""
        with self._lock:
            claimed = {b for b, r in self._claims.items() if r != rec.run}
        self.spares.prepare(rec, self._candidates(rec, set(in_use) | set(keep.boxes) | claimed), len(keep.boxes))

    # -- starting --------------------------------------------------------------------------------------------
    def start(self, rec: LaunchRecord, keep: RunKeep, kind: str, reason: str, needs_push: bool = False,
              lost: Optional[List[str]] = None) -> None:
        """Open a recovery (same_box or elsewhere; `lost`: the boxes declared lost, asked again before the take-over),
        or end the run's watch when it has had its max."""
        now = self.clock.time()
        reason = untrusted.printable(reason)  # what a box said (its ssh error): kept in recovery.json, printed
        if keep.recoveries >= rec.policy.max_recoveries:
            keep.move(KeepState.FAILED_MAX_RECOVERIES, "needed a recovery after %d (--max-recoveries %d): %s" % (
                keep.recoveries, rec.policy.max_recoveries, reason))
            self.emit(keep, "failed_max_recoveries", keep.message or "")
            self.save(keep)
            return
        keep.close_current()
        ids = [r.id for r in keep.history]
        cur = Recovery(id=max(ids) + 1 if ids else 1, kind=kind, reason=reason, from_boxes=list(keep.boxes),
                       phases={"detected": keep.suspect_since if keep.suspect_since is not None else now},
                       resume_step=keep.last_seen.get("durable_step"))
        if kind == "same_box":
            cur.to_boxes = list(keep.boxes)
            cur.phases["box_chosen"] = now
            cur.needs_push = needs_push
        else:
            cur.phases["declared_lost"] = now
            cur.take_over = True
            cur.lost = [b for b in (lost or cur.from_boxes) if b in cur.from_boxes] or list(cur.from_boxes)
        keep.current = cur
        keep.move(KeepState.RECOVERING, "recovery %d: %s" % (cur.id, reason))
        self.emit(keep, "detected", reason)
        if kind == "elsewhere":
            self.emit(keep, "declared_lost", "declared %s lost: recovering on a spare of pool %s%s" % (
                ", ".join(cur.from_boxes), rec.policy.pool, " or a provisioned box" if rec.policy.provision else ""))
        else:
            self.emit(keep, "box_chosen", "relaunching on the same box %s" % ", ".join(cur.to_boxes),
                      to_boxes=list(cur.to_boxes), provisioned=[])
        self.save(keep)

    # -- advancing -------------------------------------------------------------------------------------------
    def advance(self, rec: LaunchRecord, keep: RunKeep, in_use: Set[str]) -> bool:
        """One step of the open recovery; True when it moved (the caller may call again at once)."""
        cur = keep.current
        if keep.state != KeepState.RECOVERING or cur is None:
            return False
        now = self.clock.time()
        if cur.next_try_at is not None and now < cur.next_try_at:
            return False
        if "box_chosen" not in cur.phases:
            if cur.tries and lost_box_lives(self, rec, keep, cur):  # a box is sought again: is it still lost?
                return False
            return self._choose(rec, keep, cur, in_use)
        if "pushed" not in cur.phases:
            return self._push(rec, keep, cur)
        if "relaunched" not in cur.phases:
            return self._relaunch(rec, keep, cur)
        return False

    def _choose(self, rec: LaunchRecord, keep: RunKeep, cur: Recovery, in_use: Set[str]) -> bool:
        chosen = self._acquire(rec, keep, cur, in_use)
        now = self.clock.time()
        if chosen:
            cur.to_boxes, cur.next_try_at = chosen, None
            cur.phases["box_chosen"] = now
            self.emit(keep, "box_chosen", "chose %s for %s" % (", ".join(chosen), rec.run), to_boxes=list(chosen),
                      provisioned=[b for b in chosen if b in cur.provisioned])
            self.save(keep)
            return True
        cur.tries += 1
        pool = "no healthy spare in pool %s%s" % (rec.policy.pool, " and no box from the provision command"
                                                   if rec.policy.provision else " (and no --provision)")
        if cur.tries >= rec.policy.tries:
            cur.error = "%s after %d tries" % (pool, cur.tries)
            keep.move(KeepState.FAILED_NO_RESOURCE, "%s: %s; nothing was launched, the run's checkpoints in "
                                                    "durable storage are untouched" % (rec.run, cur.error))
            self.emit(keep, "failed_no_resource", keep.message or "")
        else:
            cur.next_try_at = now + rec.policy.backoff_s(cur.tries)
            self.emit(keep, "no_box", "%s (try %d of %d); next try in %.0f s" % (
                pool, cur.tries, rec.policy.tries, cur.next_try_at - now))
        self.save(keep)
        return False

    def _acquire(self, rec: LaunchRecord, keep: RunKeep, cur: Recovery, in_use: Set[str]) -> List[str]:
        """Boxes for every node: healthy idle spares of the pool first (by name), then provisioned ones."""
        need = len(cur.from_boxes)
        chosen: List[str] = []
        for name in self._candidates(rec, set(in_use) | set(cur.from_boxes) | set(cur.rejected)):
            if len(chosen) == need:
                break
            if not self._claim(name, rec.run):  # another run's recovery holds it (chosen, or being checked)
                continue
            problem = self.spares.problem(name, rec)  # checked ahead while the run was in doubt, when fresh
            if problem:
                self.unclaim(name)
                self.emit(keep, "spare_skipped", "spare %s: %s" % (name, problem))
            else:
                chosen.append(name)
                self.spares.taken(name)
        while len(chosen) < need and rec.policy.provision:
            node = len(chosen)
            key = "%s-r%d-n%d" % (rec.run, cur.id, node)
            try:
                box = self.world.provision(rec, key, node,
                                           note=lambda kind, text: self.emit(keep, kind, text))  # leftovers, cuts
                self.world.add_box(box)
            except OnboxError as e:
                self.emit(keep, "provision_failed", e.message)
                break
            self._claim(box.name, rec.run)
            cur.provisioned.append(box.name)
            self.emit(keep, "provisioned", "the provision command brought up %s (%s), added to the inventory in pool "
                                           "%s" % (box.name, box.host, rec.policy.pool))
            self.save(keep)
            problem = self.world.spare_problem(box.name, rec)
            if problem:
                cur.rejected.append(box.name)
                self.emit(keep, "provision_failed", "provisioned box %s cannot take the run: %s (it stays in the "
                                                    "inventory: the keeper never tears a box down)" % (box.name, problem))
                break
            chosen.append(box.name)
        return chosen if len(chosen) == need else []

    def _push(self, rec: LaunchRecord, keep: RunKeep, cur: Recovery) -> bool:
        if cur.needs_push:
            for name in cur.to_boxes:
                try:
                    self.world.push(self.world.box(name), rec)
                except OnboxError as e:
                    return self._box_failed(rec, keep, cur, name, "push to %s failed: %s" % (name, e.message))
        cur.phases["pushed"] = self.clock.time()
        self.emit(keep, "pushed", ("pushed onbox.pyz%s to %s" % (" and %s" % rec.code if rec.code else "",
                                                                   ", ".join(cur.to_boxes))) if cur.needs_push
                  else "nothing to push: %s has the run" % ", ".join(cur.to_boxes))
        self.save(keep)
        return True

    def _box_failed(self, rec: LaunchRecord, keep: RunKeep, cur: Recovery, name: str, why: str) -> bool:
        """A chosen box failed before the launch: elsewhere, choose again without it; on the same box, retry
        later (the box is watched as usual: if it stays down it is declared lost)."""
        self.emit(keep, "box_failed", why)
        if cur.kind == "elsewhere":
            cur.rejected.append(name)
            cur.to_boxes = []
            cur.phases.pop("box_chosen", None)
            self.save(keep)
            return True
        return self._launch_failed(rec, keep, cur, why)

    def _relaunch(self, rec: LaunchRecord, keep: RunKeep, cur: Recovery) -> bool:
        now = self.clock.time()
        run0 = rec.node_runs()[0]
        if cur.kind == "elsewhere" and cur.launch_started_at is None:
            # a spare checked a moment ago (no live agent), no launch of ours ever started: nothing to ask it
            return self._launch(rec, keep, cur)
        obs = self.world.observe(cur.to_boxes[0], run0)
        if obs.reached and obs.known and obs.agent_alive:
            self.emit(keep, "relaunched", "%s already runs %s (an earlier launch landed): not launched again"
                      % (cur.to_boxes[0], run0), to_boxes=list(cur.to_boxes))
            return self._relaunched(rec, keep, cur)
        waited = None if cur.launch_started_at is None else now - cur.launch_started_at
        if waited is not None and waited < rec.timeout + LAUNCH_GRACE and not landed_nowhere(self, rec, keep, cur, obs,
                                                                                                 waited):
            return False  # an earlier keeper's launch may still be in flight: wait for it, never launch twice
        if not obs.reached and cur.kind == "elsewhere":
            return self._box_failed(rec, keep, cur, cur.to_boxes[0], "chosen box %s stopped answering: %s"
                                    % (cur.to_boxes[0], obs.error))
        if not obs.reached:  # the box went away before its relaunch: watch it, and recover elsewhere once lost
            self.emit(keep, "box_failed", "%s stopped answering before the relaunch (%s): watching it; it is "
                                          "recovered elsewhere once lost" % (cur.to_boxes[0], obs.error))
            keep.close_current()
            keep.move(KeepState.WATCHING, "%s stopped answering before its relaunch" % cur.from_boxes[0])
            self.save(keep)
            return False
        return self._launch(rec, keep, cur)

    def _launch(self, rec: LaunchRecord, keep: RunKeep, cur: Recovery) -> bool:
        if cur.take_over and lost_box_lives(self, rec, keep, cur):
            return False
        now = self.clock.time()
        cur.launch_started_at = now
        self.save(keep)  # the intent, before the act
        boxes = [self.world.box(n) for n in cur.to_boxes]
        try:
            results = self.world.launch(rec, boxes, take_over=cur.take_over)
        except OnboxError as e:
            return self._launch_failed(rec, keep, cur, "launch on %s failed: %s" % (", ".join(cur.to_boxes), e.message))
        bad = [r for r in results if not r.ok]
        if bad and bad[0].exit_code == 2 and self._alive_on(cur.to_boxes[0], rec.node_runs()[0]):
            bad = []  # refused because the run lives there now: an earlier launch of this recovery landed
        if bad:
            return self._launch_failed(rec, keep, cur, "launch on %s failed: %s%s" % (
                bad[0].box, bad[0].error, " (hint: %s)" % bad[0].hint if bad[0].hint else ""))
        self.emit(keep, "relaunched", "relaunched %s on %s%s" % (rec.run, ", ".join(cur.to_boxes),
                                                                 " with --take-over" if cur.take_over else ""),
                  to_boxes=list(cur.to_boxes))
        return self._relaunched(rec, keep, cur)

    def _alive_on(self, box: str, run: str) -> bool:
        obs = self.world.observe(box, run)
        return obs.reached and obs.known and obs.agent_alive

    def _relaunched(self, rec: LaunchRecord, keep: RunKeep, cur: Recovery) -> bool:
        cur.phases["relaunched"] = self.clock.time()
        cur.next_try_at = None
        keep.boxes = list(cur.to_boxes)
        keep.recoveries += 1
        keep.suspect_since = None
        keep.move(KeepState.WATCHING, "recovery %d: relaunched on %s, waiting for its first new step"
                  % (cur.id, ", ".join(cur.to_boxes)))
        self.save(keep)
        return False

    def _launch_failed(self, rec: LaunchRecord, keep: RunKeep, cur: Recovery, why: str) -> bool:
        now = self.clock.time()
        why = untrusted.printable(why)  # what the box answered: kept in recovery.json
        cur.launch_failures += 1
        cur.launch_started_at = None  # the call returned: nothing of ours is in flight
        if cur.launch_failures >= rec.policy.tries:
            cur.error = why
            keep.move(KeepState.FAILED_LAUNCH, "%s: %d launches failed, the last: %s" % (rec.run, cur.launch_failures,
                                                                                     why))
            self.emit(keep, "failed_launch", keep.message or "")
        else:
            cur.next_try_at = now + rec.policy.backoff_s(cur.launch_failures)
            self.emit(keep, "launch_failed", "%s; next try in %.0f s" % (why, cur.next_try_at - now))
        self.save(keep)
        return False

    # -- after the relaunch ----------------------------------------------------------------------------------
    def note_first_step(self, keep: RunKeep, observed: Sequence[Observation]) -> None:
        """Close the open recovery once the relaunched run trained a step."""
        cur = keep.current
        if cur is None or "relaunched" not in cur.phases or "first_new_step" in cur.phases or not observed:
            return
        step = first_new_step(observed[0])
        if step is None:
            return
        cur.phases["first_new_step"] = self.clock.time()
        cur.first_step = step
        if observed[0].resumed_step is not None:  # what the agent restored, not what the keeper saw last
            cur.resume_step = observed[0].resumed_step
        took = cur.phases["first_new_step"] - cur.phases.get("detected", cur.phases["relaunched"])
        self.emit(keep, "first_new_step", "trains again on %s: step %d%s, %.1f s after it was detected" % (
            ", ".join(cur.to_boxes), step, " (resumed after durable step %d)" % cur.resume_step
            if cur.resume_step is not None else "", took), to_boxes=list(cur.to_boxes), first_step=step,
            resume_step=cur.resume_step, took_s=round(took, 3))
        keep.message = "recovery %d done: %s" % (cur.id, ", ".join("%s %.1fs" % (p, t - cur.phases["detected"])
                                                                  for p, t in split(cur).items()))
        keep.close_current()
        self.save(keep)


def split(cur: Recovery) -> Dict[str, float]:
    """Each phase's time, in the order of the phases (the benchmark's detect / decide / push / restore split)."""
    from controller.keeper.records import PHASES

    return {p: cur.phases[p] for p in PHASES if p in cur.phases}


def open_phase(cur: Optional[Recovery]) -> Optional[str]:
    """The next phase the open recovery waits for (None when none is open)."""
    from controller.keeper.records import PHASES

    if cur is None:
        return None
    for p in PHASES:
        if p not in cur.phases and not (p == "declared_lost" and cur.kind == "same_box"):
            return p
    return None
