"""Progress from the job's own output, without code changes: step, loss, eval loss, lr, tokens/s, samples/s.

One `MetricsParser` turns a line of the child's output into a dict of canonical fields (or None). Formats, tried
in order (the first that recognises a line wins; golden files of real output live in tests/golden/metrics/):

- user regexes from the run file (named groups: step, loss, eval_loss, lr, tokens_per_s, samples_per_s, epoch)
- JSON lines (`{"step": 10, "loss": 2.3}`) — also what the trainer appends to ONBOX_METRICS_FILE (read by
  onbox.telemetry.progress.MetricsFileTail)
- Hugging Face Trainer dict-literal lines (`{'loss': 2.3, 'grad_norm': 1.1, 'learning_rate': 5e-05, 'epoch': 0.5}`,
  newer versions print the values as strings) and eval lines (`{'eval_loss': 2.1, ...}`)
- nanoGPT: `iter N: loss X, time Yms, mfu Z%` and `step N: train loss X, val loss Y`
- LitGPT: `Epoch 1 | iter 100 step 25 | loss train: 2.345, val: n/a | iter time: 12.34 ms (step) ...`, the older
  `iter 100 step 25: loss 2.3456, iter time: 12.34ms (optimizer.step)` and `iter 600: val loss 3.1, val time: ...`
- tqdm progress bars (HF's `34/204 [01:07<05:30,  1.94s/it]`), PyTorch Lightning's `Epoch 0:  6%|█▍ | 86/1563
  [00:06<01:44, 14.19it/s, v_num=0, train_loss=1.800]` with its postfix metrics, its RichProgressBar
  (`Epoch 0/23 ━━━ 98/98 0:00:22 • 0:00:00 4.44it/s v_num: 0 train/loss: 1.559`) and its printed metrics table
  (`     val_loss            0.2121`)
- `key=value` pairs (any key; `key: value` only for the known metric names)
- a counter and a loss in any of the common hand-written shapes: `step 10 loss 0.5`, `Step 10/1000 | loss: 0.5`,
  `iter 10, loss = 0.5`, `Epoch 3 ... train loss 2.3e-01`, `[step 10] loss: 0.5 lr: 3e-4` (`step_loss`)

A carriage return inside a line (tqdm redraws) splits it into segments; each is parsed and merged.
"""
from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, Callable, Dict, Iterable, List, Optional, Pattern, Tuple

from onbox.errors import UsageError

FIELDS = ("step", "loss", "eval_loss", "lr", "tokens_per_s", "samples_per_s", "epoch", "steps_per_s")
INT_FIELDS = ("step",)
MAX_STEP = 2 ** 63 - 1  # what every reader of a step takes (the tracker's SQLite, MLflow's int64): a larger one is noise

NUM = r"[-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|NaN|NAN|inf|Inf|INF|infinity|Infinity)"

# Names people use for the same quantity -> the canonical field. Keys are compared lower-cased.
ALIASES: Dict[str, str] = {}
for _field, _names in {
    "step": ("step", "global_step", "iter", "iter_num", "iteration", "it", "trainer/global_step", "train/step"),
    "loss": ("loss", "train_loss", "train/loss", "training_loss", "loss_train", "train_loss_step", "loss_step",
             "lm_loss", "train/lm_loss", "train/loss_step"),
    "eval_loss": ("eval_loss", "val_loss", "valid_loss", "validation_loss", "eval/loss", "val/loss",
                  "val_loss_epoch", "loss_val"),
    "lr": ("lr", "learning_rate", "train/learning_rate", "lr-adamw", "train/lr", "lr_0"),
    "tokens_per_s": ("tokens_per_s", "tokens_per_sec", "tokens_per_second", "tok/s", "tok_per_s", "tok_per_sec",
                     "tps", "throughput/tokens_per_sec", "train/tokens_per_sec", "tokens/s"),
    "samples_per_s": ("samples_per_s", "samples_per_sec", "samples_per_second", "train_samples_per_second",
                      "throughput/samples_per_sec", "train/samples_per_sec", "samples/s"),
    "epoch": ("epoch", "train/epoch"),
    "steps_per_s": ("steps_per_s", "it/s", "steps_per_second", "train_steps_per_second"),
}.items():
    for _n in _names:
        ALIASES[_n] = _field

# Names accepted in the `key: value` form (colons are everywhere in logs; only the known names are trusted).
_COLON_KEYS = tuple(k for k in ALIASES if k not in ("it", "iter", "it/s"))

Fields = Dict[str, float]
MAX_LINE = 16384


