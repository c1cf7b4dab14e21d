"""Unmodified real trainers (tests/trainers/): each saves twice and resumes from its own checkpoint; every die-at
point leaves the on-disk state it claims; the cheap replayers (tests/trainers/patterns.py) write what the real
frameworks write, in the same order, and the real trainers resume from what they write; tests/trainers/resume.py
predicts the real resume's outcome."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.conftest import REPO_ROOT, subprocess_env

torch = pytest.importorskip("torch")

from tests.trainers import crashpoints, harness, patterns, resume  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TRAINERS = os.path.join(REPO_ROOT, "tests", "trainers")
HF_FILES = set(patterns.HF_FILES_IN_ORDER)


def run_trainer(script, args, die_at=None, trace=None, extra_env=None, timeout=120):
    env = {}
    if die_at:
        env[harness.ENV_DIE] = die_at
    if trace:
        env[harness.ENV_TRACE] = trace
    env.update(extra_env or {})
    p = subprocess.run([sys.executable, os.path.join(TRAINERS, script), *args], capture_output=True, text=True,
                       timeout=timeout, env=subprocess_env(env), cwd=REPO_ROOT)
    return p.returncode, p.stdout + p.stderr


def check_ok(rc, out):
    assert rc == 0, out[-3000:]
    return out


def died_at(rc, out, point):
    assert rc == -9 and "%s %s" % (harness.DIE_MARK, point) in out, "rc=%s\n%s" % (rc, out[-3000:])


def replay_trace(tmp_path, code):
    """Run replayer code in a child with the save tracer on (audit hooks cannot be removed from this process)."""
    root, trace = str(tmp_path / "replay"), str(tmp_path / "replay.jsonl")
    os.makedirs(root, exist_ok=True)
    prog = ("import os\nfrom tests.trainers import harness, patterns\nroot = %r\nharness.install_trace(root)\n%s\n"
            % (root, code))
    p = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
                       env=subprocess_env({harness.ENV_TRACE: trace}))
    assert p.returncode == 0, p.stderr
    return root, harness.write_sequence(harness.read_trace(trace))


def files(d):
    return set(os.listdir(d))


def optimizer_layout(sd):
    """Group hyper-parameter names and sizes, and each state entry's keys and tensor shapes."""
    groups = [(sorted(g), len(g["params"])) for g in sd["param_groups"]]
    state = {i: {k: tuple(v.shape) for k, v in s.items()} for i, s in sd["state"].items()}
    return groups, state


# ---- module-scoped real runs: two saves each, traced ------------------------------------------------------------

