"""Dashboard benchmarks (`python -m tests.bench dashboard`), side by side in one run:

1. Time to first paint, in a real browser (Debian's chromium through Playwright), of the run list with 100 runs
   and of a run page with 10,000 points, against a real `onboxctl tracker serve` on a database of 100 runs x 10,000
   beats (full-size documents, ~1.4 GB). Read from the page's Performance API: `first-contentful-paint` (the
   browser's paint timing: the page's frame, before any data) and the page's own mark, taken in the frame after
   the one that drew the 100 rows / the five charts ("data painted"), both from navigation start; plus the data
   request's own time (resource timing). Baseline in the same run: a tracker with 1 run x 100 beats.
2. The tracker's latency while 100 boxes push 1,000 beats/s in total (open loop, real HTTP, one keep-alive
   connection per box): p50/p99 of the beats alone (baseline), then of the beats and of the page's data requests
   while 10 run lists and 10 run pages are opened (the full list / the full 10,000-point series; one of each every
   half second) and then poll every second with their cursors (twice the page's default rate). The
   latencies depend on what else the machine runs (the load average is printed).
3. The tracker's CPU per page request, one request at a time (opening the list and a run page; a list poll when
   every run has a new beat and when none has; a run page poll with one new point).

The trainer's points (every record the agent parsed, sent with the beats): the page asks for them with every
series request (`points_after`); the 100 runs' beats carry none (the figures before points existed, beside the
same requests as the page makes them now), and one more run, `run-pts`, has 10,000 beats with 10 records each
(100,000 trainer points: a trainer printing a line every 3 s for 3.5 days), painted and read beside them.
"""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

RUNS = 100
POINTS = 10000
BOXES = 100
RATE = 1000.0  # beats/s offered in total
SECONDS = 10.0
PAGES = 10  # of each kind
POLL_S = 1.0
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TARGET_P99_MS = 50.0
TARGET_LIST_MS = 1000.0
TARGET_RUN_MS = 2000.0


TRAINER_RUN = "run-pts"
TRAINER_PER_BEAT = 10


