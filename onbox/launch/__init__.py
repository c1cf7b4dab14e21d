"""Launching a run: from the option values of `onbox run`, `onbox adopt` and `onbox queue add` to a running
Supervisor. prepare() resolves and checks everything in the foreground, so every refusal (exit 2, 3) comes before
anything is created and reaches the user, not a detached agent's log; start(plan) creates the run and supervises it.

  plan.py     prepare() and prepare_adopt() -> LaunchPlan: the configuration layers, the re-launch record, checks
  container.py training in a container: the docker client as the supervised child, its process seam
  checks.py   what is checked and said before anything is created, beyond RunConfig.validate
  deadline.py the run's deadline for this launch: --deadline, the Slurm job's EndTime, the profile's session hours
  match.py    which runs on this box a launch of a command would continue (the reading side of `onbox match`)
  start.py    start(plan): the run dir, its lock and record, the Supervisor in the foreground or detached
  stopping.py `onbox stop` the same way: prepare_stop() checks, stop(plan) asks the agent (or stops an orphaned
              child itself) and waits on the clock seam

It sits above the supervisor and the subsystems and wires them together, as a command would; only onbox.commands
imports it. May import: the shared leaves, onbox.config, onbox.supervisor, onbox.subsystems (preflight, the hooks),
onbox.platform (the profile layer), onbox.multinode (a node group) and onbox.slurm (a Slurm job's run name and
end time).
"""
