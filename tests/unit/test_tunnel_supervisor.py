"""The tunnel's supervisor (controller/boxes/tunnelwatch.py) without a network: its loop against a scripted master and a
scripted re-open (backoff capped, one log line per change, every way it ends), its knobs, the record's new fields,
and what `onboxctl tunnel --keep` says of two looks at a tunnel."""
from __future__ import annotations

import json
import os
import time
from typing import List, Optional

import pytest

import controller.boxes.tunnelwatch as tw
from controller.boxes.tunnel import Records, Tunnel, TunnelClosed, WatchKnobs
from controller.commands.tunnel import _change, _line
from onbox.errors import UnfitError, UsageError


class FakeSsh:
    """master_pid() answers from a script (its last answer repeats)."""

    def __init__(self, pids: List[Optional[int]]) -> None:
        self.pids = list(pids)

    def master_pid(self, target) -> Optional[int]:
        return self.pids.pop(0) if len(self.pids) > 1 else self.pids[0]


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.setenv("ONBOX_CONFIG_DIR", str(tmp_path))
    (tmp_path / "boxes.toml").write_text('[boxes.b1]\nhost = "10.0.0.5"\nuser = "root"\n')
    records = Records(str(tmp_path))
    with records.editing() as tunnels:
        tunnels.append(Tunnel(box="b1", local="127.0.0.1:8787", remote_port=40000, spec_port=40000, master_pid=111,
                              state="up", since=time.time()))
    return records


def supervisor(records, ssh, **knobs):
    sup = tw.TunnelWatcher("b1", "127.0.0.1:8787", records=records, ssh=ssh,
                        knobs=WatchKnobs(**dict(dict(poll=0.01, backoff_max=0.08, run_check=3600, give_up=60),
                                                **knobs)))
    assert sup.register() is None
    return sup


def test_it_reopens_after_a_drop_with_a_capped_backoff_and_logs_each_change_once(cfg, monkeypatch, capsys):
    tries: List[float] = []
    ssh = FakeSsh([111, None])  # the recorded master, then none: the link died
    sup = supervisor(cfg, ssh)

    def reopen(ssh_, box, url, records, reopen_only):
        assert reopen_only and url == "http://127.0.0.1:8787" and box.name == "b1"
        tries.append(time.monotonic())
        if len(tries) < 6:
            raise UnfitError("cannot reach box b1 (root@10.0.0.5): no route to it")
        with records.editing() as tunnels:
            tunnels[0].master_pid, tunnels[0].state, tunnels[0].since, tunnels[0].reopens = 222, "up", time.time(), 1
            got = tunnels[0]
        ssh.pids[:] = [222]
        sup.stopping = "test done"
        return got

    monkeypatch.setattr(tw, "open_tunnel", reopen)
    assert sup.run() == "test done"
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert len(tries) == 6 and all(0.07 <= g < 0.08 + 0.2 for g in gaps), gaps  # the cap, never more (+ a poll)
    said = [ln.split(": ", 1)[1] for ln in capsys.readouterr().out.splitlines()]
    assert said[0].startswith("supervising (pid %d)" % os.getpid())
    assert said[1] == "down: its ssh master is gone (the link died, or the master was closed)"
    assert [x for x in said if x.startswith("re-open failed")] == [
        "re-open failed (try 1): cannot reach box b1 (root@10.0.0.5): no route to it; trying again, at most 0.08s "
        "apart"]  # the same failure five times: said once
    assert said[-1].startswith("reopened on box port 40000 after ") and "(try 6, re-open no. 1)" in said[-1]
    rec = cfg.get(("b1", "127.0.0.1:8787"))
    assert rec.state == "up" and rec.supervisor_pid == os.getpid()


def test_it_gives_up_after_give_up_seconds_down(cfg, monkeypatch):
    monkeypatch.setattr(tw, "open_tunnel", lambda *a, **k: (_ for _ in ()).throw(UnfitError("no route")))
    sup = supervisor(cfg, FakeSsh([None]), give_up=1.0)
    t0 = time.monotonic()
    why = sup.run()
    assert "down for" in why and "ONBOX_TUNNEL_GIVE_UP" in why and time.monotonic() - t0 < 5
    sup.release()
    rec = cfg.get(("b1", "127.0.0.1:8787"))
    assert rec.state == "down" and rec.last_error == "no route" and rec.supervisor_pid is None


