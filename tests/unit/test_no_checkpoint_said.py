""""No checkpoint" says what IS in the checkpoint dir and why none of it counts, with the fix, within the settle
period of the trainer's first finished save (issue 32, item 5): the checkpoint hook on a real dir (its real inotify
watch), moved through time by the fake clock, the trainer's saves written as a trainer writes them. Then the same
warning as an alert, as the beats and `onboxctl status` over ssh carry it. And the healthy side: a trainer that
writes only logs and images beside its checkpoints before its first save, a save still being written, a save
renamed into place a moment after its temp file closed, are never warned about."""
from __future__ import annotations

import json
import os

import pytest

from onbox import fsutil
from onbox.checkpoints.hook import CheckpointCommitHook
from onbox.paths import CHECKPOINT_STATUS_FILE
from onbox.telemetry.alerts import AlertEngine
from tests.fakes.run_context import run_context

SETTLE = 3.0  # run_context's settle_seconds; the sync interval is 60 s: the warning comes long before it


def status(ctx):
    """checkpoint_status.json ({} while the hook has had nothing to say)."""
    path = os.path.join(ctx.run_dir, CHECKPOINT_STATUS_FILE)
    return fsutil.read_json(path) if os.path.exists(path) else {}


def save(ckpt_dir, name, doc, rename=True):
    """A trainer's save: to a temp name, then renamed into place (or written in place)."""
    path = os.path.join(ckpt_dir, name)
    with open(path + ".tmp" if rename else path, "w") as f:
        f.write(doc if isinstance(doc, str) else json.dumps(doc))
    if rename:
        os.replace(path + ".tmp", path)


def look(ctx, hook, seconds):
    """The agent's loop for `seconds`: a tick every second (each rescans the dir)."""
    for _ in range(int(seconds)):
        hook.periodic()
        ctx.clock.advance(1.0)
    hook.periodic()
    hook.join_worker(None)


def test_saves_under_a_name_onbox_ignores_are_said_with_the_fix_within_the_settle_period(tmp_path):
    ctx = run_context(tmp_path, sync_interval=60.0)
    hook = CheckpointCommitHook(ctx)
    look(ctx, hook, 1)
    for step in (20, 40, 60):
        save(ctx.ckpt_dir, "state_%06d.txt" % step, {"step": step})
    look(ctx, hook, 2 * SETTLE + 1)  # inotify saw them finished: the settle period; without it, unchanged that long too
    st = status(ctx)
    assert st["warning"] == ("3 files in %s, none a checkpoint: state_000040.txt, state_000060.txt and 1 more are "
                             "*.txt, a name onbox ignores by default (logs, notes, tables, images) — if they are the "
                             "trainer's saves, pass --ckpt-pattern '*.txt'" % ctx.ckpt_dir)
    assert st["warning_code"] == "no_checkpoint" and "nothing is committed" in st["warning_hint"]
    [ev] = ctx.emit.of("no_checkpoint_yet")
    assert ev["why"] == st["warning"]
    # the same words as an alert: in every beat (the engine reads checkpoint_status.json) and over ssh
    from onbox.telemetry.alerts import recorded_alerts

    engine = AlertEngine()
    engine.evaluate(child_alive=True, checkpoint=st)
    [alert] = [a.to_dict() for a in engine.collect()]
    assert (alert["code"], alert["severity"], alert["message"]) == ("no_checkpoint", "warning", st["warning"])
    assert [a.code for a in recorded_alerts({"warnings": []}, st)] == ["no_checkpoint"]
    # the trainer saves one onbox takes: the warning goes
    save(ctx.ckpt_dir, "state_000080.json", {"step": 80})
    look(ctx, hook, 1)
    assert status(ctx)["warning"] is None and status(ctx)["warning_code"] is None
    assert len(ctx.emit.of("no_checkpoint_yet")) == 1


