"""The embedded heartbeat tracker (`onboxctl tracker serve`): a SQLite store, HTTP API v1 (documented in API.md)
and the dashboard.

  store.py      the store: SQLite in WAL mode, one writer connection
  columns.py    the dashboard's columns of a stored beat (store.py writes them, series.py reads them)
  app.py        the HTTP API v1, a Starlette app; answers.py: its 4xx answers and the one reader of a request body
  session.py    who may read and write: the bearer token and the dashboard's session cookie
  hosts.py      which Host names it answers (DNS rebinding: a foreign name gets 421), in front of every request
  guard.py      connection limits: stalled clients are timed out and never crowd others out
  server.py     serving it: the listening socket, TLS, the guard, uvicorn
  events.py     what happened to a run that no heartbeat says (the keeper's decisions), each with its time
  overview.py   the dashboard's run list, one row per run, sent again only when the run has new beats
  series.py     a run's curves: its beats as columns, and the trainer's own points
  pulled.py     what the tracker can say of "pulled home and verified" for a run's newest durable checkpoint
  dashboard.py  the pages (`/`, `/run/<run>`), the login form and the static files (static/: the page, uPlot)
  goodput.py    every run's goodput ledger (controller/goodput/), its beats folded as they are stored
  ledgers.py    the routes over the ledgers: `GET /api/v1/goodput` and `GET /metrics`
  metrics.py    the /metrics text: every run and its GPUs, OpenMetrics (METRICS.md: the series, DCGM's names)
  runfacts.py   what the onboxctl config dir says of a run: its launch record, its box's profile, pool, price
  runpage.py    a run page's facts: command line, start, elapsed, durable target, work at risk, next step
  client.py     the other side: reading a tracker's run list for `onboxctl status` and the keeper (via
                runview.py), each run checked on its own; imports nothing of the server
  runview.py    what `onboxctl status`, the dashboard and the keeper show of a run: one normalized row, from the
                tracker or from the boxes, and the table

May import controller.boxes (the inventory), .results (the pulls record) and .goodput, and onbox's library.

README.md says what each surface reads from whom and what stops a bad input (the threat model).
"""
