"""The hang rule, pure: when the trainer's own cadence says it is hung. The supervisor feeds it what it sees (each
output byte, each progress record, each line that announces an eval, the checkpoint dir being written) with the
monotonic time, and asks it; onbox/supervisor/hang.py acts on its verdict.

The rule (onbox/supervisor/README.md, "Hung trainers"; `onbox run --help`): a trainer that has reported a step is HUNG when nothing
happened for longer than the bound of the phase it is in. "Nothing" is: no new step, no output byte (a tqdm bar
redrawn with a carriage return counts), no write in the checkpoint dir (a save in progress is no hang). The bound:

  startup  before the attempt's first step (the model loads, a resume reads its checkpoint, NCCL initialises):
           hang_startup (default 1200 s);
  train    max(hang_factor x the typical time between two step reports, hang_floor): the median of the last 50
           intervals, once 5 are known (defaults 10 x, 120 s); before that, the startup bound. The output is read
           once a loop step (tick_interval, 0.5 s): steps faster than that measure as one tick;
  eval     from a line that announces an eval (`eval ...`, `Evaluating`, `***** Running Evaluation *****`,
           `Validation ...`, `{"phase": "eval"}`) to the next step: max(hang_floor, 2 x the longest silence seen
           in an earlier eval); before any eval was seen, the startup bound.

`--hang-after DUR` replaces the learned train and eval bounds by DUR (0 or `off`: never judged). A run whose trainer
never reported a step is never judged (there is no cadence to judge it by): a trainer that prints nothing onbox
reads as a step (`onbox status` says "no metric recognised") is only covered by the stall alert.
"""
from __future__ import annotations

import collections
import dataclasses
import re
import statistics
from typing import Any, Callable, Deque, Dict, Mapping, Optional, Tuple

STARTUP, TRAIN, EVAL = "startup", "train", "eval"
# A line that says an evaluation starts: its first word (after punctuation, stars or a progress bar's frame), or a
# JSON line's "phase". Matching it makes the bound longer, never shorter: a false match costs detection time only.
EVAL_LINE = re.compile(r"^[\W_]*(?:(?:running|starting|start|begin(?:ning)?|doing|run)\s+)?"
                       r"(?:eval(?:uat(?:e|es|ing|ion))?|validat(?:e|es|ing|ion)|val)\b"
                       r"|\"phase\"\s*:\s*\"eval", re.IGNORECASE)
TRAIN_LINE = re.compile(r"\"phase\"\s*:\s*\"train")
EVAL_FACTOR = 2.0  # x the longest silence of an earlier eval
MIN_INTERVALS = 5  # step intervals before the train cadence counts as learned
WINDOW = 50  # recent intervals (and eval silences) kept
SAME_READ_S = 0.005  # step reports closer than this were read together (one loop step), not made this fast


@dataclasses.dataclass
class HangSettings:
    """The rule's knobs (RunConfig: hang_after, hang_factor, hang_floor, hang_startup; seconds)."""

    after: Optional[float] = None  # a fixed bound for train and eval instead of the learned one; 0: never judged
    factor: float = 10.0
    floor: float = 120.0
    startup: float = 1200.0
    probe_every: float = 1.0  # seconds between two looks at the checkpoint dir once quiet past the bound

    @classmethod
    def of(cls, cfg: Any) -> "HangSettings":
        return cls(after=cfg.hang_after, factor=float(cfg.hang_factor), floor=float(cfg.hang_floor),
                   startup=float(cfg.hang_startup))

    @property
    def off(self) -> bool:
        return self.after is not None and self.after <= 0


@dataclasses.dataclass
class HangVerdict:
    """Why the trainer is hung: nothing for `quiet_s` in `phase`, past `bound_s` (`rule` says how it was set)."""

    phase: str
    quiet_s: float
    bound_s: float
    rule: str
    step: Optional[int]
    typical_s: Optional[float]

    def to_dict(self) -> Dict[str, Any]:
        return {"phase": self.phase, "quiet_s": round(self.quiet_s, 3), "bound_s": round(self.bound_s, 3),
                "rule": self.rule, "step": self.step,
                "typical_step_s": None if self.typical_s is None else round(self.typical_s, 4)}


