"""What onboxctl says, built without a box: the tracker's start-up lines, the status table's heartbeat hint, what a
pull's verification says it checked, and the teardown gate's sentences for every profile."""
from __future__ import annotations

import os

import pytest


# -- onboxctl tracker serve ------------------------------------------------------------------------------------
@pytest.mark.parametrize("host,tls,listen,dash", [
    ("127.0.0.1", False, "http://127.0.0.1:8787 (", "dashboard http://127.0.0.1:8787/; "),
    ("localhost", True, "https://localhost:8787 (", "dashboard https://localhost:8787/; "),
    ("::1", False, "http://[::1]:8787 (", "dashboard http://[::1]:8787/; "),
    ("0.0.0.0", True, "https://0.0.0.0:8787, every address of this machine (",
     "dashboard https://127.0.0.1:8787/ (from elsewhere: this machine's name or address); "),
    ("::", False, "http://[::]:8787, every address of this machine (",
     "dashboard http://[::1]:8787/ (from elsewhere: this machine's name or address); "),
])
def test_tracker_announcement_names_the_address_the_dashboard_and_the_token(host, tls, listen, dash):
    from controller.commands.tracker import announcement

    lines = announcement(host, 8787, tls, "in /home/me/.onbox-token", False, "/home/me/t.db")
    assert lines == ["onboxctl tracker: listening on %spid %d, database /home/me/t.db)" % (listen, os.getpid()),
                     "onboxctl tracker: %slog in with the token in /home/me/.onbox-token" % dash]


# -- onboxctl status: the heartbeat hint -----------------------------------------------------------------------
def _row(run="gpt", source="tracker", liveness="ok", state="running", age=3.0, interval=None, box="gpu1"):
    from controller.runview import RunRow

    return RunRow(box=box, run=run, state=state, liveness=liveness, source=source, age_s=age, interval_s=interval)


def test_beat_hint_for_the_default_interval_names_the_flag():
    from controller.runview import beat_hint

    assert beat_hint([_row()]) == (
        "the table is as old as each run's newest beat: gpu1/gpt beats every 30 s (the default), so its step and loss "
        "can be that far behind; `onboxctl run --heartbeat-interval 5` beats more often")
    assert beat_hint([_row(interval=10.0), _row(run="b", interval=60.0, age=20.0)]) == (
        "the table is as old as each run's newest beat: gpu1/b beats every 60 s (and 1 more run(s)), so its step and "
        "loss can be that far behind; `onboxctl run --heartbeat-interval 5` beats more often")


def test_beat_hint_for_an_overdue_beat():
    from controller.runview import beat_hint

    assert beat_hint([_row(interval=5.0, age=9.0)]) == (
        "gpu1/gpt's newest beat is 9s old, overdue for a run that beats every 5 s: its row is that far behind the "
        "trainer (a busy box or a slow link?); `onboxctl run --heartbeat-interval 5` beats more often")


@pytest.mark.parametrize("row", [
    _row(interval=5.0, age=4.0),  # a fresh beat of a run that beats often: nothing to say
    _row(interval=2.0, age=7.0, liveness="late"),  # LATE is in the table already
    _row(liveness="silent", age=900.0),
    _row(state="stopped", liveness="ended", age=900.0),  # an ended run beats no more
    _row(source="ssh", liveness="unknown", age=40.0),  # read from the box itself: no beat behind
])
def test_no_beat_hint(row):
    from controller.runview import beat_hint

    assert beat_hint([row]) is None


def test_the_row_carries_the_interval_the_beat_says():
    from controller.runview import row_from_heartbeat

    assert row_from_heartbeat({"run": "r", "interval_s": 5}).interval_s == 5.0
    assert row_from_heartbeat({"run": "r", "interval_s": "soon"}).interval_s is None
    assert row_from_heartbeat({"run": "r", "interval_s": -1}).interval_s is None


# -- onboxctl pull: what the verification checked -------------------------------------------------------------
def _report(files, load_note="", loaded=None, problems=()):
    return {"has_manifest": True, "files": files, "loaded": loaded, "load_note": load_note, "ok": not problems,
            "problems": list(problems), "checkpoints": [{"name": "step_100", "checked": ["size", "sha256", "format"]}]}


def test_checked_words_say_only_what_was_checked():
    from controller.pull import checked_words, verified_line

    torch_zip = {"path": "model.pt", "kind": "torch-zip", "ok": True}
    plain = {"path": "model.dat", "kind": "", "ok": True, "note": "hash only"}
    rep = _report([plain], "not loaded: no torch or safetensors file to load")
    assert checked_words(rep) == ("size and sha256 of 1 file(s) against MANIFEST.json; 1 file(s) of no format onbox "
                                  "checks (hash only); not loaded: no torch or safetensors file to load")
    rep = _report([torch_zip, dict(torch_zip, path="opt.pt"), {"path": "cfg.json", "kind": "json", "ok": True}],
                  "loaded 2 file(s) with torch 2.13.0", loaded=True)
    assert checked_words(rep) == ("size and sha256 of 3 file(s) against MANIFEST.json; format of 1 json, "
                                  "2 torch-zip; loaded 2 file(s) with torch 2.13.0")
    v = {"ok": True, "loaded": None, "checked": checked_words(_report([plain], "not loaded: --no-load"))}
    assert verified_line("step_100", v) == ("verified step_100: OK (checked: size and sha256 of 1 file(s) against "
                                            "MANIFEST.json; 1 file(s) of no format onbox checks (hash only); "
                                            "not loaded: --no-load)")
    assert "torch" not in verified_line("step_100", v)  # no load, no word of one
    v = {"ok": False, "error": "model.dat: sha256 mismatch (content corrupted)", "checked": "size and sha256 of 1"}
    assert verified_line("step_100", v) == ("verified step_100: FAILED: model.dat: sha256 mismatch (content "
                                            "corrupted) (checked: size and sha256 of 1)")
