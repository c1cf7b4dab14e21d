"""onbox_trainkit: what every `onbox init` template shares, in one file beside train.py. It needs only the
standard library (torch is passed in: the box's own torch, never one onbox installs, U28) and runs on Python 3.8+.

- config: a reader for the flat `key: value` YAML the templates ship (training_config.yaml), and `--key=value`
  overrides checked against the defaults' types;
- logging: one JSON object a line on stdout, flushed (the agent parses step, loss, eval_loss, lr, tokens_per_s
  from it for heartbeats and `onbox status`; U43: a line that stays in a buffer looks like a frozen run);
- the LR schedule (linear warm-up, cosine decay to a floor), precision by hardware, seeds and RNG state;
- checkpoints: atomic writes (temp name, fsync, rename, fsync the directory), the resume path from
  $ONBOX_RESUME_FROM, and a stop flag set by SIGTERM/SIGUSR1/SIGINT or $ONBOX_PREEMPT_FILE that the training
  loop acts on at the next step boundary.

Past 400 lines on purpose: `onbox init` copies this ONE file beside the user's train.py (no package to install
on the box), so everything the templates share lives here.
"""
from __future__ import annotations

import glob
import json
import math
import os
import random
import re
import signal
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

EXIT_PREEMPTED = 75  # what onbox itself exits with after a preemption: "checkpointed, restart me"

# ----------------------------------------------------------------------------------------------- config
# Why our own reader and not PyYAML: the agent ships without it, most templates do not otherwise need it, and
# PyYAML reads YAML 1.1, where `lr: 3e-4` is the STRING "3e-4" (1.1 floats need a dot) and `no` is False.
# The files `onbox init` writes are flat `key: value` lines; this reads exactly that and refuses anything else
# (nesting, `- item` lists, anchors, block scalars) with the line number, rather than guessing.
_KEY_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\-]*)\s*:(?:\s+(.*))?$")
_INT_RE = re.compile(r"^[-+]?\d+$")
_FLOAT_RE = re.compile(r"^[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?$")


class ConfigError(ValueError):
    """A config file or override this reader refuses, with where and why."""


def _strip_comment(text: str) -> str:
    """`value  # comment` -> `value`; a # inside quotes stays."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1] in " \t"):
            return text[:i].rstrip()
    return text.rstrip()


def parse_scalar(text: str) -> Any:
    """One YAML 1.2 core-schema scalar: null/~, true/false, ints, floats (3e-4 included), quoted or bare
    strings, and a flow list of those (`[0.9, 0.95]`)."""
    text = text.strip()
    if text in ("", "~", "null", "Null", "NULL"):
        return None
    if text in ("true", "True", "TRUE"):
        return True
    if text in ("false", "False", "FALSE"):
        return False
    if _INT_RE.match(text):
        return int(text)
    if _FLOAT_RE.match(text):
        return float(text)
    if text in (".inf", "+.inf", "-.inf", ".nan"):
        return float(text.replace(".", ""))
    if len(text) >= 2 and text[0] == text[-1] == "'":
        return text[1:-1].replace("''", "'")
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return json.loads(text)  # JSON's escapes are YAML's common ones
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1].strip()
        return [parse_scalar(p) for p in inner.split(",")] if inner else []
    if text[0] in "{[&*!|>%@`" or text.startswith("- "):
        raise ConfigError("%r: not a flat scalar" % text)
    return text


def read_flat_yaml(path: str) -> Dict[str, Any]:
    """The `key: value` pairs of a flat YAML file, in order. Raises ConfigError naming the line."""
    out: Dict[str, Any] = {}
    with open(path, encoding="utf-8") as f:  # U26: text mode reads CRLF line ends (saved on Windows) as LF
        lines = f.read().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#") or line.strip() in ("---", "..."):
            continue
        m = _KEY_RE.match(line)
        if line[0] in " \t" or not m:
            raise ConfigError("%s:%d: only flat `key: value` lines are read here (no nesting, `- item` lists, "
                              "anchors or block scalars): %r" % (path, n, line))
        key, value = m.group(1), _strip_comment(m.group(2) or "")
        if key in out:
            raise ConfigError("%s:%d: %s is set twice" % (path, n, key))
        try:
            out[key] = parse_scalar(value)
        except (ConfigError, ValueError) as e:
            raise ConfigError("%s:%d: %s: %s" % (path, n, key, e))
    return out


def write_flat_yaml(path: str, values: Dict[str, Any]) -> None:
    """`key: value` lines that read_flat_yaml reads back as they were (strings and lists in JSON's syntax,
    which is YAML's too)."""
    with open(path, "w", encoding="utf-8") as f:
        for key, value in values.items():
            if value is None:
                text = "null"
            elif isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, (int, float)):
                text = repr(value)
            else:
                text = json.dumps(value)
            f.write("%s: %s\n" % (key, text))