def _template() -> Dict[str, Any]:
    """The golden heartbeat without its points: a beat as before they existed."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(here, "golden", "heartbeat", "heartbeat.json")) as f:
        doc = json.load(f)
    doc.pop("points", None)
    return doc


def _beat(tmpl: Dict[str, Any], name: str, r: int, k: int, points: int, end: float) -> Dict[str, Any]:
    attempt = 0 if k < points * 0.3 else (1 if k < points * 0.7 else 2)
    return dict(tmpl, run=name, box="box-%03d%s" % (r, "b" if attempt == 2 else ""), seq=k,
                attempt=attempt, time=end - (points - k) * 30.0, state="running",
                progress={"step": k * 10, "loss": 4.0 / (1 + k * 0.002) + 0.05 * ((k * 7919 + r) % 13) / 13,
                          "lr": 3e-4, "tokens_per_s": 50000.0 + (k * 31 + r) % 997},
                checkpoint={"latest_durable": {"name": "step-%07d" % (k // 100 * 1000), "step": k // 100 * 1000},
                            "verified": True} if k >= 100 else None)


def populate(db: str, runs: int, points: int, trainer_run: bool = False) -> float:
    """`points` beats for each of `runs` runs through the tracker's own Store (its writer's code path): a restart
    at 30 %, a replacement box at 70 %, a commit every 1,000 steps. `trainer_run`: one more run, TRAINER_RUN, whose
    beats carry TRAINER_PER_BEAT trainer records each (the steps between two beats). Returns the seconds it took."""
    from controller.tracker.store import Store
    from onbox.heartbeat.points import beat_points

    tmpl = _template()
    st = Store(db)
    t0 = time.monotonic()
    end = time.time()
    for start in range(0, points, 20):
        beats = []
        for k in range(start, min(points, start + 20)):
            for r in range(runs):
                beats.append(_beat(tmpl, "run-%03d" % r, r, k, points, end))
            if trainer_run:
                b = _beat(tmpl, TRAINER_RUN, runs, k, points, end)
                recs = [[int((b["time"] - 3.0 * (TRAINER_PER_BEAT - j)) * 1000), k * 10 - TRAINER_PER_BEAT + j + 1,
                         {"loss": 4.0 / (1 + k * 0.002) + 0.01 * j, "lr": 3e-4, "tokens_per_s": 50000.0 + j}]
                        for j in range(TRAINER_PER_BEAT)]
                beats.append(dict(b, points=beat_points(recs)))
        st.add_many([beats], [[json.dumps(b, separators=(",", ":")) for b in beats]])
    st.checkpoint()
    st.close()
    return time.monotonic() - t0


# -- 1. first paint in the browser ---------------------------------------------------------------------------------
def _paint(page: Any, url: str, mark: str, api: str) -> Dict[str, float]:
    page.goto(url)
    deadline = time.monotonic() + 120
    while not page.evaluate("() => !!(window.onboxDashboard && window.onboxDashboard.painted['%s'])" % mark):
        if time.monotonic() > deadline:
            raise RuntimeError("the page never painted its %s" % mark)
        time.sleep(0.01)
    return page.evaluate("""() => {
        const fcp = performance.getEntriesByName('first-contentful-paint')[0];
        const done = performance.getEntriesByName('onbox:%s-painted')[0];
        const data = performance.getEntriesByType('resource').filter(r => r.name.includes('%s'));
        return {fcp: fcp ? fcp.startTime : NaN, painted: done.startTime,
                data: data.reduce((s, r) => s + r.responseEnd - r.requestStart, 0),
                bytes: data.reduce((s, r) => s + r.encodedBodySize, 0)};
    }""" % (mark, api))


def bench_paint(big: Any, small: Any, rounds: int = 5) -> Optional[bool]:
    if not os.access(CHROMIUM, os.X_OK):
        print("first paint: skipped (no %s: run build/sysdeps.sh)" % CHROMIUM)
        return None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("first paint: skipped (playwright is not installed: the dev extra)")
        return None
    rows: List[Tuple[str, List[Dict[str, float]]]] = []
    with tempfile.TemporaryDirectory() as profile, sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                   args=CHROMIUM_FLAGS, viewport={"width": 1400, "height": 1000})
        page = ctx.new_page()
        for tr in (small, big):
            page.goto(tr.url + "/login")
            page.fill("#token", tr.token)
            page.click("#login")
            page.wait_for_url(tr.url + "/")  # a cookie per tracker: browsers share cookies across ports
        for label, tr, path, mark, api in (
                ("baseline: run list, 1 run", small, "/", "list", "/api/v1/overview"),
                ("run list, %d runs" % (RUNS + 1), big, "/", "list", "/api/v1/overview"),
                ("baseline: run page, 100 points", small, "/run/run-000", "run", "/series"),
                ("run page, %s points" % format(POINTS, ","), big, "/run/run-%03d" % (42 % RUNS), "run",
                 "/series"),
                ("run page, + %s trainer points" % format(POINTS * TRAINER_PER_BEAT, ","), big, "/run/" + TRAINER_RUN,
                 "run", "/series")):
            _paint(page, tr.url + path, mark, api)  # warm: the static files cached, the run's pages read once
            rows.append((label, [_paint(page, tr.url + path, mark, api) for _ in range(rounds)]))
        ctx.close()
    print("first paint in chromium (ms from navigation start; median of %d loads, max in brackets):" % rounds)
    print("  %-34s %14s %16s %16s %10s" % ("", "first paint", "data painted", "data request", "data KB"))
    def col(ms: List[Dict[str, float]], key: str) -> str:
        xs = [m[key] for m in ms]
        return "%7.0f (%4.0f)" % (statistics.median(xs), max(xs))

    for label, ms in rows:
        print("  %-34s %14s %16s %16s %10.0f" % (label, col(ms, "fcp"), col(ms, "painted"), col(ms, "data"),
                                                 ms[0]["bytes"] / 1024))
    list_ms = statistics.median(m["painted"] for m in rows[1][1])
    run_ms = statistics.median(m["painted"] for m in rows[3][1])
    ok = list_ms <= TARGET_LIST_MS and run_ms <= TARGET_RUN_MS
    print("  target: data painted <= %d ms (list) and <= %d ms (run page): %s"
          % (TARGET_LIST_MS, TARGET_RUN_MS, "MET" if ok else "MISSED"))
    return ok


# -- 2. latency under load ---------------------------------------------------------------------------------------
async def _request(reader: Any, writer: Any, method: str, path: str, auth: str, body: bytes = b"") -> Tuple[int, bytes]:
    port = writer.get_extra_info("peername")[1]
    head = ("%s %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n%s\r\nContent-Type: application/json\r\n"
            "Content-Length: %d\r\n\r\n" % (method, path, port, auth, len(body))).encode()
    writer.write(head + body)
    status = await reader.readline()
    length = 0
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    data = await reader.readexactly(length)
    return int(status.split()[1]), data


async def _box(port: int, token: str, i: int, stop: float, seq: int, lat: List[float], errors: List[str]) -> None:
    tmpl = _template()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    loop = asyncio.get_running_loop()
    period = BOXES / RATE
    next_at = loop.time() + period * i / BOXES
    try:
        while time.monotonic() < stop:
            delay = next_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            next_at += period
            seq += 1
            beat = dict(tmpl, run="run-%03d" % (i % RUNS), box="box-%03db" % (i % RUNS), seq=seq, attempt=2,
                        time=time.time(), progress={"step": seq, "loss": 1.0, "lr": 3e-4, "tokens_per_s": 50000.0})
            t0 = time.perf_counter()
            status, _ = await _request(reader, writer, "POST", "/api/v1/heartbeats", "Authorization: Bearer " + token,
                                       json.dumps({"heartbeats": [beat]}).encode())
            lat.append(time.perf_counter() - t0)
            if status != 200:
                errors.append("beat: HTTP %d" % status)
                return
    finally:
        writer.close()


async def _page(port: int, cookie: str, kind: str, i: int, stop: float, lat: Dict[str, List[float]],
                errors: List[str]) -> None:
    """One open page, as dashboard.js polls: opened (everything; the pages open one after another over the first
    half of the phase), then every POLL_S only what is new."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    auth = "Cookie: onbox_session_%d=%s" % (port, cookie)
    await asyncio.sleep((stop - time.monotonic()) / 2 * i / PAGES)
    cursor, points_cursor = -1, -1
    try:
        while time.monotonic() < stop:
            if kind == "list":
                path = "/api/v1/overview?after=%d" % cursor
            else:  # as dashboard.js asks: the beats and the trainer's points, each after its cursor
                path = "/api/v1/runs/run-%03d/series?after=%d&limit=20000&points_after=%d&points_limit=100000" % (
                    i * 7 % RUNS, cursor, points_cursor)
            t0 = time.perf_counter()
            status, body = await _request(reader, writer, "GET", path, auth)
            lat[("%s open" if cursor == -1 else "%s poll") % kind].append(time.perf_counter() - t0)
            if status != 200:
                errors.append("%s: HTTP %d" % (kind, status))
                return
            doc = json.loads(body)
            cursor = doc["cursor"] if kind == "list" else doc["next_after"]
            points_cursor = doc["trainer"]["next_after"] if kind == "run" else -1
            await asyncio.sleep(POLL_S)
    finally:
        writer.close()


