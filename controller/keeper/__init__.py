"""The keeper: `onboxctl keep` watches the runs launched with `--recover pool:P` and brings them back without a
person: relaunched on the same box after a preemption, or recovered on a spare of the pool (or a box the user's
provision command brings up) once its box is lost. It never tears anything down. May import
controller.boxes, .launch, .tracker and .goodput, and onbox's library; only the commands import it.

Modules:
  policy.py     the recovery policy and the launch record `onboxctl run --recover` writes; durations
  records.py    the per-run files (launch.json, recovery.json), the keeper's states and a recovery's phases
  decide.py     the judgement of one run from what was observed (a pure function; its table is the docstring)
  provision.py  the user's provision command: run, bounded, its one JSON line checked
  provision_options.py  the ssh options a provision's output may set (an allow-list; ProxyCommand & co refused)
  provision_run.py      running it: a timeout, 64 KiB of stdout and of stderr kept in memory, leftovers said
  provision_reaper.py   the process between the keeper and the command: a subreaper that stops what it left
  world.py      the seam to boxes, the tracker and the inventory (ssh + `onbox ... --json` only)
  answers.py    the boxes' and the tracker's answers read typed: an Observation, each run's Beats
  recovery.py   one recovery, phase by phase, each decision written before it is acted on
  takeover.py   the guards of a take-over: the lost box asked once more; an earlier keeper's launch in flight
  spares.py     spares checked ahead while a run is in doubt; a fresh answer is what its recovery takes
  probes.py     every box asked at once, in a bounded pool; a probe still out taken later; `silent` boxes
  sight.py      "these boxes died" or "I lost the network": the witnesses, the keeper's blindness said once
  watch.py      one observed run judged, its record moved, what changed said
  loop.py       the keeper's one loop (a pass over every run)
  lock.py       one keeper per config dir (a flock on its runs/ directory)
  enrol.py      `onboxctl run --recover`: the checks before the launch and the records written after it
  view.py       what `onboxctl status` and `keep --json` show of each kept run, from its records (read-only)

The threat model of each surface the keeper reads (a provision's output, the records, the boxes' answers, the
tracker's beats) is in README.md here.
"""
