"""Thin click commands of `onboxctl`, one module per concept (each imported only when its command runs).

  boxes.py     `box add|ls|rm|forget-key`: the inventory
  push.py      `push` and `secrets push`
  launch.py    `run`: start supervised runs (relaunches, groups, --recover), return at once
  status.py    `status [--watch]` and `logs`
  stop.py      `stop`: the agent's graceful stop
  pull.py      `pull`: a run's committed checkpoints home, verified (say_pulled: a pull's last words, shared)
  teardown.py  `down`: the teardown gate
  tunnel.py    `tunnel`: the reverse tunnels that carry beats home
  tracker.py   `tracker serve`
  queue.py     `queue BOX`: a box's run queue
  keep.py      `keep`: the recovery loop (controller/keeper/)
  report.py    `report`: the goodput ledgers, per run, box, profile or pool (controller/goodput/)
  kaggle.py    `kaggle push|status|logs|pull` (controller/kaggle/)
  params.py    click parameter types: finite numbers in range

The top room: may import every other room of the controller, onbox's library and onbox/clikit.py (the kit both
CLIs share).
"""