def _coerce(key: str, value: Any, default: Any, where: str) -> Any:
    """`value` as the type of `default` (an int is a fine float; None takes anything)."""
    if default is None or value is None:
        return value
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(default, list):
        if isinstance(value, list):
            return value
    elif isinstance(value, str):
        return value
    raise ConfigError("%s: %s must be %s like its default %r, not %r" % (where, key, type(default).__name__,
                                                                           default, value))


def load_config(defaults: Dict[str, Any], argv: Sequence[str], default_file: str) -> Dict[str, Any]:
    """defaults < the YAML file (`--config PATH`, else `default_file` when it exists) < `--key=value` overrides.
    Unknown keys and wrong types are refused (a typo must not silently train with the default)."""
    cfg = dict(defaults)
    args = list(argv)
    path = default_file
    if "--config" in args:
        i = args.index("--config")
        if i + 1 >= len(args):
            raise ConfigError("--config needs a path")
        path = args[i + 1]
        del args[i:i + 2]
    elif not os.path.exists(path):
        path = ""
    if path:
        for key, value in read_flat_yaml(path).items():
            if key not in defaults:
                raise ConfigError("%s: unknown key %s (known: %s)" % (path, key, ", ".join(sorted(defaults))))
            cfg[key] = _coerce(key, value, defaults[key], path)
    for arg in args:
        m = re.match(r"^--([A-Za-z_][A-Za-z0-9_.\-]*)=(.*)$", arg)
        if not m:
            raise ConfigError("%r: overrides are --key=value (keys: %s)" % (arg, ", ".join(sorted(defaults))))
        key = m.group(1)
        if key not in defaults:
            raise ConfigError("--%s: unknown key (known: %s)" % (key, ", ".join(sorted(defaults))))
        cfg[key] = _coerce(key, parse_scalar(m.group(2)), defaults[key], "--%s" % key)
    return cfg


def bad_config(message: Any) -> SystemExit:
    """One line on stderr; the SystemExit (code 2: bad input, as onbox's own) for the caller to raise."""
    print("config: %s" % message, file=sys.stderr, flush=True)
    return SystemExit(2)


def config_or_exit(defaults: Dict[str, Any], default_file: str) -> Dict[str, Any]:
    """load_config on sys.argv, or one line and exit 2 (bad input)."""
    try:
        return load_config(defaults, sys.argv[1:], default_file)
    except (ConfigError, OSError) as e:
        raise bad_config(e)


# ----------------------------------------------------------------------------------------------- logging
def log(**fields: Any) -> None:
    """One JSON object a line on stdout, flushed: `{"step": 10, "loss": 2.3, "lr": 3e-4, "tokens_per_s": ...}`,
    `{"step": 10, "eval_loss": 2.1}`, `{"event": "checkpoint", "step": 10, "path": ...}`. Nested values (the
    config) stay out of the agent's way: it reads the top-level metric names only."""
    print(json.dumps(fields, sort_keys=True), flush=True)


class Throughput:
    """Tokens (or samples) per second since the last report."""

    def __init__(self) -> None:
        self.count = 0
        self.since = time.monotonic()

    def add(self, n: int) -> None:
        self.count += n

    def rate(self) -> float:
        now = time.monotonic()
        rate = self.count / max(now - self.since, 1e-9)
        self.count, self.since = 0, now
        return round(rate, 1)


