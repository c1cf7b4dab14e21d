"""A run file's `[[phase]]` tables (their keys: phases.py's docstring), checked: each becomes a PhaseSpec, or a
UsageError (exit 2) naming the phase, the key and the problem. What the phases do when they run is phases.py's.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from onbox.config import check_env_entry
from onbox.errors import UsageError
from onbox.paths import valid_run_name
from onbox.telemetry.metrics import ALIASES

KEYS = ("name", "command", "args", "resume_args", "target_steps", "target_tokens", "tokens_per_step", "lr",
        "min_lr", "lr_schedule", "warmup_steps", "env", "criteria", "on_fail")
ON_FAIL = ("fail", "continue")
MAX_PHASES = 100
MAX_COUNT = 10 ** 15  # steps or tokens: a bound against typos, far beyond any real run
OPS: Dict[str, Callable[[float, float], bool]] = {"<": operator.lt, "<=": operator.le, ">": operator.gt,
                                                 ">=": operator.ge}
CRITERION_RE = re.compile(r"^\s*([A-Za-z_][\w/.-]*)\s*(<=|>=|<|>)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")


@dataclasses.dataclass(frozen=True)
class Criterion:
    metric: str  # the canonical field (eval_loss for "val_loss")
    op: str
    value: float
    text: str  # as written

    def check(self, values: Mapping[str, Any]) -> Dict[str, Any]:
        """{criterion, value, ok, why}: the newest value of the metric against the bound."""
        seen = values.get(self.metric)
        if not isinstance(seen, (int, float)) or isinstance(seen, bool) or not math.isfinite(seen):
            return {"criterion": self.text, "value": seen, "ok": False,
                    "why": "%s was %s" % (self.metric, "never reported in this phase" if seen is None else seen)}
        ok = OPS[self.op](float(seen), self.value)
        return {"criterion": self.text, "value": seen, "ok": ok,
                "why": "%s %s %s %g" % (self.metric, _num(seen), self.op if ok else "is not " + self.op, self.value)}


@dataclasses.dataclass(frozen=True)
class PhaseSpec:
    """One [[phase]] table, checked."""

    name: str
    command: Optional[List[str]] = None
    args: Tuple[str, ...] = ()
    resume_args: Optional[List[str]] = None
    target_steps: Optional[int] = None
    target_tokens: Optional[int] = None
    tokens_per_step: Optional[int] = None
    lr: Optional[float] = None
    min_lr: Optional[float] = None
    lr_schedule: Optional[str] = None
    warmup_steps: Optional[int] = None
    env: Tuple[Tuple[str, str], ...] = ()
    criteria: Tuple[Criterion, ...] = ()
    on_fail: str = "fail"

    @property
    def target_step(self) -> Optional[int]:
        """The step that ends the phase: target_steps, or target_tokens / tokens_per_step rounded up."""
        if self.target_steps is not None:
            return self.target_steps
        if self.target_tokens is not None and self.tokens_per_step:
            return -(-self.target_tokens // self.tokens_per_step)
        return None

    def child_env(self, index: int, count: int, start_step: Optional[int]) -> Dict[str, str]:
        """ONBOX_PHASE* for the command (the LR policy included: the trainer applies it), then the phase's env."""
        out = {"ONBOX_PHASE": self.name, "ONBOX_PHASE_INDEX": str(index), "ONBOX_PHASE_COUNT": str(count),
               "ONBOX_PHASE_START_STEP": str(start_step or 0)}
        for var, value in (("TARGET_STEPS", self.target_step), ("TARGET_TOKENS", self.target_tokens),
                           ("LR", self.lr), ("MIN_LR", self.min_lr), ("LR_SCHEDULE", self.lr_schedule),
                           ("WARMUP_STEPS", self.warmup_steps)):
            if value is not None:
                out["ONBOX_PHASE_" + var] = _num(value)
        out.update(dict(self.env))
        return out


def _num(v: Any) -> str:
    """3e-4 -> '0.0003', 2000.0 -> '2000' (what a trainer's float() or int() reads)."""
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def parse_phases(tables: List[Dict[str, Any]]) -> List[PhaseSpec]:
    """The run's [[phase]] tables as PhaseSpecs; a UsageError (exit 2) naming the phase, the key and the problem."""
    if len(tables) > MAX_PHASES:
        raise UsageError("%d [[phase]] tables: at most %d" % (len(tables), MAX_PHASES))
    specs = [_parse_one(i, t) for i, t in enumerate(tables)]
    seen = set()
    for i, spec in enumerate(specs):
        if spec.name in seen:
            raise UsageError("[[phase]] %d: the name %r is used twice" % (i + 1, spec.name),
                             hint="each phase needs its own name (events, status and ONBOX_PHASE use it)")
        seen.add(spec.name)
        if spec.target_step is None and i < len(specs) - 1:
            raise UsageError("[[phase]] %r has no target" % spec.name,
                             hint="give target_steps (or target_tokens with tokens_per_step); only the last phase "
                                  "may run until its command exits 0")
    return specs


