"""The run lifecycle: everything between `onbox run` and the exit code.

  state.py       RunState (a str Enum), its legal transitions and exit codes
  loop.py        Supervisor: the one loop, observe -> decide -> act; its Seams (the box, for tests to replace)
  attempts.py    the attempt launcher: argv and environment, spawn, record, exit classified, leftovers stopped
  restarts.py    the restart decision after an exit (RestartPolicy, pure): backoff, crash loop, restart budget
  stop.py        the one stop procedure: StopStage, the timeline notices, `onbox stop` and phase ends share, the grace
  notices.py     a notice's stop: what asks for it (NoticeIntake) and its timeline acted out on the attempt (NoticeStop)
  deadline.py    the run's deadline: ask_at = deadline - (grace + commit estimate + margin), a session_limit notice
  endings.py     how a run ends: the final commit, and what each end (stopped, preempted, session limit, fenced)
                 records and says
  phases.py      [[phase]] curricula: which command an attempt runs, when a phase ends, what its end means
  phasespec.py   the [[phase]] tables checked into PhaseSpecs and their criteria
  output.py      where the trainer's output goes once read: the telemetry hook, the one ProgressFeed, the curriculum
  journal.py     what the run says: events, state.json, training_status.md, progress.json, hook calls that cannot
                 kill the loop
  records.py     those records on a run dir that refuses writes (held in memory, written once it takes them)
  notes.py       what the supervisor learns from events and must show (warnings, the requeue outcome)
  runsummary.py  training_status.md, rendered from state.json's document
  hooks.py       the seams the loop drives (checkpoints, telemetry, reaper, nodes): interfaces, no-op versions
  exits.py       what a child's exit means (OOM, NCCL, CUDA, signal, hung) and what to do about it
  hang.py        the hang watch: the trainer's cadence judged each step, the evidence kept, then --on-hang
  stacks.py      a hung attempt's evidence: every process's Python stack (py-spy, opted-in faulthandler, /proc)
  leftovers.py   what an attempt left running (its tree, its marker) and how it is stopped
  preempt.py     signals and cloud metadata notices -> one PreemptionNotice
  childenv.py    the child's argv and environment
  rundir.py      the run directory's files, their writers, and the one reader of config.json
  detach.py      daemonize, the per-run lock, re-adopting a live child, stopping one whose agent is gone
  shim.py        the keeper of an attempt's child (a shim): the child's exit status outlives the agent, an adopting
                 agent reads it (KeptProcessSeam); why a fork of the agent, and what it keeps the same for the child
  shimproc.py    the keeper's own life in the forked process: signals, session, descriptors, wait, report, record

May import: the shared leaves (errors, clock, paths, fsutil, proc, config, tomlread), onbox.telemetry (host
readings for exit classification) and onbox.slurm.job (requeue, KillWait). Never a subsystem that plugs into the
hooks (onbox.checkpoints, onbox.heartbeat, onbox.gpu): they import hooks.py, and onbox.subsystems wires them in.
"""