def to_number(value: Any) -> Optional[float]:
    """A float from a number or a numeric string ('2.3', 'nan', '1e-4'); None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        return value
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:  # a JSON integer of 400 digits: past any float, i.e. diverged, never a crash
            return math.inf if value > 0 else -math.inf
    if isinstance(value, str):
        text = value.strip()
        if not text or len(text) > 64:
            return None
        try:
            return float(text)
        except ValueError:
            return None
    return None


def canonical(pairs: Iterable[Tuple[str, Any]], strict_step: bool = True) -> Fields:
    """Map (name, value) pairs onto canonical fields; unknown names and non-numbers are dropped."""
    out: Fields = {}
    for name, value in pairs:
        field = ALIASES.get(str(name).strip().lower())
        if field is None:
            continue
        number = to_number(value)
        if number is None:
            continue
        if field in INT_FIELDS:
            if not math.isfinite(number) or (strict_step and number != int(number)) or not 0 <= number <= MAX_STEP:
                continue
            number = int(number)
        out[field] = number
    return out


# ---------------------------------------------------------------------------------------------- the formats
_NANOGPT_ITER = re.compile(r"\biter (\d+): loss (%s), time (%s)ms(?:, mfu (%s)%%)?" % (NUM, NUM, NUM))
_NANOGPT_EVAL = re.compile(r"\bstep (\d+): train loss (%s), val loss (%s)" % (NUM, NUM))
_LITGPT_NEW = re.compile(
    r"Epoch (\d+) \| iter (\d+) step (\d+) \| loss train: (%s),(?: val: (%s|n/a))?.*?"
    r"(?:iter time: (%s) m?s)?" % (NUM, NUM, NUM))
_LITGPT_OLD = re.compile(r"\biter (\d+) step (\d+): loss (%s), iter time: (%s) ?ms" % (NUM, NUM))
_LITGPT_VAL = re.compile(r"\biter (\d+): val loss (%s), val time: (%s) ?ms" % (NUM, NUM))
_LITGPT_FINAL = re.compile(r"Final evaluation \| val loss: (%s)" % NUM)
# The core of a tqdm bar: `n/total [elapsed<remaining, rate unit, postfix]`. It may only start where a number
# starts (the lookbehind): without it a long run of digits makes the search quadratic.
_TQDM = re.compile(
    r"(?<![\d/.])(?P<n>\d+)/(?P<total>\d+|\?)\s*\[(?P<elapsed>[\d:]+)<(?P<remain>[\d:?]+),\s*"
    r"(?P<rate>%s|\?)\s*(?P<unit>[^\s,\]]+)(?P<postfix>[^\]]*)\]" % NUM)
_PERCENT_TAIL = re.compile(r"\d{1,3}%$")
_LIGHTNING_EPOCH = re.compile(r"^\s*Epoch (\d+)(?:/\d+)?\s*:?\s*$")
_RICH_BAR = re.compile(
    r"^\s*Epoch (\d+)/-?\d+\s+\S*\s+(\d+)/(?:\d+|--)\s+[\d:]+\s+\u2022\s+[-\d:]+\s+(%s)(it/s|s/it)(.*)$" % NUM)
_TABLE_ROW = re.compile(r"^\s*[\u2502\u2503|]?\s*([\w./-]+)\s*[\u2502\u2503|]?\s+(%s)\s*[\u2502\u2503|]?\s*$" % NUM)
_KV = re.compile(r"(?<![\w./-])([A-Za-z_][\w./-]*)=(%s)(?![\w.])" % NUM)  # `a = 3` is a config dump
_COLON = re.compile(r"(?<![\w./-])(%s)\s*:\s*(%s)(?![\w.:])" % (
    "|".join(re.escape(k) for k in sorted(_COLON_KEYS, key=len, reverse=True)), NUM))


def parse_json_line(line: str) -> Optional[Fields]:
    text = line.strip()
    if not (text.startswith("{") and text.endswith("}")):
        return None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    return canonical(obj.items()) or None


def parse_hf_dict(line: str) -> Optional[Fields]:
    """HF Trainer prints `str(logs)`: a Python dict literal; recent versions format the numbers as strings."""
    text = line.strip()
    start = text.find("{'")
    if start < 0 or not text.endswith("}"):
        return None
    body = text[start:]
    if len(body) > 20000:
        return None
    try:
        obj = ast.literal_eval(body)
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        # e.g. {'grad_norm': tensor(1.2), ...} or np.float64(...): fall back to the plain 'key': number pairs
        obj = dict(re.findall(r"'([\w./-]+)':\s*'?(%s)'?" % NUM, body))
        if not obj:
            return None
    if not isinstance(obj, dict):
        return None
    pairs = []
    for key, value in obj.items():
        key = str(key)
        if key == "epoch":
            pairs.append(("epoch", value))
        elif key in ("loss", "train_loss"):
            pairs.append(("loss", value))
        elif key == "eval_loss":
            pairs.append(("eval_loss", value))
        elif key == "learning_rate":
            pairs.append(("lr", value))
        elif key in ("train_samples_per_second",):
            pairs.append(("samples_per_s", value))
        elif key in ("step", "global_step"):
            pairs.append(("step", value))
    return canonical(pairs) or None


def parse_nanogpt(line: str) -> Optional[Fields]:
    m = _NANOGPT_ITER.search(line)
    if m:
        out: Fields = {"step": int(m.group(1)), "loss": float(m.group(2))}
        ms = float(m.group(3))
        if ms > 0 and math.isfinite(ms):
            out["steps_per_s"] = 1000.0 / ms
        return out
    m = _NANOGPT_EVAL.search(line)
    if m:
        return {"step": int(m.group(1)), "loss": float(m.group(2)), "eval_loss": float(m.group(3))}
    return None


def parse_litgpt(line: str) -> Optional[Fields]:
    m = _LITGPT_NEW.search(line)
    if m:
        out: Fields = {"epoch": float(m.group(1)), "step": int(m.group(3)), "loss": float(m.group(4))}
        if m.group(5) and m.group(5) != "n/a":
            out["eval_loss"] = float(m.group(5))
        return out
    m = _LITGPT_OLD.search(line)
    if m:
        return {"step": int(m.group(2)), "loss": float(m.group(3))}
    m = _LITGPT_VAL.search(line)
    if m:
        return {"eval_loss": float(m.group(2))}
    m = _LITGPT_FINAL.search(line)
    if m:
        return {"eval_loss": float(m.group(1))}
    return None


def _bar_label(prefix: str) -> str:
    """What stands before a tqdm bar's counts, without the bar and the percentage: 'Epoch 0:' or ''."""
    text = prefix.rstrip()
    if text.endswith("|"):
        cut = text.rfind("|", 0, len(text) - 1)
        text = text[:cut].rstrip() if cut >= 0 else ""
    m = _PERCENT_TAIL.search(text)
    if m:
        text = text[: m.start()]
    return text.strip()