class HangDetector:
    """One run's cadence and the quiet of its current attempt. `reported` (a step was seen in an earlier attempt or
    by an earlier agent) lets the startup bound apply before this attempt's first step; else nothing is judged until
    a step comes. A verdict is given once per quiet period: any sign of life (`alive`) re-arms it."""

    def __init__(self, settings: HangSettings, reported: bool = False) -> None:
        self.settings = settings
        self.reported = reported
        self.intervals: Deque[float] = collections.deque(maxlen=WINDOW)  # seconds between train step reports
        self.eval_silences: Deque[float] = collections.deque(maxlen=WINDOW)  # the longest quiet of each eval
        self.phase = STARTUP
        self.step: Optional[int] = None
        self.mark = 0.0  # the last sign of life (monotonic)
        self.last_step_at: Optional[float] = None
        self.eval_longest = 0.0
        self.fired = False
        self._probed_at = float("-inf")

    # ---- what the supervisor sees ---------------------------------------------------------------------------
    def attempt_started(self, now: float) -> None:
        """A new attempt (or an adopted child): back to its startup, the cadence learned so far kept."""
        self.phase, self.mark, self.last_step_at, self.fired, self.eval_longest = STARTUP, now, None, False, 0.0
        self.step = None  # whatever step it resumes at is its first

    def alive(self, now: float) -> None:
        """A sign of life that is no step: output bytes, a write in the checkpoint dir."""
        if now <= self.mark:
            return
        if self.phase == EVAL:
            self.eval_longest = max(self.eval_longest, now - self.mark)
        self.mark, self.fired = now, False

    def line(self, text: str, now: float) -> None:
        """A line of output: one that announces an eval starts the eval phase (until the next step)."""
        if self.phase != EVAL and EVAL_LINE.search(text):
            self.alive(now)
            self.phase, self.eval_longest = EVAL, 0.0
        elif self.phase == EVAL and TRAIN_LINE.search(text):
            self._end_eval(now)
            self.phase = TRAIN

    def record(self, fields: Mapping[str, Any], now: float) -> bool:
        """A progress record; True when it carries a new step (its interval is learned in the train phase)."""
        step = fields.get("step")
        if not isinstance(step, int) or step == self.step:
            return False
        if self.phase == TRAIN and self.last_step_at is not None and now - self.last_step_at >= SAME_READ_S:
            # reports read in one loop step come microseconds apart: only the first of them measures an interval
            self.intervals.append(now - self.last_step_at)
        if self.phase == EVAL:
            self._end_eval(now)
        self.alive(now)
        self.phase, self.step, self.last_step_at, self.reported = TRAIN, step, now, True
        return True

    def _end_eval(self, now: float) -> None:
        self.eval_silences.append(max(self.eval_longest, now - self.mark))
        self.eval_longest = 0.0

    # ---- the verdict ------------------------------------------------------------------------------------------
    def typical(self) -> Optional[float]:
        """The typical time between two step reports: the median of the recent intervals, once enough are known."""
        return statistics.median(self.intervals) if len(self.intervals) >= MIN_INTERVALS else None

    def bound(self) -> Optional[Tuple[float, str]]:
        """(seconds, how they were set) in the current phase; None: not judged now."""
        s = self.settings
        if s.off or not self.reported:
            return None
        if self.phase == STARTUP:
            return s.startup, "startup bound %s s (before the attempt's first step)" % _num(s.startup)
        if s.after is not None:
            return s.after, "--hang-after %s s" % _num(s.after)
        if self.phase == EVAL:
            if not self.eval_silences:
                return s.startup, "startup bound %s s (an eval, none learned yet)" % _num(s.startup)
            longest = max(self.eval_silences)
            return max(s.floor, EVAL_FACTOR * longest), "eval: max(%g x the longest eval silence %s s, floor %s s)" % (
                EVAL_FACTOR, _num(longest), _num(s.floor))
        typical = self.typical()
        if typical is None:
            return s.startup, "startup bound %s s (%d of %d step intervals learned)" % (
                _num(s.startup), len(self.intervals), MIN_INTERVALS)
        return max(s.floor, s.factor * typical), "train: max(%g x median step interval %s s, floor %s s)" % (
            s.factor, _num(typical), _num(s.floor))

    def check(self, now: float, probe: Optional[Callable[[], Optional[float]]] = None) -> Optional[HangVerdict]:
        """The verdict now, once per quiet period. `probe()`: when the checkpoint dir was last written (monotonic
        time, None: unknown), asked at most every probe_every seconds once the quiet passed the bound."""
        found = self.bound()
        if found is None or self.fired:
            return None
        bound, rule = found
        if now - self.mark < bound:
            return None
        if probe is not None:
            if now - self._probed_at < min(self.settings.probe_every, bound / 4.0):
                return None
            self._probed_at = now
            written = probe()
            if written is not None and written > self.mark:
                self.alive(min(written, now))
                if now - self.mark < bound:
                    return None
        self.fired = True
        return HangVerdict(self.phase, now - self.mark, bound, rule, self.step, self.typical())


def _num(x: float) -> str:
    return ("%.3g" % x) if x < 100 else "%.0f" % x
