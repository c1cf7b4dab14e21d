"""Reading the tracker's run list (`GET /api/v1/runs`): what `onboxctl status` and the keeper read, through
controller/tracker/runview.py.

Whatever answers at the tracker's URL (a proxy, a broken or hostile tracker, an older tracker that stored a beat
nested ~980 deep) is outside input. The answer is read no further than RUNS_MAX_BYTES and parsed with room
(ENVELOPE_ROOM levels: as deep as JSON parses here), then each run's entry is checked on its own against the bound
the tracker keeps for the beats it takes (onbox.untrusted.MAX_DEPTH): one bad run is skipped or shown without its
newest beat, and said so (SkippedRun); it never hides the others. What cannot be read at all (no answer, an HTTP
error, not JSON, no run list) is a TrackerView with `problem` set: the caller can tell "the tracker answered, here
are the runs" from "the tracker could not be read, and why".
"""
from __future__ import annotations

import dataclasses
import http.client
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Dict, List, Optional, Tuple

from onbox import untrusted
from onbox.errors import OnboxError, UnfitError, UsageError
from onbox.heartbeat.schema import RUN_RE
from onbox.untrusted import MAX_DEPTH, depth, printable

RUNS_MAX_BYTES = 64 * 1024 * 1024  # the tracker's run list: thousands of runs with their latest beat each
ENVELOPE_ROOM = 1024  # levels the whole answer may nest: more than json.loads parses here, so no run can sink it
HINT = "is %s an onbox tracker? `onboxctl tracker serve` answers it"


@dataclasses.dataclass(frozen=True)
class SkippedRun:
    """One run (or entry) of the tracker's answer that a reader could not take whole."""

    run: str  # the run's name; `runs[3]` when the entry names no run
    problem: str  # one line, control characters shown as escapes
    shown: bool  # True: the run is listed, without its newest beat; False: the entry is left out

    def describe(self) -> str:
        """`run 'x': its newest beat nests more than 64 levels deep (listed without it)`."""
        who = "run '%s'" % self.run if RUN_RE.fullmatch(self.run) else self.run
        return "%s: %s (%s)" % (who, self.problem, "listed without it" if self.shown else "left out")

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class TrackerView:
    """What one read of a tracker's run list gave. `problem` None: the tracker answered; `runs` are its entries
    that passed their check (each a dict: run, box, state, liveness, age_s, latest (the newest beat, or None) ...),
    `skipped` what was left out or cut. `problem` set: the tracker could not be read (its message says why: no
    answer, a refused token, an HTTP error, not a run list), and `runs` is empty."""

    url: str
    runs: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    skipped: List[SkippedRun] = dataclasses.field(default_factory=list)
    problem: Optional[OnboxError] = None
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)  # the answer's other keys (skipped_rows)

    @property
    def answered(self) -> bool:
        return self.problem is None

    def document(self) -> Dict[str, Any]:
        """The answer as `GET /api/v1/runs` gives it, with only the entries that passed; the entries left out are
        counted in its `skipped_rows` with the tracker's own (a caller that finds a run missing can tell "not
        listed" from "listed, but unreadable")."""
        doc = dict(self.extra, runs=list(self.runs))
        left_out = sum(1 for s in self.skipped if not s.shown)
        if left_out:
            own = doc.get("skipped_rows")
            doc["skipped_rows"] = left_out + (own if isinstance(own, int) and not isinstance(own, bool) and own > 0
                                              else 0)
        return doc


def read_tracker(url: str, token: Optional[str], timeout: float = 10.0, limit: int = RUNS_MAX_BYTES) -> TrackerView:
    """One read of the tracker's run list. Never raises for anything the tracker (or whatever answers at `url`)
    does: a TrackerView whose `problem` (an OnboxError: UsageError when the token was refused, UnfitError
    otherwise) says why it could not be read, or whose `runs` and `skipped` say what it answered. A caller that
    decides from beats treats a problem as "cannot tell now", never as "the beats stopped"."""
    try:
        body = _get(url, token, timeout, limit)
    except OnboxError as e:
        return TrackerView(url, problem=e)
    return view_of_answer(url, body)


