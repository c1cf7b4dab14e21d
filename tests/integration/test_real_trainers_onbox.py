"""The observed failures of issue 11, reproduced with the real trainers under the real agent (`onbox run`), each
killed during ITS OWN save, and shown to resume.

- nanoGPT (tests/trainers/nanogpt.py, its in-place ckpt.pt and --init_from=resume contract) killed as torch.save
  reopened ckpt.pt: the file is left empty; before, the restore went to another path and nanoGPT crash-looped on
  the empty file. Now the verified copy is put back at out/ckpt.pt, nanoGPT resumes at its iter_num, and a
  replacement box resumes from durable storage too.
- A real Hugging Face Trainer killed between save_model() and the optimizer save: checkpoint-10/ is left without
  trainer_state.json; before, it was committed when quiet and restored into a crash loop on both boxes. Now it
  is never committed, it is kept aside before the next attempt (resume_from_checkpoint=True would pick it), and
  the run resumes from checkpoint-5 on this box and on a replacement box.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from tests.conftest import REPO_ROOT
from tests.integration.supervisor_helpers import events, onbox, state

pytestmark = [pytest.mark.integration, pytest.mark.slow]
torch = pytest.importorskip("torch")

from tests.trainers import harness, resume  # noqa: E402

TRAINERS = os.path.join(REPO_ROOT, "tests", "trainers")
PY = sys.executable


def agent(home, name, ckpt, durable, resume_arg, argv, die_at=None, once=None, timeout=240, extra=()):
    env = {"PYTHONPATH": REPO_ROOT}
    if die_at:
        env.update({harness.ENV_DIE: die_at, harness.ENV_DIE_ONCE: str(once)})
    r = onbox(home, "run", "--foreground", "--name", name, "--ckpt-dir", str(ckpt), "--durable", str(durable),
              "--sync-interval", "0.1", "--restart", "on-failure", "--max-restarts", "3",
              "--resume-arg=%s" % resume_arg, *extra, "--", *argv, env_extra=env, timeout=timeout, cwd=REPO_ROOT)
    return r


def nanogpt(out, max_iters=180):
    return [PY, os.path.join(TRAINERS, "nanogpt.py"), "--out_dir=%s" % out, "--max_iters=%d" % max_iters,
            "--eval_interval=60", "--batch_size=32", "--always_save_checkpoint=True"]


def log_of(home, name):
    with open(os.path.join(str(home), "runs", name, "output.log")) as f:
        return f.read()


def test_nanogpt_killed_as_torch_save_reopens_ckpt_resumes_from_the_verified_copy_in_place(onbox_home, tmp_path):
    out, durable, once = tmp_path / "out", tmp_path / "durable", tmp_path / "died"
    argv = nanogpt(out)
    # the 2nd save (iter 120; nanoGPT saves at every eval_interval but iter 0) dies right after torch.save has
    # truncated ckpt.pt: the only local copy is empty. 60 iterations (~0.5 s) between saves leave the agent time to
    # commit the first one (sync interval 0.1 s)
    r = agent(onbox_home, "gpt", out, durable, "--init_from=resume", argv, die_at="truncated@2", once=once)
    assert r.returncode == 0, (r.stderr[-2000:], log_of(onbox_home, "gpt")[-3000:])
    assert os.path.exists(once) and state(onbox_home, "gpt")["state"] == "done"
    evs = events(onbox_home, "gpt")
    aside = [e for e in evs if e["type"] == "checkpoint_set_aside"]
    assert aside and aside[0]["path"] == str(out / "ckpt.pt")  # the empty ckpt.pt, kept
    assert os.path.getsize(aside[0]["moved_to"]) == 0
    resumed = [e for e in evs if e["type"] == "checkpoint_resume"]
    assert resumed and resumed[0]["path"] == str(out / "ckpt.pt") and resumed[0]["step"] == 60
    log = log_of(onbox_home, "gpt")
    assert "onbox-test: SIGKILL at truncated" in log
    assert "Resuming training from %s" % out in log
    assert resume.check_nanogpt(str(out)).step == 180  # the run went on from iter 60 to the end
    steps = []
    for name in os.listdir(durable / "gpt" / "checkpoints"):
        m = json.loads((durable / "gpt" / "checkpoints" / name / "MANIFEST.json").read_text())
        # named by the iter_num inside; a resumed nanoGPT saves iter 100 again at once (other bytes): ".r2"
        assert name.split(".r")[0] == "ckpt.pt.step-%d" % m["step"] and m["step_source"] == "ckpt.pt:iter_num"
        steps.append(m["step"])
    assert 180 in steps and 120 in steps  # retention keeps the last 3
    # a replacement box: an empty out dir, the same durable storage; nanoGPT resumes at iter 180, goes on to 240
    out2 = tmp_path / "out2"
    r = agent(onbox_home, "gpt", out2, durable, "--init_from=resume", nanogpt(out2, 240), extra=("--resume",))
    assert r.returncode == 0, log_of(onbox_home, "gpt")[-3000:]
    assert [e["step"] for e in events(onbox_home, "gpt") if e["type"] == "checkpoint_resume"][-1] == 180
    assert resume.check_nanogpt(str(out2)).step == 240


def test_hf_trainer_killed_between_model_and_optimizer_save_resumes_from_the_complete_checkpoint(onbox_home,
                                                                                                 tmp_path):
    pytest.importorskip("transformers")
    out, durable, once = tmp_path / "hf", tmp_path / "durable", tmp_path / "died"
    argv = [PY, os.path.join(TRAINERS, "hf_trainer.py"), "--output_dir", str(out), "--max_steps", "15",
            "--save_steps", "5"]
    # the user's own command asks HF to pick its newest checkpoint (resume_from_checkpoint=True) on a restart;
    # onbox's resume arg hands it the verified one
    r = agent(onbox_home, "ft", out, durable, "--resume_from_checkpoint={ckpt}", argv,
              die_at="after-model-before-optimizer@2", once=once)
    assert r.returncode == 0, (r.stderr[-2000:], log_of(onbox_home, "ft")[-4000:])
    assert state(onbox_home, "ft")["state"] == "done"
    evs = events(onbox_home, "ft")
    committed = [e["checkpoint"] for e in evs if e["type"] == "checkpoint_committed"]
    assert "checkpoint-5" in committed and committed.count("checkpoint-10") <= 1
    for name in os.listdir(durable / "ft" / "checkpoints"):  # never the half-saved one
        m = json.loads((durable / "ft" / "checkpoints" / name / "MANIFEST.json").read_text())
        assert (m["format"], m["complete_by"]) == ("hf-trainer", "format")
        assert resume.hf_complete(str(durable / "ft" / "checkpoints" / name)), name
    resumed = [e for e in evs if e["type"] == "checkpoint_resume"]
    assert resumed[0]["checkpoint"] == "checkpoint-5" and resumed[0]["step"] == 5
    aside = [e for e in evs if e["type"] == "checkpoint_set_aside"]
    assert [os.path.basename(e["path"]) for e in aside] == ["checkpoint-10"]
    assert "trainer_state.json" in aside[0]["reason"]
    assert "train begins at global_step 5" in log_of(onbox_home, "ft")
    assert resume.hf_complete(str(out / "checkpoint-15"))
    # a replacement box: an empty output dir; HF resumes from the newest committed checkpoint
    out2 = tmp_path / "hf2"
    r = agent(onbox_home, "ft", out2, durable, "--resume_from_checkpoint={ckpt}",
              [PY, os.path.join(TRAINERS, "hf_trainer.py"), "--output_dir", str(out2), "--max_steps", "20",
               "--save_steps", "5"], extra=("--resume",))
    assert r.returncode == 0, log_of(onbox_home, "ft")[-3000:]
    assert "train begins at global_step 15" in log_of(onbox_home, "ft")
