"""The boxes' and the tracker's answers as the keeper reads them: `onbox status RUN --json` into an Observation, the
tracker's run list into each run's Beats, and whether a tracker's answer can be used at all. Every field is read
typed, anything else is a `problem` (the threat model in README.md: "The boxes' answers", "The tracker's beats")."""
from __future__ import annotations

import functools
import os
import socket
from typing import Any, Dict, Optional
from urllib.parse import urlsplit

from controller.keeper.decide import LIVENESS, UNREADABLE, Beats, Observation
from onbox import untrusted, vocab

STATUS_SCHEMA = vocab.SCHEMA_STATUS


def observation_from_status(box: str, run: str, doc: Any, rc: int, said: str) -> Observation:
    """An Observation from `onbox status RUN --json`'s document (or its refusal): see decide.Observation."""
    if rc == 2 and "no run named" in said:
        return Observation(box, run, reached=True, known=False)
    if "onbox.pyz" in said and ("can't open file" in said or "No such file" in said):
        return Observation(box, run, reached=True, known=False)  # the box was reset: no agent at all
    if not isinstance(doc, dict) or doc.get("schema") != STATUS_SCHEMA:
        line = said.strip().splitlines()[-1][:300] if said.strip() else "exit %d, no status document" % rc
        return Observation(box, run, reached=True, known=True,
                           problem="its agent did not say: %s" % untrusted.printable(line))
    if doc.get("state") == "corrupt":
        return Observation(box, run, reached=True, known=True,
                           problem=untrusted.printable(doc.get("corrupt") or "state corrupt")[:300])
    last_exit = _obj(doc.get("last_exit"))
    progress = _obj(doc.get("progress"))
    ckpt = _obj(doc.get("checkpoint"))
    durable = _obj(ckpt.get("latest_durable"))
    attempts = doc.get("attempts") if isinstance(doc.get("attempts"), list) else []
    started = attempts[-1].get("started_at") if attempts and isinstance(attempts[-1], dict) else None
    state = doc.get("state") if isinstance(doc.get("state"), str) else None
    lease = _obj(doc.get("lease"))
    resumed = None
    for name in (lease.get("resumed_from"), doc.get("resume_from")):  # the lease's checkpoint, else the local path
        if resumed is None and isinstance(name, str) and name:
            from onbox.checkpoints.local.detect import step_from_name

            resumed = step_from_name(os.path.basename(name))
    return Observation(
        box, run, reached=True, known=True, state=state, agent_alive=doc.get("agent_alive") is True,
        fenced=state == vocab.FENCED or last_exit.get("classification") == vocab.EXIT_FENCED,
        step=_int(progress.get("step")), step_time=_num(progress.get("time")), attempt_started=_num(started),
        durable_step=_int(durable.get("step")), durable_at=_num(durable.get("committed_at")),
        lease=lease or None, resumed_step=resumed)


def beats_from_tracker(doc: Any) -> Dict[str, Beats]:
    """Each run's Beats from `GET /api/v1/runs`. A run listed with a liveness the keeper does not know (or none,
    or twice) is `unreadable`: a tracker's garbage must never read as late beats."""
    out: Dict[str, Beats] = {}
    entries = doc.get("runs") if isinstance(doc, dict) else None
    seen: Dict[str, int] = {}
    for e in entries if isinstance(entries, list) else []:
        if not isinstance(e, dict) or not isinstance(e.get("run"), str):
            continue
        run = e["run"]
        seen[run] = seen.get(run, 0) + 1
        liveness = e.get("liveness")
        if seen[run] > 1 or liveness not in LIVENESS:
            why = ("it lists run %s more than once" % run if seen[run] > 1 else
                   "its liveness %s for run %s is not one the keeper knows (%s)" % (
                       untrusted.printable(repr(liveness)[:40]), run, ", ".join(LIVENESS)))
            out[run] = Beats(liveness=UNREADABLE, problem=why)
            continue
        latest = _obj(e.get("latest"))
        progress = _obj(latest.get("progress"))
        ckpt = _obj(latest.get("checkpoint"))
        durable = _obj(ckpt.get("latest_durable"))
        age, interval = _num(e.get("age_s")), _num(latest.get("interval_s"))
        out[run] = Beats(liveness=liveness, state=_str(e.get("state")), step=_int(progress.get("step")),
                         durable_step=_int(durable.get("step")), durable_at=_num(durable.get("committed_at")),
                         box=_str(e.get("box")), age=age if age is not None and age >= 0 else None,
                         interval=interval if interval is not None and interval > 0 else None)
    return out


@functools.lru_cache(maxsize=64)
def on_this_machine(url: str) -> bool:
    """Whether the tracker at `url` runs on this machine (loopback, or an address of one of its interfaces: this
    machine can bind it, whatever its links do). Such a tracker answering says nothing of the keeper's network. A
    name that does not resolve counts as here: it proves nothing either (asked once per URL: a name is resolved
    while the network works, at the keeper's first read)."""
    host = urlsplit(url).hostname or ""
    try:
        addrs = {str(a[4][0]) for a in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return True
    for addr in addrs:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr, 0))
            return True
        except OSError:
            continue
    return False


def tracker_problem(doc: Any) -> Optional[str]:
    """Why a run the tracker's answer does not list may still be one it has beats of (None: the answer is a whole
    run list, and a run missing from it has none): not a run list at all (an error marker, a proxy's page), entries
    the keeper cannot read, or rows the tracker itself skipped (`skipped_rows`)."""
    entries = doc.get("runs") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        return "its answer is not a run list ({\"runs\": [...]})"
    bad = sum(1 for e in entries if not isinstance(e, dict) or not isinstance(e.get("run"), str))
    skipped = doc.get("skipped_rows", 0) if isinstance(doc, dict) else 0
    if skipped is not None and not (isinstance(skipped, int) and not isinstance(skipped, bool) and skipped >= 0):
        return "its skipped_rows %s is no count of the runs it could not read" % untrusted.printable(
            repr(skipped)[:40])
    if bad or skipped:
        return "it could not read %d of its runs" % (bad + (skipped or 0))
    return None


def _obj(v: Any) -> Dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _int(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _str(v: Any) -> Optional[str]:
    return v if isinstance(v, str) else None
