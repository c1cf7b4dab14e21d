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
    from controller.tracker.runview import RunRow

    return RunRow(box=box, run=run, state=state, liveness=liveness, source=source, age_s=age, interval_s=interval)


def test_beat_hint_for_the_default_interval_names_the_flag():
    from controller.tracker.runview import beat_hint

    assert beat_hint([_row()]) == (
        "the table is as old as each run's newest beat: gpu1/gpt beats every 30 s (the default), so its step and loss "
        "can be that far behind; `onboxctl run --heartbeat-interval 5` beats more often")
    assert beat_hint([_row(interval=10.0), _row(run="b", interval=60.0, age=20.0)]) == (
        "the table is as old as each run's newest beat: gpu1/b beats every 60 s (and 1 more run(s)), so its step and "
        "loss can be that far behind; `onboxctl run --heartbeat-interval 5` beats more often")


def test_beat_hint_for_an_overdue_beat():
    from controller.tracker.runview import beat_hint

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
    from controller.tracker.runview import beat_hint

    assert beat_hint([row]) is None


def test_the_row_carries_the_interval_the_beat_says():
    from controller.tracker.runview import row_from_heartbeat

    assert row_from_heartbeat({"run": "r", "interval_s": 5}).interval_s == 5.0
    assert row_from_heartbeat({"run": "r", "interval_s": "soon"}).interval_s is None
    assert row_from_heartbeat({"run": "r", "interval_s": -1}).interval_s is None


# -- onboxctl pull: what the verification checked -------------------------------------------------------------
def _report(files, load_note="", loaded=None, problems=()):
    return {"has_manifest": True, "files": files, "loaded": loaded, "load_note": load_note, "ok": not problems,
            "problems": list(problems), "checkpoints": [{"name": "step_100", "checked": ["size", "sha256", "format"]}]}


def test_checked_words_say_only_what_was_checked():
    from controller.results.pull import checked_words, verified_line

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


# -- onboxctl down: the verdict once the gate passes, and how to stop the meter, for every profile ---------------
def _gate(*kinds, box="gpu1"):
    from controller.boxes.profiles import MeterStop
    from controller.results.teardown import GateReport, RunVerdict

    runs = [RunVerdict("r%d" % i, "done", None, None, k == "verified", k == "verified", False, "", kind=k)
            for i, k in enumerate(kinds, 1)]
    meter = MeterStop(profile="runpod", verb="terminate", irreversible=True, verified="2026-06", source=None,
                      command=None)
    return GateReport(box=box, runs=runs, meter=meter, allowed=True, warnings=[])


def test_passed_line_names_each_run_for_what_it_is():
    from controller.results.teardown import passed_line

    assert passed_line(_gate("verified", "verified")) == (
        "Gate passed: every run's newest checkpoint on gpu1 is pulled and verified.")
    assert passed_line(_gate()) == "Gate passed: there are no runs on gpu1."
    assert passed_line(_gate("verified", "abandoned")) == (
        "Gate passed for gpu1: newest checkpoint pulled and verified: r1; ABANDONED with --abandon, newest state not "
        "home: r2.")
    assert passed_line(_gate("abandoned", "off_box", "other_node", "abandoned")) == (
        "Gate passed for gpu1: ABANDONED with --abandon, newest state not home: r1, r4; committed off the box "
        "(rclone): r2; a node whose node 0 commits: r3.")


def test_judge_run_kinds(tmp_path):
    from controller.results.pull import PullsRecord, RemoteCheckpoint
    from controller.results.teardown import judge_run

    rec = PullsRecord(str(tmp_path / "pulls.json"))
    ck = RemoteCheckpoint(name="step_1", manifest_sha256="a" * 64, step=1)
    rec.record("b", "ok", "/d", "step_1", {"ok": True, "manifest_sha256": "a" * 64})
    assert judge_run("b", {"run": "ok", "checkpoints": [ck]}, rec).kind == "verified"
    assert judge_run("b", {"run": "ok", "checkpoints": [ck]}, rec, abandoned=["ok"]).kind == "verified"
    assert judge_run("b", {"run": "x", "checkpoints": [ck]}, rec).kind == "blocked"
    assert judge_run("b", {"run": "x", "checkpoints": [ck]}, rec, abandoned=["x"]).kind == "abandoned"
    assert judge_run("b", {"run": "x", "checkpoints": []}, rec, abandoned=["x"]).kind == "abandoned"
    assert judge_run("b", {"run": "x", "checkpoints": [], "durable": "r2:b"}, rec).kind == "off_box"
    assert judge_run("b", {"run": "x.node1", "node": {"rank": 1, "run": "x"}}, rec).kind == "other_node"


def _all_profiles():
    from controller.boxes.profiles import known_profiles, load_profile

    out = []
    for name in known_profiles():
        out.append(name)
        out += ["%s/%s" % (name, p) for p in sorted((load_profile(name) or {}).get("platforms") or {})]
    return out


@pytest.mark.parametrize("name", _all_profiles())
def test_every_profile_says_how_to_stop_the_meter_in_a_sentence(name):
    """The teardown text of every built-in profile (and sub-platform) reads as a sentence of its own: it says how to
    stop the meter, or that there is none; never a verb spliced into a template ("manual (provider-specific) the
    box on its platform")."""
    from controller.boxes.profiles import meter_stop
    from controller.results.teardown import meter_sentence

    m = meter_stop(name)
    assert m.how, "profile %s has no [billing] teardown sentence" % name
    said = meter_sentence(m, None)
    assert said == m.how
    assert said.startswith(("To stop the meter, ", "To stop the compute meter, ", "There is no meter to stop: "))
    assert said.endswith(".") and said.count(". ") == 0, said  # one sentence
    assert "the box on its platform" not in said and m.verb not in said.split(", ", 1)[0]


def test_meter_sentence_without_a_profile_sentence_or_with_a_command():
    from controller.boxes.profiles import MeterStop, meter_stop
    from controller.results.teardown import meter_sentence

    mine = MeterStop(profile="mycloud", verb="manual (provider-specific)", irreversible=True, verified=None,
                     source=None, command=None)
    assert meter_sentence(mine, None) == ('To stop the meter, do on the box\'s platform what profile mycloud calls '
                                          '"manual (provider-specific)" (it names no command for it).')
    assert meter_sentence(mine, "mycloud rm gpu1") == "To stop the meter (manual (provider-specific)): mycloud rm gpu1"
    assert meter_sentence(meter_stop("no-such-profile"), None) == (
        "To stop the meter, stop the box the way its platform does: no profile 'no-such-profile' here says how, and "
        "a forgotten box bills around the clock.")