def test_it_ends_when_the_tunnel_is_closed_or_taken_over_or_no_run_needs_it(cfg, monkeypatch):
    def closed(*a, **k):
        raise TunnelClosed("closed")

    monkeypatch.setattr(tw, "open_tunnel", closed)
    assert supervisor(cfg, FakeSsh([None])).run() == "the tunnel was closed"

    sup = supervisor(cfg, FakeSsh([111]), run_check=1.0)
    monkeypatch.setattr(sup, "runs_alive", lambda: False)
    assert sup.run() == "no run on b1 has a live agent any more: nothing needs the tunnel"

    sup = supervisor(cfg, FakeSsh([111]))
    with cfg.editing() as tunnels:
        tunnels[0].supervisor_pid = 1  # another supervisor took it
    assert sup.run().startswith("another supervisor (pid 1) took the tunnel over")

    sup = supervisor(cfg, FakeSsh([111]))
    with open(cfg.path, "w") as f:
        f.write("{damaged")
    assert sup.run().startswith("cannot read the tunnel record: tunnel record %s is damaged" % cfg.path)
    sup.release()

    os.unlink(cfg.path)
    sup.stopping = None
    assert sup.run() == "the tunnel was closed"
    sup.release()
    assert not os.path.exists(os.path.join(os.path.dirname(cfg.path), "tunnels"))  # it never made a dir for nothing


def test_a_recorded_supervisor_counts_only_while_that_very_process_lives(cfg):
    first = supervisor(cfg, FakeSsh([111]))
    assert first.register() is None  # itself: fine
    assert cfg.get(("b1", "127.0.0.1:8787")).supervised()
    with cfg.editing() as tunnels:
        tunnels[0].supervisor_pid = 1  # pid 1 lives, but started at another time: a recycled pid, no supervisor
    assert not cfg.get(("b1", "127.0.0.1:8787")).supervised()
    again = tw.TunnelWatcher("b1", "127.0.0.1:8787", records=cfg, ssh=FakeSsh([111]), knobs=WatchKnobs())
    assert again.register() is None and cfg.get(("b1", "127.0.0.1:8787")).supervised()


def test_knobs_are_read_and_checked():
    k = WatchKnobs.from_env({"ONBOX_TUNNEL_POLL": "0.5", "ONBOX_TUNNEL_BACKOFF_MAX": "10", "ONBOX_TUNNEL_WATCH": "0"})
    assert (k.poll, k.backoff_max, k.enabled, k.run_check, k.give_up) == (0.5, 10.0, False, 60.0, 86400.0)
    assert WatchKnobs.from_env({}).enabled
    for bad in ({"ONBOX_TUNNEL_POLL": "nan"}, {"ONBOX_TUNNEL_POLL": "0"}, {"ONBOX_TUNNEL_BACKOFF_MAX": "inf"},
                {"ONBOX_TUNNEL_GIVE_UP": "-1"}, {"ONBOX_TUNNEL_RUN_CHECK": "soon"}, {"ONBOX_TUNNEL_WATCH": "maybe"}):
        with pytest.raises(UsageError, match="ONBOX_TUNNEL_"):
            WatchKnobs.from_env(bad)


def test_records_without_the_new_fields_still_load(tmp_path):
    """A tunnels.json written before the supervisor existed."""
    (tmp_path / "tunnels.json").write_text(json.dumps({"tunnels": [
        {"box": "b", "local": "127.0.0.1:8787", "remote_port": 40000, "spec_port": 40000, "master_pid": 5}]}))
    [t] = Records(str(tmp_path)).load()
    assert (t.state, t.since, t.reopens, t.supervisor_pid, t.last_error) == (None, None, 0, None, None)
    assert not t.supervised()
    assert Records(str(tmp_path)).log_path(t) == str(tmp_path / "tunnels" / "b-8787.log")


def row(state, since=None, reopens=0, supervisor=7, error=None):
    return {"box": "b1", "to": "127.0.0.1:8787", "box_port": 40000, "state": state, "since": since,
            "reopens": reopens, "supervisor": supervisor, "log": "/x", **({"error": error} if error else {})}


def test_keep_says_only_what_changed():
    t0 = time.mktime((2026, 1, 1, 12, 0, 3, 0, 0, -1))
    head = "tunnel: b1 127.0.0.1:40000 -> 127.0.0.1:8787: "
    assert _change(row("open", t0), row("open", t0)) is None
    assert _change(row("open", t0), row("down", t0 + 60, error="gone")) == head + "down at 12:01:03 (gone)"
    assert _change(row("down", t0 + 60), row("down", t0 + 60)) is None
    assert _change(row("down", t0 + 60), row("reopened", t0 + 102, 1)) == head + "reopened at 12:01:45 (down 42 s)"
    assert _change(row("open", t0 + 102, 1), row("open", t0 + 102, 1)) is None  # the new master: nothing to say
    assert _change(row("open", t0, 1), row("open", t0 + 30, 2)) == head + "reopened at 12:00:33"  # between looks
    assert _change(row("open", t0), {"box": "b1", "to": "127.0.0.1:8787", "state": "closed"}) == head + "closed"
    assert _line(row("open", t0, 2)) == head + "open (up since 12:00:03, 2 re-opens, supervised by pid 7)"
    assert _line(row("down", t0, 2, None, "no route")) == head + "down since 12:00:03 (no route, not supervised)"