def _parse_one(i: int, t: Any) -> PhaseSpec:
    where = "[[phase]] %d" % (i + 1)
    if not isinstance(t, dict):
        raise UsageError("%s is not a table" % where)
    name = t.get("name")
    if not isinstance(name, str) or not valid_run_name(name):
        raise UsageError("%s needs a name of letters, digits, '.', '_' and '-', not %r" % (where, name))
    where = "[[phase]] %r" % name
    unknown = sorted(set(t) - set(KEYS))
    if unknown:
        raise UsageError("%s: unknown key %r" % (where, unknown[0]), hint="phase keys: %s" % ", ".join(KEYS))
    if "command" in t and "args" in t:
        raise UsageError("%s has both command and args" % where,
                         hint="command replaces the run's command; args are appended to it: give one")
    f: Dict[str, Any] = {"name": name, "on_fail": t.get("on_fail", "fail")}
    for key in ("command", "resume_args", "args"):
        if key in t:
            words = t[key]
            if not isinstance(words, list) or not all(isinstance(w, str) and "\0" not in w for w in words) or (
                    key == "command" and not words):
                raise UsageError("%s: %s must be a %slist of strings" % (where, key, "non-empty " if key == "command"
                                                                        else ""))
            f[key] = list(words) if key != "args" else tuple(words)
    for key in ("target_steps", "target_tokens", "tokens_per_step", "warmup_steps"):
        if key in t:
            f[key] = _count(where, key, t[key], low=0 if key == "warmup_steps" else 1)
    for key in ("lr", "min_lr"):
        if key in t:
            v = t[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= 100:
                raise UsageError("%s: %s must be a number from 0 to 100, not %r" % (where, key, v))
            f[key] = float(v)
    if "lr_schedule" in t:
        if not isinstance(t["lr_schedule"], str) or not re.match(r"^[A-Za-z0-9_.:-]{1,64}$", t["lr_schedule"]):
            raise UsageError("%s: lr_schedule must be a short name (cosine, linear, constant, wsd, ...), not %r"
                             % (where, t["lr_schedule"]))
        f["lr_schedule"] = t["lr_schedule"]
    if "target_steps" in f and "target_tokens" in f:
        raise UsageError("%s has both target_steps and target_tokens" % where, hint="give one target")
    if "target_tokens" in f and "tokens_per_step" not in f:
        raise UsageError("%s: target_tokens needs tokens_per_step" % where,
                         hint="onbox reads steps from the trainer's output: tokens_per_step (global batch x "
                              "sequence length) converts the token target into a step")
    env = t.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise UsageError("%s: env must be a table of KEY = \"value\"" % where)
    for key, value in env.items():
        check_env_entry(key, value, "%s env" % where)
    f["env"] = tuple(sorted(env.items()))
    crit = t.get("criteria", [])
    crit = [crit] if isinstance(crit, str) else crit
    if not isinstance(crit, list) or not all(isinstance(c, str) for c in crit):
        raise UsageError("%s: criteria must be a string or a list of strings like \"eval_loss < 2.5\"" % where)
    f["criteria"] = tuple(parse_criterion(where, c) for c in crit)
    if f["on_fail"] not in ON_FAIL:
        raise UsageError("%s: on_fail must be one of %s, not %r" % (where, "|".join(ON_FAIL), f["on_fail"]))
    return PhaseSpec(**f)


def _count(where: str, key: str, v: Any, low: int) -> int:
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)  # 4e10 in TOML is a float
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= MAX_COUNT:
        raise UsageError("%s: %s must be a whole number from %d to 10^15, not %r" % (where, key, low, v))
    return v


def parse_criterion(where: str, text: str) -> Criterion:
    m = CRITERION_RE.match(text)
    if not m:
        raise UsageError("%s: criterion %r is not METRIC OP NUMBER" % (where, text),
                         hint="e.g. \"eval_loss < 2.5\"; OP is one of < <= > >=")
    metric = ALIASES.get(m.group(1).lower())
    if metric is None or metric == "step":
        raise UsageError("%s: criterion %r names no metric onbox reads" % (where, text),
                         hint="use loss, eval_loss (val_loss), lr, tokens_per_s, samples_per_s or epoch")
    return Criterion(metric, m.group(2), float(m.group(3)), text.strip())