def parse_progress_bar(line: str) -> Optional[Fields]:
    """A tqdm bar. Lightning's (`Epoch N: ... n/total`) counts batches within the epoch, so n is not a step."""
    if "[" not in line or "<" not in line or "/" not in line:
        return None
    m = _TQDM.search(line)
    if not m:
        return None
    out: Fields = {}
    label = _bar_label(line[: m.start()])
    lightning = _LIGHTNING_EPOCH.match(label) if len(label) < 64 else None
    if label and not lightning:
        return None  # another bar (validation, a download, a data loader): not training progress
    if lightning:
        out["epoch"] = float(lightning.group(1))
    else:
        out["step"] = int(m.group("n"))
    rate = to_number(m.group("rate"))
    if rate is not None and math.isfinite(rate) and rate > 0:
        unit = m.group("unit")
        if unit == "it/s":
            out["steps_per_s"] = rate
        elif unit == "s/it":
            out["steps_per_s"] = 1.0 / rate
    postfix = m.group("postfix") or ""
    if postfix:
        out.update(canonical(_KV.findall(postfix)))
    return out


def parse_rich_bar(line: str) -> Optional[Fields]:
    """Lightning's RichProgressBar: `Epoch 0/23 ━━━ 98/98 0:00:22 • 0:00:00 4.44it/s v_num: 0 train/loss: 1.559`."""
    m = _RICH_BAR.match(line)
    if not m:
        return None
    out: Fields = {"epoch": float(m.group(1))}
    rate = to_number(m.group(3))
    if rate is not None and math.isfinite(rate) and rate > 0:
        out["steps_per_s"] = rate if m.group(4) == "it/s" else 1.0 / rate
    out.update(canonical(re.findall(r"([\w./-]+):\s*(%s)(?![\w.])" % NUM, m.group(5))))
    return out


def parse_table_row(line: str) -> Optional[Fields]:
    """A row of Lightning's printed metrics table (`val_loss   0.2121` or `│ val_loss │ 0.2121 │`)."""
    m = _TABLE_ROW.match(line)
    if not m:
        return None
    return canonical([(m.group(1), m.group(2))]) or None


def parse_key_values(line: str) -> Optional[Fields]:
    pairs: List[Tuple[str, str]] = _KV.findall(line)
    pairs += _COLON.findall(line)
    return canonical(pairs) or None


# A counter word and its number (`step 10`, `Step: 10/1000`, `[iter 10]`, `Epoch 3`, `global_step=10`) ...
_COUNTER = re.compile(r"(?<![\w./-])(global_step|step|iteration|iter|it|epoch)\s*[:=#]?\s*(\d+)(?:\s*/\s*\d+)?(?![\w.])",
                      re.IGNORECASE)
