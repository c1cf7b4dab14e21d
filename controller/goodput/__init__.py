"""The goodput ledger: how much of a run's wall time (and of what it cost) became training it kept, from what onbox
already records (its beats: states, steps and when, durable checkpoints, the `times` of each attempt's setup).

  records.py  a heartbeat as the ledger reads it (`Beat`), from a beat's document; outside input read leniently
  fold.py     a run's beats in seq order folded into its lives (`Context`: an attempt of one agent on one box)
  ledger.py   the split of the wall time (productive, recomputed, down, restoring, starting, stalled): a pure
              function of the contexts, whose parts sum to the wall time
  spans.py    a ledger's segments and their merge; disjoint intervals (of time, of steps)
  prices.py   what an hour of a box costs: `onboxctl box add --price`, else its profile's in prices.toml
  atrisk.py   work at risk: the time and steps since the newest durable checkpoint (status, keeper, ledger)
  report.py   `onboxctl report`: the ledgers (read by controller/tracker/client.py) grouped by run, box, profile or
              pool, over a window

Imports nothing else of the controller (the floor below boxes), only onbox's library; the tracker serves the ledgers
(controller/tracker/goodput.py), the dashboard and /metrics read them from there. README.md defines each part and
lists the ledgers of the real scenarios the tests record.
"""