def view_of_answer(url: str, body: bytes) -> TrackerView:
    """The TrackerView of the body `GET /api/v1/runs` answered at `url`: parsed with ENVELOPE_ROOM levels of room,
    then each run checked on its own (check_runs)."""
    try:
        doc = untrusted.loads_json(body, "its run list", bound=ENVELOPE_ROOM)
    except untrusted.UntrustedInput:  # past the room: deeper than any beat's bound too
        return TrackerView(url, problem=_unreadable(url, "it nests more than %d levels deep" % MAX_DEPTH))
    except ValueError as e:  # not JSON, not UTF-8
        return TrackerView(url, problem=_unreadable(url, untrusted.reason(e)))
    entries = doc.get("runs") if isinstance(doc, dict) else doc
    if not isinstance(entries, list):
        return TrackerView(url, problem=UnfitError("the tracker at %s answered no run list" % url, hint=HINT % url))
    runs, skipped = check_runs(entries)
    extra = {k: v for k, v in doc.items() if k != "runs" and depth(v, MAX_DEPTH) <= MAX_DEPTH} \
        if isinstance(doc, dict) else {}
    return TrackerView(url, runs, skipped, extra=extra)


def _unreadable(url: str, why: str) -> UnfitError:
    return UnfitError("the tracker at %s answered something unreadable: %s" % (url, why), hint=HINT % url)


def fetch_tracker_runs(url: str, token: Optional[str], timeout: float = 10.0, limit: int = RUNS_MAX_BYTES) -> Any:
    """`GET /api/v1/runs` as a document ({"runs": [...], ...}) holding only the runs that passed their check (see
    read_tracker); raises the OnboxError that read_tracker would put in `problem`."""
    view = read_tracker(url, token, timeout, limit)
    if view.problem is not None:
        raise view.problem
    return view.document()


def check_runs(entries: List[Any]) -> Tuple[List[Dict[str, Any]], List[SkippedRun]]:
    """Each entry of a run list checked on its own: (the entries to use, what was skipped or cut). An entry that is
    no object, names no run, or nests too deep outside its beat is left out; a run whose newest beat nests past
    MAX_DEPTH, is no object, or that the tracker marked (`problem`) is kept without that beat."""
    runs: List[Dict[str, Any]] = []
    skipped: List[SkippedRun] = []
    for i, e in enumerate(entries):
        where = "runs[%d]" % i
        if not isinstance(e, dict):
            skipped.append(SkippedRun(where, "not an object", False))
            continue
        name = e.get("run", e.get("name"))
        if not isinstance(name, str) or not RUN_RE.fullmatch(name):
            said = "'%s' is not a run name" % printable(name)[:130] if isinstance(name, str) else "names no run"
            skipped.append(SkippedRun(where, said, False))
            continue
        rest = {k: v for k, v in e.items() if k != "latest"}
        if depth(rest, MAX_DEPTH) > MAX_DEPTH:
            skipped.append(SkippedRun(name, "its entry nests more than %d levels deep" % MAX_DEPTH, False))
            continue
        latest, problem = e.get("latest"), None
        if isinstance(e.get("problem"), str):  # the tracker's own word: it could not read the run's newest beat
            problem = printable(e["problem"])[:300]
        elif latest is not None and not isinstance(latest, dict):
            problem = "its newest beat is not an object"
        elif latest is not None and depth(latest, MAX_DEPTH) > MAX_DEPTH:
            problem = "its newest beat nests more than %d levels deep" % MAX_DEPTH
        if problem is not None:
            e = dict(e, latest=None)
            skipped.append(SkippedRun(name, problem, True))
        runs.append(e)
    return runs, skipped


