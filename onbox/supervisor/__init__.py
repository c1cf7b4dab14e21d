"""The run lifecycle: everything between `onbox run` and the exit code.

  state.py     RunState (a str Enum), its legal transitions and exit codes
  loop.py      Supervisor: the one loop, observe -> decide -> act
  hooks.py     the seams the loop drives (checkpoints, telemetry, reaper): interfaces and no-op implementations
  exits.py     what a child's exit means (OOM, NCCL, CUDA, signal) and what to do about it
  preempt.py   signals and cloud metadata notices -> one PreemptionNotice
  childenv.py  the child's argv and environment
  rundir.py    the run directory's files and their writers
  detach.py    daemonize, the per-run lock, re-adopting a live child

May import: the shared leaves (errors, clock, paths, fsutil, proc, config, tomlread), onbox.telemetry (host
readings for exit classification) and onbox.slurm.job (requeue, KillWait). Never a subsystem that plugs into the
hooks (onbox.checkpoints, onbox.heartbeat, onbox.gpu): they import hooks.py, and onbox.subsystems wires them in.
"""