@pytest.fixture(scope="module")
def workdir():
    d = tempfile.mkdtemp(prefix="real-trainers-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def nanogpt_run(workdir):
    out, trace = os.path.join(workdir, "nanogpt"), os.path.join(workdir, "nanogpt.jsonl")
    log = check_ok(*run_trainer("nanogpt.py", ["--out_dir=" + out, "--max_iters=10", "--eval_interval=5"],
                                trace=trace))
    return out, harness.read_trace(trace), log


@pytest.fixture(scope="module")
def hf_run(workdir):
    pytest.importorskip("transformers")
    out, trace = os.path.join(workdir, "hf"), os.path.join(workdir, "hf.jsonl")
    log = check_ok(*run_trainer("hf_trainer.py", ["--output_dir", out, "--max_steps", "10", "--save_steps", "5"],
                                trace=trace))
    return out, harness.read_trace(trace), log


@pytest.fixture(scope="module")
def lightning_run(workdir):
    pytest.importorskip("lightning")
    out, trace = os.path.join(workdir, "lightning", "ckpts"), os.path.join(workdir, "lightning.jsonl")
    log = check_ok(*run_trainer("lightning_trainer.py", ["--ckpt_dir", out, "--max_steps", "10", "--every", "5"],
                                trace=trace, extra_env={"TMPDIR": workdir}))
    return out, harness.read_trace(trace), log


@pytest.fixture(scope="module")
def plain_run(workdir):
    out, trace = os.path.join(workdir, "plain"), os.path.join(workdir, "plain.jsonl")
    log = check_ok(*run_trainer("plain_loop.py", ["--ckpt_dir", out, "--steps", "10", "--every", "5"],
                                trace=trace))
    return out, harness.read_trace(trace), log


# ---- each real trainer saves twice and resumes from its own checkpoint ------------------------------------------

def test_nanogpt_saves_in_place_and_resumes_at_iter_num(nanogpt_run, tmp_path):
    out, events, log = nanogpt_run
    assert log.count("saving checkpoint to %s" % out) == 2
    assert "iter 10: loss " in log and "step 10: train loss " in log
    assert harness.write_sequence(events) == [("write", "ckpt.pt"), ("write", "ckpt.pt")]  # no temp, no rename
    assert files(out) == {"ckpt.pt"} and resume.check_nanogpt(out).step == 10
    work = str(tmp_path / "n")
    shutil.copytree(out, work)
    log = check_ok(*run_trainer("nanogpt.py", ["--out_dir=" + work, "--max_iters=15", "--init_from=resume"]))
    first = next(line for line in log.splitlines() if line.startswith(("step ", "iter ")))
    assert first.startswith("step 10: ")  # resumes at iter_num, evaluates and rewrites ckpt.pt at once
    assert resume.check_nanogpt(work).step == 15


def test_hf_trainer_saves_checkpoint_dirs_and_resumes(hf_run, tmp_path):
    out, _, log = hf_run
    assert files(out) == {"checkpoint-5", "checkpoint-10"}
    for step in (5, 10):
        ckpt = os.path.join(out, "checkpoint-%d" % step)
        assert files(ckpt) == HF_FILES
        assert resume.check_hf(ckpt).step == step and resume.hf_complete(ckpt)
    assert "{'loss': " in log
    work = str(tmp_path / "hf")
    shutil.copytree(out, work)
    log = check_ok(*run_trainer("hf_trainer.py", ["--output_dir", work, "--max_steps", "15", "--save_steps", "5",
                                                  "--resume_from_checkpoint", "True"]))
    assert "train begins at global_step 10" in log
    assert resume.check_hf(os.path.join(work, "checkpoint-15")).step == 15


def test_lightning_saves_step_and_last_ckpt_and_resumes(lightning_run, tmp_path):
    out, _, log = lightning_run
    assert files(out) == {"epoch=0-step=5.ckpt", "epoch=0-step=10.ckpt", "last.ckpt"}
    assert resume.check_lightning(os.path.join(out, "last.ckpt")).step == 10
    work = str(tmp_path / "l")
    shutil.copytree(out, work)
    log = check_ok(*run_trainer("lightning_trainer.py", ["--ckpt_dir", work, "--max_steps", "15", "--every", "5",
                                                         "--ckpt_path", "last"]))
    assert "train begins at global_step 10" in log
    # The checkpoint recorded another dirpath, so ModelCheckpoint does not take last.ckpt as its own: it writes
    # last-v1.ckpt beside it, and ckpt_path="last" takes the newest last*.ckpt.
    assert "epoch=0-step=15.ckpt" in files(work) and "last-v1.ckpt" in files(work)
    newest = resume.lightning_last(work)
    assert newest.endswith("last-v1.ckpt") and resume.check_lightning(newest).step == 15


def test_plain_loop_saves_step_files_and_resumes(plain_run, tmp_path):
    out, events, log = plain_run
    assert files(out) == {"step_00005.pt", "step_00010.pt"}
    assert harness.write_sequence(events) == [("write", "step_00005.pt"), ("write", "step_00010.pt")]
    work = str(tmp_path / "p")
    shutil.copytree(out, work)
    log = check_ok(*run_trainer("plain_loop.py", ["--ckpt_dir", work, "--steps", "15", "--every", "5", "--resume",
                                                  os.path.join(work, "step_00010.pt")]))
    assert "resumed from %s at step 10" % os.path.join(work, "step_00010.pt") in log and "step 11 loss" in log
    assert resume.check_plain(os.path.join(work, "step_00015.pt")).step == 15


# ---- the replayers write what the frameworks write --------------------------------------------------------------

def test_hf_replayer_matches_a_real_trainer_save(hf_run, tmp_path):
    out, events, _ = hf_run
    root, replayed = replay_trace(tmp_path, "patterns.write_hf_checkpoint(root, 5, max_steps=10)\n"
                                            "patterns.write_hf_checkpoint(root, 10, max_steps=10)")
    assert replayed == harness.write_sequence(events)
    assert replayed[7] == ("write", "checkpoint-5/" + patterns.HF_LAST_FILE)
    real, mine = os.path.join(out, "checkpoint-10"), os.path.join(root, "checkpoint-10")
    assert files(mine) == files(real) == HF_FILES
    import json

    def load(d, name):
        with open(os.path.join(d, name)) as f:
            return json.load(f)

    assert load(mine, "config.json") == load(real, "config.json")
    assert load(mine, "generation_config.json") == load(real, "generation_config.json")
    state_real, state_mine = load(real, "trainer_state.json"), load(mine, "trainer_state.json")
    assert sorted(state_mine) == sorted(state_real) and state_mine["global_step"] == state_real["global_step"] == 10
    with open(os.path.join(real, "model.safetensors"), "rb") as f, open(os.path.join(mine, "model.safetensors"),
                                                                         "rb") as g:
        assert f.read(8 + 2600)[:8] == g.read(8 + 2600)[:8]  # same header length: same names, shapes, offsets
    for name in ("optimizer.pt", "scheduler.pt"):
        a = torch.load(os.path.join(real, name), weights_only=True)
        b = torch.load(os.path.join(mine, name), weights_only=True)
        if name == "optimizer.pt":
            assert optimizer_layout(a) == optimizer_layout(b)
        else:
            assert sorted(a) == sorted(b) and a["last_epoch"] == b["last_epoch"] == 10
    assert os.stat(os.path.join(mine, "model.safetensors")).st_mode & 0o777 == 0o600  # as safetensors' temp file


def test_hf_safetensors_bytes_are_the_libraries(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    tensors = {n: torch.randn(s) for n, s in patterns.hf_parameters(1)}
    st.save_file(tensors, str(tmp_path / "a.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "a.safetensors").read_bytes() == patterns.safetensors_bytes(tensors, {"format": "pt"})


def test_nanogpt_replayer_matches_a_real_save(nanogpt_run, tmp_path):
    out, _, _ = nanogpt_run
    root, replayed = replay_trace(tmp_path, "patterns.write_nanogpt_ckpt(root, 10)")
    assert replayed == [("write", "ckpt.pt")]
    real = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    mine = torch.load(os.path.join(root, "ckpt.pt"), weights_only=True)
    assert sorted(mine) == sorted(real) == ["best_val_loss", "config", "iter_num", "model", "model_args", "optimizer"]
    assert mine["iter_num"] == real["iter_num"] == 10 and mine["model_args"] == real["model_args"]
    assert {k: v.shape for k, v in mine["model"].items()} == {k: v.shape for k, v in real["model"].items()}
    assert optimizer_layout(mine["optimizer"]) == optimizer_layout(real["optimizer"])


def test_lightning_replayer_matches_a_real_save(lightning_run, tmp_path):
    out, events, _ = lightning_run
    root, replayed = replay_trace(tmp_path, "patterns.write_lightning_save(root, 5)\n"
                                            "patterns.write_lightning_save(root, 10)")
    assert replayed == harness.write_sequence(events) == [
        ("atomic", "epoch=0-step=5.ckpt"), ("atomic", "last.ckpt"), ("atomic", "epoch=0-step=10.ckpt"),
        ("atomic", "last.ckpt")]
    for name in ("epoch=0-step=10.ckpt", "last.ckpt"):
        real = torch.load(os.path.join(out, name), weights_only=True)
        mine = torch.load(os.path.join(root, name), weights_only=True)
        assert sorted(mine) == sorted(real) and mine["global_step"] == real["global_step"] == 10
        assert mine["loops"] == real["loops"] and mine["epoch"] == real["epoch"]
        assert list(mine["callbacks"]) == list(real["callbacks"])
        assert mine["lr_schedulers"] == real["lr_schedulers"]
        assert optimizer_layout(mine["optimizer_states"][0]) == optimizer_layout(real["optimizer_states"][0])


def test_plain_replayer_matches_a_real_save(plain_run, tmp_path):
    out, _, _ = plain_run
    root, replayed = replay_trace(tmp_path, "patterns.write_plain(os.path.join(root, 'step_00010.pt'), 10)")
    assert replayed == [("write", "step_00010.pt")]
    real = torch.load(os.path.join(out, "step_00010.pt"), weights_only=True)
    mine = torch.load(os.path.join(root, "step_00010.pt"), weights_only=True)
    assert sorted(mine) == sorted(real) and mine["step"] == real["step"] == 10
    assert optimizer_layout(mine["optimizer"]) == optimizer_layout(real["optimizer"])


@pytest.mark.parametrize("framework", ["hf", "nanogpt", "lightning", "plain"])
def test_real_trainer_resumes_from_a_replayed_checkpoint(framework, tmp_path):
    d = str(tmp_path / framework)
    if framework == "hf":
        pytest.importorskip("transformers")
        ckpt = patterns.write_hf_checkpoint(d, 10, max_steps=15)
        args = ["hf_trainer.py", "--output_dir", d, "--max_steps", "15", "--save_steps", "5",
                "--resume_from_checkpoint", ckpt]
        expect, after = "train begins at global_step 10", lambda: resume.check_hf(os.path.join(d, "checkpoint-15"))
    elif framework == "nanogpt":
        patterns.write_nanogpt_ckpt(d, 10)
        args = ["nanogpt.py", "--out_dir=" + d, "--max_iters=15", "--init_from=resume"]
        expect, after = "step 10: train loss", lambda: resume.check_nanogpt(d)
    elif framework == "lightning":
        pytest.importorskip("lightning")
        patterns.write_lightning_save(d, 10)
        args = ["lightning_trainer.py", "--ckpt_dir", d, "--max_steps", "15", "--every", "5", "--ckpt_path", "last"]
        expect, after = "train begins at global_step 10", lambda: resume.check_lightning(os.path.join(d, "last.ckpt"))
    else:
        path = patterns.write_plain(os.path.join(d, "step_00010.pt"), 10)
        args = ["plain_loop.py", "--ckpt_dir", d, "--steps", "15", "--every", "5", "--resume", path]
        expect, after = "at step 10", lambda: resume.check_plain(os.path.join(d, "step_00015.pt"))
    log = check_ok(*run_trainer(args[0], args[1:], extra_env={"TMPDIR": str(tmp_path)}))
    assert expect in log
    assert after().step == 15


def test_every_crash_point_of_a_replayed_hf_save(tmp_path):
    """A kill at each numbered point of write_hf_checkpoint: the checkpoint is resumable exactly from the point
    where trainer_state.json is whole, and never complete before."""
    labels = crashpoints.list_points(patterns.write_hf_checkpoint, str(tmp_path / "count"), 10)
    whole = labels.index("checkpoint-10/trainer_state.json:written") + 1
    assert labels[-1] == "checkpoint-10/trainer_state.json:written" and len(labels) == 26
    for k in range(1, len(labels) + 1):
        d = str(tmp_path / ("k%d" % k))
        patterns.write_hf_checkpoint(d, 5)
        assert crashpoints.run_to_point(patterns.write_hf_checkpoint, k, d, 10) == -9
        verdict = resume.check_hf(os.path.join(d, "checkpoint-10"))
        assert verdict.ok == (k >= whole), (labels[k - 1], verdict)
        assert resume.hf_complete(os.path.join(d, "checkpoint-5"))
        assert resume.hf_last_checkpoint(d).endswith("checkpoint-10")  # what resume_from_checkpoint=True picks


# ---- each die-at point leaves the state it claims ---------------------------------------------------------------

def _is_whole_torch_file(path):
    try:
        torch.load(path, weights_only=True)
        return True
    except Exception:
        return False


@pytest.mark.parametrize("point", ["before-save", "truncated", "during-save", "after-save"])
@pytest.mark.parametrize("script", ["nanogpt.py", "plain_loop.py"])
def test_single_file_die_points(script, point, tmp_path):
    """Die at the 2nd save (the 1st, at step 5, is whole)."""
    d = str(tmp_path / "out")
    if script == "nanogpt.py":
        args, path, check = ["--out_dir=" + d, "--max_iters=10"], os.path.join(d, "ckpt.pt"), lambda: resume.check_nanogpt(d)
    else:
        args, path = ["--ckpt_dir", d, "--steps", "10", "--every", "5"], os.path.join(d, "step_00010.pt")
        check = lambda: resume.check_plain(path)  # noqa: E731
    died_at(*run_trainer(script, args, die_at=point + "@2"), point)
    verdict = check()
    if point == "before-save":
        # nanoGPT's ckpt.pt still holds the first save; the plain loop's step_00010.pt was never created
        assert (verdict.step == 5) if script == "nanogpt.py" else not os.path.exists(path)
    elif point == "truncated":
        assert os.path.getsize(path) == 0 and not verdict.ok and verdict.error.startswith("EOFError")
    elif point == "during-save":
        assert os.path.getsize(path) > 0 and not verdict.ok and not _is_whole_torch_file(path)
    else:
        assert verdict.step == 10
    if script == "plain_loop.py":
        assert resume.check_plain(os.path.join(d, "step_00005.pt")).step == 5


def test_die_once_kills_only_the_first_attempt(tmp_path):
    d, once = str(tmp_path / "out"), str(tmp_path / "died")
    args = ["--ckpt_dir", d, "--steps", "10", "--every", "5"]
    env = {harness.ENV_DIE_ONCE: once}
    died_at(*run_trainer("plain_loop.py", args, die_at="truncated@2", extra_env=env), "truncated")
    assert os.path.exists(once) and os.path.getsize(os.path.join(d, "step_00010.pt")) == 0
    check_ok(*run_trainer("plain_loop.py", args, die_at="truncated@2", extra_env=env))
    assert resume.check_plain(os.path.join(d, "step_00010.pt")).step == 10


HF_DIE_POINTS = {
    # point: files left in checkpoint-10 (checkpoint-5 is whole)
    "after-model-before-optimizer": {"config.json", "generation_config.json", "model.safetensors", "training_args.bin"},
    "during-optimizer": {"config.json", "generation_config.json", "model.safetensors", "training_args.bin",
                         "optimizer.pt"},
    "before-trainer-state": HF_FILES - {"trainer_state.json"},
    "trainer-state-empty": HF_FILES,
    "after-save": HF_FILES,
}


@pytest.mark.parametrize("point", sorted(HF_DIE_POINTS))
def test_hf_die_points(point, tmp_path):
    pytest.importorskip("transformers")
    d = str(tmp_path / "hf")
    died_at(*run_trainer("hf_trainer.py", ["--output_dir", d, "--max_steps", "10", "--save_steps", "5"],
                         die_at=point + "@2"), point)
    ckpt = os.path.join(d, "checkpoint-10")
    assert files(ckpt) == HF_DIE_POINTS[point]
    assert resume.hf_complete(os.path.join(d, "checkpoint-5"))
    verdict = resume.check_hf(ckpt)
    assert verdict.ok == (point == "after-save"), verdict
    if point == "during-optimizer":
        assert os.path.getsize(os.path.join(ckpt, "optimizer.pt")) > 0
        assert not _is_whole_torch_file(os.path.join(ckpt, "optimizer.pt"))
    if point == "trainer-state-empty":
        assert os.path.getsize(os.path.join(ckpt, "trainer_state.json")) == 0
    if point == "after-model-before-optimizer":
        # issue 11's crash loop: resume_from_checkpoint=True takes the newest dir, complete or not
        rc, out = run_trainer("hf_trainer.py", ["--output_dir", d, "--max_steps", "15", "--save_steps", "5",
                                                "--resume_from_checkpoint", "True"])
        assert rc == 1 and "FileNotFoundError" in out and "trainer_state.json" in out
        assert verdict.error.startswith("FileNotFoundError")


def test_hf_die_during_rotation_leaves_a_half_deleted_old_checkpoint(tmp_path):
    pytest.importorskip("transformers")
    d = str(tmp_path / "hf")
    died_at(*run_trainer("hf_trainer.py", ["--output_dir", d, "--max_steps", "10", "--save_steps", "5",
                                           "--save_total_limit", "1"], die_at="during-rotate@2"), "during-rotate")
    assert resume.hf_complete(os.path.join(d, "checkpoint-10"))
    left = files(os.path.join(d, "checkpoint-5"))
    assert len(left) == len(HF_FILES) - 1 and left < HF_FILES


def _lightning(tmp_path, point, tmpdir):
    pytest.importorskip("lightning")
    d = str(tmp_path / "ckpts")
    died_at(*run_trainer("lightning_trainer.py", ["--ckpt_dir", d, "--max_steps", "10", "--every", "5"],
                         die_at=point, extra_env={"TMPDIR": tmpdir}), point.split("@")[0])
    temps = [n for n in os.listdir(tmpdir) if n.startswith("tmp") and os.path.isfile(os.path.join(tmpdir, n))]
    return d, temps


@pytest.mark.parametrize("point", ["before-save@3", "during-dump@3", "before-move@3", "before-last@2",
                                   "after-save@3"])
def test_lightning_die_points(point, tmp_path):
    """Saves 1 and 2 are step 5's epoch=0-step=5.ckpt and last.ckpt; save 3 is step 10's epoch=0-step=10.ckpt."""
    tmpdir = str(tmp_path / "tmp")
    os.makedirs(tmpdir)
    d, temps = _lightning(tmp_path, point, tmpdir)
    name = point.split("@")[0]
    step10 = os.path.join(d, "epoch=0-step=10.ckpt")
    assert resume.check_lightning(os.path.join(d, "epoch=0-step=5.ckpt")).step == 5
    assert resume.check_lightning(os.path.join(d, "last.ckpt")).step == 5  # last.ckpt is never partly written
    if name in ("before-last", "after-save"):
        assert resume.check_lightning(step10).step == 10 and temps == []
    else:
        assert not os.path.exists(step10)
        if name == "before-move":  # the whole checkpoint sits in the temp dir, left there for good
            assert len(temps) == 1 and resume.check_lightning(os.path.join(tmpdir, temps[0])).step == 10
        else:
            assert temps == []


def test_lightning_move_across_filesystems_tears_last_ckpt_in_place(tmp_path):
    """With the temp dir on another filesystem, fsspec's commit is shutil.move = copy onto the target: a kill
    mid-copy leaves a torn last.ckpt where a whole one was."""
    shm = "/dev/shm"
    if not os.path.isdir(shm) or os.stat(shm).st_dev == os.stat(str(tmp_path)).st_dev:
        pytest.skip("no second filesystem for the temp dir (/dev/shm)")
    tmpdir = tempfile.mkdtemp(dir=shm)
    try:
        d, _ = _lightning(tmp_path, "during-move@4", tmpdir)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    assert resume.check_lightning(os.path.join(d, "epoch=0-step=10.ckpt")).step == 10
    last = os.path.join(d, "last.ckpt")
    assert os.path.getsize(last) > 0 and not resume.check_lightning(last).ok


def test_every_crash_point_of_the_single_file_replayers(tmp_path):
    """In place (nanoGPT, plain loop): from the moment the file is opened until its last byte, the previous
    save is gone and nothing resumable stands in its place. Lightning (temp + rename): the previous last.ckpt
    stands until the rename, and the temp file is all a kill leaves."""
    cases = {
        "nanogpt": (lambda d, s: patterns.write_nanogpt_ckpt(d, s), lambda d: resume.check_nanogpt(d), "ckpt.pt:written"),
        "plain": (lambda d, s: patterns.write_plain(os.path.join(d, "step.pt"), s),
                  lambda d: resume.check_plain(os.path.join(d, "step.pt")), "step.pt:written"),
        "lightning": (lambda d, s: patterns.write_lightning_ckpt(os.path.join(d, "last.ckpt"),
                                                                 patterns.lightning_checkpoint(s, d, "last.ckpt"),
                                                                 tmpdir=os.path.join(d, "tmp")),
                      lambda d: resume.check_lightning(os.path.join(d, "last.ckpt")), "last.ckpt:renamed"),
    }
    for name, (write, check, done) in cases.items():
        scratch = str(tmp_path / name / "count")
        os.makedirs(os.path.join(scratch, "tmp"))
        labels = crashpoints.list_points(write, scratch, 10)
        assert labels[-1] == done, labels
        for k, label in enumerate(labels, 1):
            d = str(tmp_path / name / ("k%d" % k))
            os.makedirs(os.path.join(d, "tmp"))
            write(d, 5)
            assert crashpoints.run_to_point(write, k, d, 10) == -9
            verdict = check(d)
            if label == done:
                assert verdict.step == 10, (name, label, verdict)
            elif name == "lightning":
                assert verdict.step == 5, (name, label, verdict)
            else:
                assert not verdict.ok, (name, label, verdict)
