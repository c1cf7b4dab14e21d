"""Fakes for the seams onbox receives, one module each:
- docker_cli: a stand-in `docker` CLI (a program put on PATH) whose "container" is a real process.
- nvml: a fake `pynvml` module.
- recorders: EventRecorder (the `emit` seam) and RunnerRecorder (a runner seam, subprocess.run's signature).
- run_context: `run_context(tmp_path, **cfg)`, the one builder of a hand-made RunContext.
- supervisor: the supervisor loop's seams by script: FakeProcs (exits_after, dies_on) and Checkpoints; loop_step,
  the loop's part for a telemetry hook driven without it.
"""