# ... and a loss or learning rate written with a space, `:` or `=` (`loss 0.5`, `train loss: 2.3`, `lr=3e-4`).
_LOSSISH = re.compile(r"(?<![\w./-])((?:train(?:ing)?[ _/])?loss|(?:val(?:id(?:ation)?)?|eval)[ _/]loss|lr|"
                      r"learning[ _]rate)\s*[:=]?\s*(%s)(?![\w.])" % NUM, re.IGNORECASE)
_LOSSISH_FIELD = {"loss": "loss", "lr": "lr", "learning rate": "lr", "learning_rate": "lr"}


def parse_step_loss(line: str) -> Optional[Fields]:
    """A counter and a loss in the shapes people print by hand (`step 10 loss 0.5`, `Epoch 3 | loss: 0.5`).
    Both must be there: `epoch 3` alone, or a lone number after "loss", is no progress report. Lines the
    `key=value` form already reads whole are left to it."""
    if "loss" not in line.lower():
        return None
    kv = parse_key_values(line) or {}
    if ("step" in kv or "epoch" in kv) and ("loss" in kv or "eval_loss" in kv):
        return None
    out: Fields = {}
    for word, number in _COUNTER.findall(line):
        field = "epoch" if word.lower() == "epoch" else "step"
        if field not in out:
            out[field] = float(number) if field == "epoch" else int(number)
    if not out:
        return None
    found = False
    for word, number in _LOSSISH.findall(line):
        name = word.lower().replace("training", "train")
        field = _LOSSISH_FIELD.get(name) or ("loss" if name.startswith("train") else "eval_loss")
        value = to_number(number)
        if value is not None and field not in out:
            out[field] = value
            found = found or field in ("loss", "eval_loss")
    if not found:
        return None
    for key, value in kv.items():
        out.setdefault(key, value)
    return out


class MetricsParser:
    """Recognises the formats above; `user_regexes` (named groups) are tried first."""

    def __init__(self, user_regexes: Iterable[str] = ()) -> None:
        self.user: List[Pattern[str]] = []
        for text in user_regexes:
            try:
                pattern = re.compile(text)
            except re.error as e:
                raise UsageError("--metrics-regex %r is not a valid regular expression: %s" % (text, e),
                                 hint="use Python re syntax with named groups, e.g. r'step (?P<step>\\d+) loss "
                                      "(?P<loss>\\S+)'")
            if not any(name.lower() in ALIASES for name in pattern.groupindex):
                raise UsageError("--metrics-regex %r has no named group for a metric%s" % (
                    text, " (%s)" % ", ".join(sorted(pattern.groupindex)) if pattern.groupindex else ""),
                    hint="name the groups after the fields: (?P<step>...), loss, eval_loss, lr, tokens_per_s, "
                         "samples_per_s, epoch")
            self.user.append(pattern)
        self.formats: List[Tuple[str, Callable[[str], Optional[Fields]]]] = [
            ("json", parse_json_line),
            ("hf", parse_hf_dict),
            ("nanogpt", parse_nanogpt),
            ("litgpt", parse_litgpt),
            ("progress_bar", parse_progress_bar),
            ("rich_bar", parse_rich_bar),
            ("table_row", parse_table_row),
            ("step_loss", parse_step_loss),
            ("key_value", parse_key_values),
        ]

    def parse(self, line: str) -> Optional[Fields]:
        """Canonical fields found in one line of output, or None."""
        if len(line) > MAX_LINE:  # a metrics line is short; a megabyte of output on one line is not one
            line = line[-MAX_LINE:]
        merged: Fields = {}
        for segment in line.split("\r"):
            found = self._parse_segment(segment)
            if found:
                merged.update(found)
        if not 0 <= merged.get("step", 0) <= MAX_STEP:  # `step=<400 digits>` matched a format's \d+
            del merged["step"]
        return merged or None

    def parse_with_format(self, line: str) -> Tuple[Optional[str], Optional[Fields]]:
        """(format name, fields) of the first format that recognises the line: for tests and debugging."""
        for name, fn in self._all():
            found = fn(line)
            if found:
                return name, found
        return None, None

    def _all(self) -> List[Tuple[str, Callable[[str], Optional[Fields]]]]:
        return [("user", self._parse_user), *self.formats]

    def _parse_segment(self, segment: str) -> Optional[Fields]:
        if not segment.strip():
            return None
        for _name, fn in self._all():
            found = fn(segment)
            if found:
                return found
        return None

    def _parse_user(self, line: str) -> Optional[Fields]:
        for pattern in self.user:
            m = pattern.search(line)
            if m:
                found = canonical(((k, v) for k, v in m.groupdict().items() if v is not None), strict_step=False)
                if found:
                    return found
        return None