@pytest.mark.parametrize("cfg,write,said", [
    ({}, lambda d: save(d, "state_000020.json.tmp", {"step": 20}, rename=False),
     "1 file in {d}, none a checkpoint: state_000020.json.tmp is a temp name (*.tmp), work in progress onbox never "
     "takes — rename each save to its final name once it is written"),
    ({"ckpt_pattern": ["*.pt"]}, lambda d: save(d, "state_000020.json", {"step": 20}),
     "1 file in {d}, none a checkpoint: state_000020.json is named by no --ckpt-pattern ('*.pt') — give a pattern "
     "that names the trainer's saves"),
    ({"ckpt_ignore": ["state_*"]}, lambda d: save(d, "state_000020.json", {"step": 20}),
     "1 file in {d}, none a checkpoint: state_000020.json is left out by --ckpt-ignore 'state_*'"),
    ({}, lambda d: save(d, "state_000020.json", '{"step": 20, "w": [0.1, ', rename=False),
     "1 file in {d}, none a checkpoint: state_000020.json is not complete (state_000020.json: torn: "
     "state_000020.json: not valid JSON"),
], ids=["a-temp-name-never-renamed", "no-pattern-names-it", "ignored-by-the-user", "torn"])
def test_each_reason_nothing_counts_is_said_with_its_fix(tmp_path, cfg, write, said):
    ctx = run_context(tmp_path, sync_interval=60.0, **cfg)
    hook = CheckpointCommitHook(ctx)
    look(ctx, hook, 1)
    write(ctx.ckpt_dir)
    look(ctx, hook, 2 * SETTLE + 1)  # a torn file is torn once it is quiet: then the grace
    assert (status(ctx).get("warning") or "").startswith(said.format(d=ctx.ckpt_dir)), status(ctx).get("warning")


def test_a_trainer_that_writes_logs_and_images_beside_its_checkpoints_is_not_warned_before_its_first_save(tmp_path):
    ctx = run_context(tmp_path, sync_interval=60.0)
    hook = CheckpointCommitHook(ctx)
    look(ctx, hook, 1)
    for name, text in (("train.log", "step 1\n"), ("metrics.jsonl", '{"step": 1}\n'),
                       ("events.out.tfevents.1700000000.box", "x"), ("sample_000100.png", "png")):
        save(ctx.ckpt_dir, name, text, rename=False)
    look(ctx, hook, 30)
    assert status(ctx).get("warning") is None and ctx.emit.of("no_checkpoint_yet") == []
    look(ctx, hook, 5 * 60)  # five sync intervals without a candidate: then what is there is said
    assert status(ctx)["warning"].startswith("4 files in %s, none a checkpoint: " % ctx.ckpt_dir)
    assert "train.log is *.log, a name onbox ignores by default" in status(ctx)["warning"]


def test_a_save_still_being_written_is_not_warned(tmp_path):
    ctx = run_context(tmp_path, sync_interval=60.0)
    hook = CheckpointCommitHook(ctx)
    look(ctx, hook, 1)
    big = os.path.join(ctx.ckpt_dir, "weights.bin2")  # a format onbox does not know, written in place, still open
    with open(big, "wb") as f:
        for _ in range(4 * int(SETTLE)):
            f.write(b"x" * 4096)
            f.flush()
            look(ctx, hook, 1)
        assert status(ctx).get("warning") is None and ctx.emit.of("no_checkpoint_yet") == []


def test_a_save_renamed_into_place_a_moment_after_its_temp_file_closed_is_not_warned(tmp_path):
    ctx = run_context(tmp_path, sync_interval=60.0)
    hook = CheckpointCommitHook(ctx)
    look(ctx, hook, 1)
    tmp = os.path.join(ctx.ckpt_dir, "state_000020.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"step": 20}, f)
    look(ctx, hook, SETTLE - 1)  # the temp file is closed: finished, but renamed within the grace
    assert status(ctx).get("warning") is None
    os.replace(tmp, os.path.join(ctx.ckpt_dir, "state_000020.json"))
    look(ctx, hook, 3 * SETTLE)
    assert status(ctx).get("warning") is None and ctx.emit.of("no_checkpoint_yet") == []
    assert status(ctx)["latest_local"]["name"] == "state_000020.json"