# ----------------------------------------------------------------------------------------------- schedule
def lr_at(step: int, lr: float, warmup_steps: int, max_steps: int, min_lr: float) -> float:
    """The learning rate for optimizer step `step` (0-based): linear warm-up from 0 to `lr` over
    `warmup_steps`, then a half cosine down to `min_lr` at `max_steps` (the same curve as transformers'
    `cosine_with_min_lr`)."""
    if step < warmup_steps:
        return lr * step / max(1, warmup_steps)
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def cosine_scheduler(torch: Any, optimizer: Any, lr: float, warmup_steps: int, max_steps: int,
                     min_lr: float) -> Any:
    """A LambdaLR following lr_at (the optimizer's lr must be `lr`): its state_dict, the step it is at, goes
    into every checkpoint, so a resumed run continues at the same point of the curve."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_at(s, lr, warmup_steps, max_steps, min_lr) / lr)


# ----------------------------------------------------------------------------------------------- hardware
def pick_device(torch: Any) -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_precision(torch: Any, device: str, wanted: str = "auto") -> str:
    """"bf16" where the GPU has it (Ampere and later), "fp16" (with a GradScaler) on older CUDA GPUs, "fp32" on
    CPU: bf16 autocast there is emulated on most CPUs and slower than fp32. `wanted` forces one."""
    if wanted not in ("auto", "bf16", "fp16", "fp32"):
        raise bad_config("precision must be auto, bf16, fp16 or fp32, not %r" % wanted)
    if wanted != "auto":
        return wanted
    if device == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


def autocast(torch: Any, device: str, precision: str) -> Any:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    return torch.autocast(device_type=device, dtype=dtype, enabled=precision != "fp32")


def grad_scaler(torch: Any, device: str, precision: str) -> Any:
    """fp16 needs loss scaling (its range underflows small gradients); bf16 and fp32 do not (disabled scaler)."""
    enabled = precision == "fp16"
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler(device, enabled=enabled)
    return torch.cuda.amp.GradScaler(enabled=enabled and device == "cuda")  # torch < 2.3


# ----------------------------------------------------------------------------------------------- seeds, RNG
def seed_everything(torch: Any, seed: int, deterministic: bool = False) -> None:
    """Seed Python, torch (every GPU too) and numpy when present. U36: bit-identical GPU runs also need
    deterministic kernels (cuDNN picks the fastest by timing otherwise): `deterministic: true`, at a cost."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True, warn_only=True)