def _get(url: str, token: Optional[str], timeout: float, limit: int) -> bytes:
    """The run list's body, at most `limit` bytes; an OnboxError when it cannot be had (never onboxctl's memory or
    a traceback)."""
    return tracker_get(url, "/api/v1/runs", token, timeout, limit, "its run list",
                       unreachable="is `onboxctl tracker serve` running? Without --tracker, status asks each box "
                                   "over ssh", too_big_hint=HINT % url)


def tracker_get(url: str, path: str, token: Optional[str], timeout: float, limit: int, what: str,
                unreachable: str, older: Optional[Tuple[str, str]] = None, too_big_hint: Optional[str] = None
                ) -> bytes:
    """GET `path` of the tracker at `url` with the token (when there is one): the body, at most `limit` bytes. An
    OnboxError otherwise: UsageError for a token refused or none sent (the same words for every reader), UnfitError
    for the rest; `older` (what the tracker lacks, who needs it): a 404/405 means a tracker older than that reader;
    `unreachable` is the hint when nothing answers."""
    req = urllib.request.Request(url.rstrip("/") + path, headers={"Accept": "application/json"})
    if token:
        req.add_header("Authorization", "Bearer " + token)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read(limit + 1)
    except urllib.error.HTTPError as e:
        if e.code in (401, 403) and not token:
            raise UsageError("tracker %s asks for a token and none was sent (HTTP %d)" % (url, e.code),
                             hint="give the tracker's token: --tracker-token-file FILE, ONBOX_TRACKER_TOKEN, or "
                                  "tracker_token_file in config.toml (the file given to `onboxctl tracker serve --token-file`)")
        if e.code in (401, 403):
            raise UsageError("tracker %s refused the token (HTTP %d)" % (url, e.code),
                             hint="set ONBOX_TRACKER_TOKEN or --tracker-token-file to the tracker's token")
        if e.code in (404, 405) and older:
            raise UnfitError("tracker %s has no %s (HTTP %d): it is older than %s" % (url, older[0], e.code, older[1]),
                             hint="restart it with this onboxctl: `onboxctl tracker serve`")
        raise UnfitError("tracker %s answered HTTP %d%s" % (url, e.code, _error_of(e)))
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:  # not HTTP, cut short
        raise UnfitError("cannot read the tracker at %s: %s" % (url, getattr(e, "reason", e)), hint=unreachable)
    if len(body) > limit:
        raise UnfitError("the tracker at %s answered more than %s for %s: refusing it" % (
            url, untrusted.human(limit), what), hint=too_big_hint)
    return body


GOODPUT_MAX_BYTES = 64 * 1024 * 1024


def fetch_ledgers(url: str, token: Optional[str], since: Optional[float], run: Optional[str],
                  timeout: float = 60.0) -> Dict[str, Any]:
    """The tracker's `GET /api/v1/goodput` answer (`onboxctl report`); an OnboxError (UsageError for a refused
    token, UnfitError otherwise) when it cannot be had or read."""
    query = {k: v for k, v in (("since", "%.3f" % since if since is not None else None), ("run", run)) if v}
    body = tracker_get(url, "/api/v1/goodput" + ("?" + urllib.parse.urlencode(query) if query else ""), token,
                       timeout, GOODPUT_MAX_BYTES, "its goodput ledgers", older=("goodput ledgers", "`onboxctl report`"),
                       unreachable="is `onboxctl tracker serve` running? `onboxctl report` reads the ledgers it keeps")
    try:
        doc = untrusted.loads_json(body, "its goodput ledgers")
    except ValueError as e:
        raise UnfitError("the tracker at %s answered something unreadable: %s" % (url, untrusted.reason(e)))
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
        raise UnfitError("the tracker at %s answered no goodput ledgers" % url)
    return doc


def _error_of(e: urllib.error.HTTPError) -> str:
    """`: <its error>` from a tracker's JSON error body (the 421 of a Host it does not serve names the flag)."""
    try:
        doc = untrusted.loads_json(e.read(4096), "an error")
    except (ValueError, OSError, http.client.HTTPException):
        return ""
    said = doc.get("error") if isinstance(doc, dict) else None
    return ": %s" % printable(said)[:300] if isinstance(said, str) else ""
