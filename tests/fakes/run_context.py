"""The one builder of a hand-made RunContext (what the supervisor gives every hook), for tests of one hook."""
from __future__ import annotations

import pathlib
from typing import Any, Callable, Optional

from onbox.clock import FakeClock
from onbox.config import RunConfig
from onbox.supervisor.hooks import RunContext
from tests.fakes.recorders import EventRecorder


def run_context(tmp_path: Any, *, name: str = "r1", run_dir: Any = None, ckpt_dir: Any = None, clock: Any = None,
                emit: Optional[Callable[..., None]] = None, **cfg: Any) -> RunContext:
    """A RunContext over tmp dirs: run_dir `tmp_path/run` and ckpt_dir `tmp_path/ckpt` unless given (both made),
    a FakeClock and an EventRecorder as `emit` unless given, attempt 0. `cfg` are RunConfig fields, over the
    checkpoint tests' defaults: durable `tmp_path/durable`, sync_interval 5 s, settle_seconds 3 s (durable=None:
    a run without a durable target)."""
    root = pathlib.Path(tmp_path)
    run = pathlib.Path(run_dir) if run_dir is not None else root / "run"
    ckpt = pathlib.Path(ckpt_dir) if ckpt_dir is not None else root / "ckpt"
    run.mkdir(parents=True, exist_ok=True)
    ckpt.mkdir(parents=True, exist_ok=True)
    fields = {"durable": str(root / "durable"), "sync_interval": 5.0, "settle_seconds": 3.0, **cfg}
    config = RunConfig(name=name, ckpt_dir=str(ckpt), **fields)
    return RunContext(name=name, run_dir=str(run), ckpt_dir=str(ckpt), config=config,
                      clock=clock if clock is not None else FakeClock(),
                      emit=emit if emit is not None else EventRecorder(), attempt=lambda: 0)