def _load(port: int, token: str, cookie: Optional[str], seq: int,
          seconds: float = SECONDS) -> Tuple[List[float], Dict[str, List[float]], List[str]]:
    beats: List[float] = []
    pages: Dict[str, List[float]] = {k: [] for k in ("list open", "list poll", "run open", "run poll")}
    errors: List[str] = []

    async def main() -> None:
        stop = time.monotonic() + seconds
        jobs = [_box(port, token, i, stop, seq, beats, errors) for i in range(BOXES)]
        if cookie:
            jobs += [_page(port, cookie, kind, i, stop, pages, errors) for kind in ("list", "run") for i in range(PAGES)]
        await asyncio.gather(*jobs)

    try:
        import uvloop
        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
    return beats, pages, errors


def _pct(xs: List[float], q: float) -> float:
    xs = sorted(xs)
    return 1000.0 * xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def bench_load(tr: Any) -> bool:
    import psutil
    import requests

    s = requests.Session()
    s.post(tr.url + "/login", data={"token": tr.token}, allow_redirects=False, timeout=30)
    cookie = s.cookies.get("onbox_session_%d" % tr.port)
    server = psutil.Process(tr.proc.pid)
    results = []
    _load(tr.port, tr.token, None, POINTS + 10**6 // 2, seconds=2.0)  # warm up: 100 connections, first requests
    for phase, (label, with_pages) in enumerate((("baseline: beats alone", False),
                                                 ("beats with 20 pages polling", True))):
        cpu0, t0 = sum(server.cpu_times()[:2]), time.monotonic()
        # seqs above every stored one: each beat is a new head of its run, as from a live box
        beats, pages, errors = _load(tr.port, tr.token, cookie if with_pages else None, POINTS + (phase + 1) * 10**6)
        cpu = (sum(server.cpu_times()[:2]) - cpu0) / (time.monotonic() - t0) * 100
        results.append((label, beats, pages, errors, cpu, sum(server.cpu_times()[:2]) - cpu0))
    print("tracker latency, %d boxes pushing %d beats/s (open loop), a database of %d runs x %s beats; %.0f s each"
          " (load average %.1f on %d CPUs: load generator, tracker and everything else share them):"
          % (BOXES, RATE, RUNS, format(POINTS, ","), SECONDS, os.getloadavg()[0], os.cpu_count() or 0))
    print("  %-52s %8s %9s %9s %9s" % ("", "requests", "p50 ms", "p99 ms", "max ms"))
    for label, beats, pages, errors, cpu, _ in results:
        print("  %-52s %8d %9.1f %9.1f %9.1f" % ("%s: POST heartbeats" % label, len(beats), _pct(beats, .5),
                                                 _pct(beats, .99), _pct(beats, 1.0)))
        for kind, xs in pages.items():
            if xs:
                what = {"list open": "run list opened (full overview)", "list poll": "run list poll (after=cursor)",
                        "run open": "run page opened (%s points)" % format(POINTS, ","),
                        "run poll": "run page poll (after=seq)"}[kind]
                print("  %-52s %8d %9.1f %9.1f %9.1f" % ("  " + what, len(xs), _pct(xs, .5), _pct(xs, .99),
                                                         _pct(xs, 1.0)))
        print("  %-52s tracker CPU %.0f %%%s" % ("", cpu, ("; errors: %s" % errors[:3]) if errors else ""))
    base, loaded = results
    print("  tracker CPU per beat (baseline phase): %.2f ms" % (base[5] / max(1, len(base[1])) * 1000))
    polls = loaded[2]["list poll"] + loaded[2]["run poll"]
    ok = (not any(r[3] for r in results) and _pct(loaded[1], .99) <= TARGET_P99_MS
          and _pct(polls, .99) <= TARGET_P99_MS)
    print("  target: p99 <= %d ms for the beats and for the pages' polls while pages are open: %s"
          % (TARGET_P99_MS, "MET" if ok else "MISSED"))
    return ok


def bench_cost(tr: Any, rounds: int = 20) -> None:
    """The tracker's CPU per page request, one request at a time (nothing else asks it anything meanwhile): the
    figure that does not depend on what else the machine runs. psutil reads the tracker's CPU time around each
    request; the beats that make a poll's news are sent before it and not counted."""
    import psutil
    import requests

    tmpl = _template()
    h = tr.headers()
    server = psutil.Process(tr.proc.pid)
    seq = [POINTS + 5 * 10**6]

    def beat_all() -> None:  # one new beat for every run, in one request
        seq[0] += 1
        beats = [dict(tmpl, run="run-%03d" % r, box="box-%03db" % r, seq=seq[0], attempt=2, time=time.time(),
                      progress={"step": seq[0], "loss": 1.0}) for r in range(RUNS)]
        requests.post(tr.url + "/api/v1/heartbeats", json={"heartbeats": beats}, headers=h, timeout=60)

    def cost(path: Any, before: Any = None, n: int = rounds, start: Any = None) -> Tuple[float, Any]:
        spent, doc = 0.0, start
        for i in range(n):
            if before:
                before(doc)
            c0 = sum(server.cpu_times()[:2])
            r = requests.get(tr.url + path(i, doc), headers=h, timeout=60)
            spent += sum(server.cpu_times()[:2]) - c0
            doc = r.json()
        return spent / n * 1000, doc

    rows = []
    ms, doc = cost(lambda i, d: "/api/v1/overview")
    rows.append(("run list opened (%d runs)" % (RUNS + 1), ms))
    ms, doc = cost(lambda i, d: "/api/v1/overview?after=%d" % d["cursor"], before=lambda d: beat_all(), start=doc)
    rows.append(("run list poll, every run has a new beat", ms))
    ms, _ = cost(lambda i, d: "/api/v1/overview?after=%d" % d["cursor"], start=doc)
    rows.append(("run list poll, nothing new", ms))
    ms, _ = cost(lambda i, d: "/api/v1/runs/run-%03d/series?limit=20000" % (i % RUNS), n=10)
    rows.append(("run page opened (%s points), as before" % format(POINTS, ","), ms))
    ms, _ = cost(lambda i, d: "/api/v1/runs/run-%03d/series?limit=20000&points_after=-1" % (i % RUNS), n=10)
    rows.append(("  the same, asking for trainer points (none)", ms))
    ms, _ = cost(lambda i, d: "/api/v1/runs/%s/series?limit=20000&points_after=-1" % TRAINER_RUN, n=10)
    rows.append(("  with %s trainer points" % format(POINTS * TRAINER_PER_BEAT, ","), ms))
    ms, _ = cost(lambda i, d: "/api/v1/runs/run-001/series?after=%d" % d["next_after"], before=lambda d: beat_all(),
                 start=requests.get(tr.url + "/api/v1/runs/run-001/series?limit=20000", headers=h, timeout=60).json())
    rows.append(("run page poll, one new point", ms))
    print("tracker CPU per page request (the mean over %d requests sent one at a time, nothing else asking; "
          "psutil's clock ticks are 10 ms):" % rounds)
    for label, ms in rows:
        print("  %-52s %7.1f ms" % (label, ms))


def main() -> int:
    from tests.hosts.tracker import TrackerProcess

    with tempfile.TemporaryDirectory() as tmp:
        big = TrackerProcess(os.path.join(tmp, "big"), extra_args=["--pulls-record", os.path.join(tmp, "pulls.json")])
        small = TrackerProcess(os.path.join(tmp, "small"))
        seconds = populate(big.db, RUNS, POINTS, trainer_run=True)
        populate(small.db, 1, 100)
        print("database: %d runs x %s beats, and %s with %s trainer points (%.0f MB), written through the tracker's "
              "store in %.0f s" % (RUNS, format(POINTS, ","), TRAINER_RUN, format(POINTS * TRAINER_PER_BEAT, ","),
                                   os.path.getsize(big.db) / 1e6, seconds))
        big.start(timeout=120)
        small.start()
        try:
            paint = bench_paint(big, small)
            bench_cost(big)
            os.nice(10)  # the load generator below the tracker (the 100 boxes are remote in real life)
            load = bench_load(big)
        finally:
            big.stop()
            small.stop()
    return 0 if load and paint is not False else 1


if __name__ == "__main__":
    sys.exit(main())