def _lists(x: Any) -> Any:
    return [_lists(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def rng_state(torch: Any, generators: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Every RNG state, as types torch.load(weights_only=True) accepts (tensors, lists, ints)."""
    state = {"python": _lists(random.getstate()), "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    for name, gen in (generators or {}).items():
        state["gen_" + name] = gen.get_state()
    return state


def set_rng_state(torch: Any, state: Dict[str, Any], generators: Optional[Dict[str, Any]] = None) -> None:
    random.setstate(_tuples(state["python"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, gen in (generators or {}).items():
        if "gen_" + name in state:
            gen.set_state(state["gen_" + name])


# ----------------------------------------------------------------------------------------------- checkpoints
def training_state(torch: Any, model: Any, optimizer: Any, scheduler: Any, scaler: Any,
                   generators: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Everything a run needs to continue exactly where it stopped: weights, optimizer moments, the LR schedule's
    position, the loss scaler and every RNG (the template adds its step and config)."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(), "rng": rng_state(torch, generators)}


def load_training_state(torch: Any, path: str, device: str, model: Any, optimizer: Any, scheduler: Any, scaler: Any,
                        generators: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Put a training_state() checkpoint back into the live objects (weights_only: loading runs no code); returns
    the whole checkpoint for the template's own fields."""
    ckpt = torch.load(path, map_location=device, weights_only=True)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    scaler.load_state_dict(ckpt["scaler"])
    set_rng_state(torch, ckpt["rng"], generators)
    return ckpt


def checkpoint_dir(configured: str) -> str:
    """$ONBOX_CKPT_DIR (what `onbox run --ckpt-dir` commits from), else the configured dir; created."""
    path = os.path.abspath(os.environ.get("ONBOX_CKPT_DIR") or configured)
    os.makedirs(path, exist_ok=True)
    return path


def resume_path(explicit: Optional[str] = None) -> Optional[str]:
    """$ONBOX_RESUME_FROM (the newest verified checkpoint onbox restored; empty on a fresh start), else
    `explicit` (a --resume flag); None to start from scratch."""
    path = os.environ.get("ONBOX_RESUME_FROM") or explicit or ""
    if not path:
        return None
    if not os.path.exists(path):
        raise SystemExit("resume: %s does not exist" % path)
    return path


def fsync_dir(path: str) -> None:
    """fsync of a file does not persist its directory entry: the rename needs the directory's own fsync."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_torch_save(torch: Any, obj: Any, path: str) -> None:
    """U6: torch.save is not atomic (it truncates the target first: a kill or a full disk mid-save leaves an
    empty or torn file where the only good checkpoint was).
    Write a hidden temp name in the same directory, flush, fsync, rename over the target, fsync the directory:
    a reader sees the old checkpoint or the new one, never part of one. onbox never commits the temp name."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, ".%s.tmp-%d" % (os.path.basename(path), os.getpid()))
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def publish_dir(staging: str, final: str) -> None:
    """Make a checkpoint directory appear whole: fsync every file and directory under `staging`, rename it to
    `final` (which must not exist), fsync the parent. A kill before the rename leaves only the staging name."""
    for dirpath, _dirs, files in os.walk(staging):
        for fn in files:
            fd = os.open(os.path.join(dirpath, fn), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)
    os.rename(staging, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))


def prune(pattern: str, keep: int) -> List[str]:
    """Delete all but the newest `keep` local checkpoints matching `pattern`, ordered by the step in their names
    (checkpoint-900 before checkpoint-1000). onbox commits the newest to durable storage; the local disk is fast
    but small (U6: a full disk kills the next save). keep 0: keep all."""
    import shutil

    def step_of(path: str) -> Any:
        digits = re.findall(r"\d+", os.path.basename(path))
        return (int(digits[-1]) if digits else -1, path)

    doomed = sorted(glob.glob(pattern), key=step_of)[:-keep] if keep > 0 else []
    for path in doomed:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.unlink(path)
    return doomed


def finish(code: int) -> int:
    """The exit code, after making the exit quick: a process that imported torch spends a second or more of
    its teardown collecting garbage, a second a short preemption grace window (a few seconds on some platforms)
    needs for onbox's final commit. gc.freeze() skips that; atexit handlers and flushes still run."""
    import gc

    sys.stdout.flush()
    gc.freeze()
    return code


class StopFlag:
    """SIGTERM (onbox's checkpoint signal, docker stop, Kubernetes), SIGUSR1 (a scheduler's warning) and SIGINT
    only set a flag; the loop saves a checkpoint at the next step boundary and exits 75. Polling
    $ONBOX_PREEMPT_FILE catches a preemption even where the signal went elsewhere. (NCCL also uses SIGUSR1 in
    multi-GPU jobs: there, give `onbox run --checkpoint-signal TERM`, its default.)"""

    SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.preempt_file = os.environ.get("ONBOX_PREEMPT_FILE", "")

    def install(self) -> "StopFlag":
        for name in self.SIGNALS:
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), self._record)
        return self

    def _record(self, signum: int, _frame: Any) -> None:
        self.signum = signum

    def requested(self) -> bool:
        return self.signum is not None or bool(self.preempt_file and os.path.exists(self.preempt_file))

    def reason(self) -> str:
        if self.signum is not None:
            return signal.Signals(self.signum).name
        return "preempt file"


def split_params(model: Any) -> List[Dict[str, Any]]:
    """AdamW parameter groups: weight decay on matrices (>= 2 dims), none on biases and norms."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]

