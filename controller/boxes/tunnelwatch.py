"""The tunnel's supervisor: one background process per recorded tracker tunnel, so that a tunnel `onboxctl run`
opened stays up without the user.

    python -m controller.boxes.tunnelwatch BOX HOST:PORT     (started by controller.boxes.tunnel.start_supervisor)

The ssh master that carries the tunnel runs with ServerAliveInterval/CountMax, so a dead link ends it within
interval x count seconds. The supervisor checks every `poll` seconds, locally (`ssh -O check`: no network),
whether the master recorded for the tunnel is still the live one. When it is not, the tunnel is DOWN: it is
re-opened at once, then after 1, 2, 4 ... seconds, at most `backoff_max` apart, on the same box port (the agent's
URL does not change; open_tunnel pokes a port a dead session still holds). Each change is written to the
tunnel's record (state, since, reopens, last_error: `onboxctl tunnel BOX --json` and `onboxctl status` show them)
and one line to its log ($ONBOX_CONFIG_DIR/tunnels/BOX-PORT.log); a try that fails as the one before is not
logged again.

It ends, and says why in its log, when: the tunnel's record is gone (`onboxctl tunnel --close`, `onboxctl down`),
another supervisor holds the record, a SIGTERM/SIGINT/SIGHUP arrives, no run on the box has a live agent any
more (asked every `run_check` seconds while the tunnel is up: `onbox status --json`), or the tunnel has been down
for `give_up` seconds. It never stops a run, and never closes the tunnel itself.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, List, Optional

from controller.boxes.inventory import Inventory
from controller.boxes.ssh import Ssh, settings_from_env
from controller.boxes.tunnel import Records, Tunnel, TunnelClosed, WatchKnobs, open_tunnel
from onbox.errors import OnboxError
from onbox.proc import start_time


def stamp(t: Optional[float] = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if t is None else t))


class TunnelWatcher:
    def __init__(self, box: str, local: str, records: Optional[Records] = None, ssh: Optional[Ssh] = None,
                 knobs: Optional[WatchKnobs] = None) -> None:
        self.key = (box, local)
        self.box = box
        self.local = local
        self.records = records or Records()
        self.ssh = ssh or Ssh(settings_from_env())
        self.knobs = knobs or WatchKnobs.from_env()
        self.pid = os.getpid()
        self.stopping: Optional[str] = None

    def say(self, text: str) -> None:
        print("%s %s %s: %s" % (stamp(), self.box, self.local, text), flush=True)

    # -- the record -------------------------------------------------------------------------------------------
    def register(self) -> Optional[int]:
        """Take the record as its supervisor; another live supervisor's pid when it holds it (then nothing)."""
        with self.records.editing() as tunnels:
            t = next((x for x in tunnels if x.key == self.key), None)
            if t is None:
                raise TunnelClosed("no tunnel of %s to %s is recorded" % self.key)
            if t.supervised() and t.supervisor_pid != self.pid:
                return t.supervisor_pid
            t.supervisor_pid, t.supervisor_start = self.pid, start_time(self.pid)
        return None

    def mark(self, **fields: Any) -> None:
        """Write `fields` into the record, while it is this supervisor's."""
        try:
            t = self.records.get(self.key)
            if t is None or t.supervisor_pid != self.pid:
                return  # (and never re-create a config dir someone removed)
            with self.records.editing() as tunnels:
                for t in tunnels:
                    if t.key == self.key and t.supervisor_pid == self.pid:
                        for k, v in fields.items():
                            setattr(t, k, v)
        except OnboxError as e:  # a damaged record: the next look ends the supervision, saying why
            self.say("cannot write the tunnel record: %s" % e.message)

    def release(self) -> None:
        try:
            self.mark(supervisor_pid=None, supervisor_start=None)
        except OnboxError:
            pass

    def mine(self) -> Optional[Tunnel]:
        try:
            t = self.records.get(self.key)
        except OnboxError as e:
            self.stopping = "cannot read the tunnel record: %s" % e.message
            return None
        if t is None:
            self.stopping = "the tunnel was closed"
        elif t.supervisor_pid != self.pid:
            self.stopping = "another supervisor (pid %s) took the tunnel over" % t.supervisor_pid
            return None
        return t

    # -- the box ----------------------------------------------------------------------------------------------
    def runs_alive(self) -> Optional[bool]:
        """Whether a run on the box has a live agent: True, False, or None when the box did not say."""
        from controller.boxes.agent import ask

        try:
            doc, _res, _ = ask(self.ssh, Inventory().resolve(self.box), ["status", "--json"], timeout=30)
        except OnboxError:
            return None
        if not isinstance(doc, list):
            return None
        return any(isinstance(d, dict) and d.get("agent_alive") for d in doc)

    def reopen(self) -> Tunnel:
        host, _, port = self.local.rpartition(":")
        return open_tunnel(self.ssh, Inventory().resolve(self.box), "http://%s:%s" % (host, port), self.records,
                           reopen_only=True)

    # -- the loop ---------------------------------------------------------------------------------------------
    def run(self) -> str:
        """Supervise until one of the ends in the module doc; returns why it ended."""
        knobs = self.knobs
        first_backoff = min(1.0, knobs.backoff_max)
        backoff = first_backoff
        down_since: Optional[float] = None
        next_try = 0.0
        tries = 0
        last_error: Optional[str] = None
        last_run_check = time.monotonic()
        self.say("supervising (pid %d): checks every %gs, re-opens at most %gs apart" % (self.pid, knobs.poll,
                                                                                         knobs.backoff_max))
        while self.stopping is None:
            t = self.mine()
            if t is None:
                break
            try:
                pid = self.ssh.master_pid(Inventory().resolve(self.box).target())
            except OnboxError as e:  # the inventory turned unreadable: say so, and look again
                pid = None
                if e.message != last_error:
                    self.say("cannot check the tunnel: %s" % e.message)
                    last_error = e.message
            up = pid is not None and pid == t.master_pid
            if up:
                if down_since is not None:  # someone re-opened it meanwhile (`onboxctl tunnel BOX`)
                    self.say("up again: re-opened elsewhere after %.0f s down" % (time.time() - down_since))
                    down_since, backoff, tries, last_error = None, first_backoff, 0, None
                if time.monotonic() - last_run_check >= knobs.run_check:
                    last_run_check = time.monotonic()
                    if self.runs_alive() is False:
                        self.stopping = "no run on %s has a live agent any more: nothing needs the tunnel" % self.box
                        break
                self._sleep(knobs.poll)
                continue
            now = time.time()
            if down_since is None:
                down_since = t.since if t.state == "down" and t.since else now
                why = ("its ssh master is gone (the link died, or the master was closed)" if pid is None else
                       "another ssh master (pid %d) holds the connection to the box, without the tunnel" % pid)
                self.say("down: %s" % why)
                self.mark(state="down", since=down_since, last_error=why)
                next_try, tries = time.monotonic(), 0
            if now - down_since > knobs.give_up:
                self.stopping = "down for %.0f s, more than ONBOX_TUNNEL_GIVE_UP: the box is taken for gone" % (
                    now - down_since)
                break
            if time.monotonic() >= next_try:
                tries += 1
                try:
                    got = self.reopen()
                except TunnelClosed:
                    self.stopping = "the tunnel was closed"
                    break
                except OnboxError as e:
                    if e.message != last_error:
                        self.say("re-open failed (try %d): %s; trying again, at most %gs apart" % (
                            tries, e.message, knobs.backoff_max))
                        last_error = e.message
                        self.mark(last_error=e.message)
                    next_try = time.monotonic() + backoff
                    backoff = min(backoff * 2, knobs.backoff_max)
                else:
                    self.say("reopened on box port %d after %.0f s down (try %d, re-open no. %d)" % (
                        got.remote_port, time.time() - down_since, tries, got.reopens))
                    down_since, backoff, tries, last_error = None, first_backoff, 0, None
                    continue
            self._sleep(min(knobs.poll, max(0.05, next_try - time.monotonic())))
        return self.stopping or "stopped"

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.stopping is None and time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def main(argv: Optional[List[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m controller.boxes.tunnelwatch BOX HOST:PORT", file=sys.stderr)
        return 2
    # The process that started us waits for this one only: the supervisor is its child, so that a launcher that
    # lives on (`onboxctl keep`) is never left with a zombie to reap.
    if os.fork():
        os._exit(0)
    try:
        sup = TunnelWatcher(args[0], args[1])
        other = sup.register()
    except OnboxError as e:
        print("not supervising %s %s: %s" % (args[0], args[1], e.message), flush=True)
        return 1
    print("already %d" % other if other else "watching %d" % sup.pid, flush=True)
    os.dup2(2, 1)  # from here on everything goes to the log (stderr): the starter's pipe closes, and it returns
    if other:
        return 0

    def stop(signum: int, _frame: Any) -> None:
        sup.stopping = "stopped by %s" % signal.Signals(signum).name

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    why = "stopped"
    try:
        why = sup.run()
    finally:
        sup.release()
        sup.say("supervision ends: %s" % why)
    return 0


if __name__ == "__main__":
    sys.exit(main())
