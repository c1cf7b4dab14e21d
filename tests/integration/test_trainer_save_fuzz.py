"""SIGKILL during the TRAINER'S save, not only during onbox's commit: every run must stay resumable.

Each trial: a trainer's earlier save (step 5) is committed by the real CheckpointCommitHook to a mounted durable
dir; a forked child then replays the trainer's next save (step 10: the same files, order, formats and in-place
or atomic writes as nanoGPT, a Hugging Face Trainer, Lightning and a plain torch.save loop, tests/trainers/) and
is SIGKILLed at one of the save's crash points (every one of them, enumerated) or after a random delay; then
the agent does what it does when the trainer is gone (the final commit), and:

  A. every checkpoint a reader of the durable dir sees verifies (hashes) AND the framework resumes from it;
  B. the next attempt on the same box resumes: the restore hands over a path the framework loads, and the
     framework's own way of finding its checkpoint (nanoGPT's out/ckpt.pt, HF resume_from_checkpoint=True,
     Lightning ckpt_path="last") finds a loadable one;
  C. a replacement box (empty checkpoint dir) resumes from durable storage.

A fifth kind kills nanoGPT while it rewrites ckpt.pt in a loop and the agent commits concurrently (the commit
must never capture a torn in-place file). 310 trials; where each kill landed (before, inside, after the
save, judged by what it left on disk) is counted and printed (`pytest -s`).
"""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest

from onbox import fsutil
from onbox.checkpoints.hook import CheckpointCommitHook
from onbox.checkpoints.verify import verify_path
from onbox.supervisor.hooks import RunContext
from tests.fakes.run_context import run_context

pytestmark = [pytest.mark.integration, pytest.mark.slow]
torch = pytest.importorskip("torch")

from tests.trainers import crashpoints, patterns, resume  # noqa: E402  (needs torch)

SEED = 20261123


def box(root: str, durable: str) -> RunContext:
    ctx = run_context(root, name="fz", ckpt_dir=os.path.join(root, "ck"), durable=durable, sync_interval=0.0,
                      settle_seconds=10.0)
    fsutil.atomic_write_json(os.path.join(ctx.run_dir, "state.json"), {"started_at": 0.0})
    return ctx


class Kind:
    """One trainer's save and its resume rules; `step10(ck)` is the path where its step-10 save ends up."""

    def __init__(self, name: str, save: Callable[[str, int], Any], load_path: Callable[[str, Optional[str]], List[str]],
                 check: Callable[[str], Any], durable_file: Callable[[str], str], step10: Callable[[str], str]) -> None:
        self.name, self.save, self.load_path, self.check, self.durable_file = name, save, load_path, check, durable_file
        self.step10 = step10

    def landed(self, ck: str) -> str:
        """Where the kill landed, by what it left on disk: "after" the save (step 10 whole), "before" it (no
        trace of step 10, the step-5 state intact) or "inside" it (anything else: torn, empty, half-saved)."""
        path = self.step10(ck)
        r = self.check(path) if os.path.exists(path) else None
        if r is not None and r.ok and r.step == 10:
            return "after"
        if self.name == "lightning":  # the step file first, then last.ckpt rewritten: both as before, or not
            step_file = os.path.join(ck, patterns.lightning_filename(10))
            return "before" if not os.path.exists(step_file) and r is not None and r.ok and r.step == 5 else "inside"
        if self.name == "nanogpt":  # rewritten in place: the old content is intact, or not
            return "before" if r is not None and r.ok and r.step == 5 else "inside"
        return "before" if not os.path.exists(path) else "inside"


def _nanogpt_check(path: str) -> Any:
    return resume.check_nanogpt(os.path.dirname(path))


def _durable_same_name(name: str) -> Callable[[str], str]:
    return lambda d: os.path.join(d, name)


def _durable_file(d: str) -> str:
    [f] = [n for n in os.listdir(d) if n != "MANIFEST.json"]
    return os.path.join(d, f)


SHM = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
LIGHTNING_TMP: List[Optional[str]] = [None]  # this test's own dir on another filesystem (set by `scratch`)

KINDS = {
    # nanoGPT reads exactly out_dir/ckpt.pt, whatever the restore returned
    "nanogpt": Kind("nanogpt", lambda ck, s: patterns.write_nanogpt_ckpt(ck, s),
                    lambda ck, restored: [os.path.join(ck, "ckpt.pt")], _nanogpt_check, _durable_same_name("ckpt.pt"),
                    lambda ck: os.path.join(ck, "ckpt.pt")),
    # resume_from_checkpoint={ckpt} gets the restored dir; =True picks the highest checkpoint-N by itself
    "hf": Kind("hf", lambda ck, s: patterns.write_hf_checkpoint(ck, s, save_total_limit=1),
               lambda ck, restored: [p for p in (restored, resume.hf_last_checkpoint(ck)) if p],
               resume.check_hf, lambda d: d, lambda ck: os.path.join(ck, "checkpoint-10")),
    # ckpt_path={ckpt} or "last" (the newest last*.ckpt); the temp file in another filesystem: a copy onto the
    # target that a kill tears
    "lightning": Kind("lightning", lambda ck, s: patterns.write_lightning_save(ck, s, tmpdir=LIGHTNING_TMP[0]),
                      lambda ck, restored: [p for p in (restored, resume.lightning_last(ck)) if p],
                      resume.check_lightning, _durable_file, lambda ck: os.path.join(ck, "last.ckpt")),
    "plain": Kind("plain", lambda ck, s: patterns.write_plain(os.path.join(ck, "step_%05d.pt" % s), s),
                  lambda ck, restored: [restored] if restored else [], resume.check_plain, _durable_file,
                  lambda ck: os.path.join(ck, "step_00010.pt")),
}


def committed_dirs(durable: str) -> List[str]:
    root = os.path.join(durable, "fz", "checkpoints")
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, n) for n in sorted(os.listdir(root))
            if os.path.isfile(os.path.join(root, n, "MANIFEST.json"))]


def check_trial(kind: Kind, ctx: RunContext, durable: str, root: str,
                steps: Optional[Tuple[int, ...]] = (5, 10)) -> Dict[str, Any]:
    """The invariants A, B, C after a kill; returns what the trial saw."""
    hook = CheckpointCommitHook(ctx)
    hook.final(ctx.clock.monotonic() + 60.0)  # the agent's last commit, the trainer gone
    for d in committed_dirs(durable):  # A
        assert verify_path(d).ok, (kind.name, d, verify_path(d).problems)
        r = kind.check(kind.durable_file(d))
        assert r.ok, ("durable holds a checkpoint the trainer cannot resume from", kind.name, d, r)
    restored = CheckpointCommitHook(ctx).restore()  # B: the next attempt on this box
    for p in kind.load_path(ctx.ckpt_dir, restored):
        r = kind.check(p)
        assert r.ok and (steps is None or r.step in steps), ("the next attempt cannot resume", kind.name, p, r)
    assert restored is not None
    fresh = box(os.path.join(root, "box2"), durable)  # C: a replacement box
    again = CheckpointCommitHook(fresh).restore()
    assert again is not None
    for p in kind.load_path(fresh.ckpt_dir, again):
        r = kind.check(p)
        assert r.ok, ("a replacement box cannot resume", kind.name, p, r)
    return {"resumed_step": kind.check(kind.load_path(ctx.ckpt_dir, restored)[0]).step}


def trial(kind: Kind, root: str, kill: Callable[[Callable[..., Any], str], int]) -> Dict[str, Any]:
    durable = os.path.join(root, "durable")
    ctx = box(os.path.join(root, "box1"), durable)
    kind.save(ctx.ckpt_dir, 5)  # an earlier save, whole, committed
    hook = CheckpointCommitHook(ctx)
    hook.periodic()
    hook.join_worker(None)
    assert committed_dirs(durable), [e for e in ctx.emit.events if e[0] == "sync_failed"]
    kill(kind.save, ctx.ckpt_dir)
    where = kind.landed(ctx.ckpt_dir)
    seen = check_trial(kind, ctx, durable, os.path.join(root, "after"))
    seen["landed"] = where
    return seen


@pytest.fixture
def scratch():
    d = tempfile.mkdtemp(prefix="onbox-fuzz-")
    shm = tempfile.mkdtemp(prefix="onbox-fuzz-", dir=SHM) if SHM else None
    LIGHTNING_TMP[0] = shm
    yield d
    LIGHTNING_TMP[0] = None
    shutil.rmtree(d, ignore_errors=True)
    if shm:
        shutil.rmtree(shm, ignore_errors=True)


def save_seconds(kind: Kind, root: str) -> float:
    t0 = time.perf_counter()
    kind.save(os.path.join(root, "calibrate"), 10)
    return time.perf_counter() - t0


# trials per kind: every crash point of the save, RANDOM_TIME kills at a random moment, then kills at a random
# byte of a random file of the save, up to this many
TRIALS = {"nanogpt": 80, "hf": 80, "lightning": 50, "plain": 60}
RANDOM_TIME = 10


@contextlib.contextmanager
def cut_at(frac: float) -> Iterator[None]:
    """Make each file write of the replayers stop at `frac` of its bytes at its ":half" crash point (instead of
    the middle), so that a kill there leaves a prefix of any length. Set before the fork: the child inherits it."""
    original = patterns._write_bytes_to_fd

    def cut(fd: int, data: bytes, label: str) -> None:
        crashpoints.point(label + ":created")
        n = int(len(data) * frac)
        patterns._write_all(fd, data[:n])
        crashpoints.point(label + ":half")
        patterns._write_all(fd, data[n:])

    patterns._write_bytes_to_fd = cut
    try:
        yield
    finally:
        patterns._write_bytes_to_fd = original


@pytest.mark.parametrize("name", sorted(TRIALS))
def test_kill_during_the_trainers_save_never_leaves_a_run_that_cannot_resume(name, scratch):
    kind = KINDS[name]
    rng = random.Random("%s-%s" % (SEED, name))
    points = crashpoints.list_points(kind.save, os.path.join(scratch, "points"), 10)
    assert len(points) >= 3
    duration = save_seconds(kind, scratch)
    # byte cuts inside writes to a checkpoint's own name (not Lightning's temp file in $TMPDIR, which leaves the
    # checkpoint dir as it was)
    halves = [k + 1 for k, label in enumerate(points) if label.endswith(":half") and ".ckpt.tmp" not in label]
    results = []
    for i in range(TRIALS[name]):
        root = os.path.join(scratch, "t%03d" % i)
        if i < len(points):  # every crash point of the save, in order
            k = i + 1
            outcome = trial(kind, root, lambda save, ck, k=k: crashpoints.run_to_point(save, k, ck, 10))
        elif i < len(points) + RANDOM_TIME:  # a kill at a random moment, wherever it lands
            delay = rng.uniform(0.0, 3.0 * duration)
            outcome = trial(kind, root, lambda save, ck, d=delay: crashpoints.run_killed_after(save, d, ck, 10))
        else:  # a kill at a random byte of a random file the save writes
            k, frac = rng.choice(halves), rng.random()
            with cut_at(frac):
                outcome = trial(kind, root, lambda save, ck, k=k: crashpoints.run_to_point(save, k, ck, 10))
        results.append(outcome)
        shutil.rmtree(root, ignore_errors=True)
    landed = {w: sum(1 for r in results if r["landed"] == w) for w in ("before", "inside", "after")}
    print("\n%s: %d trials (%d crash points), the kill landed before/inside/after the save: %d/%d/%d; the next "
          "attempt resumed at step 5: %d, at step 10: %d" % (
              name, len(results), len(points), landed["before"], landed["inside"], landed["after"],
              sum(r["resumed_step"] == 5 for r in results), sum(r["resumed_step"] == 10 for r in results)))
    assert len(results) == TRIALS[name]
    assert landed["inside"] >= TRIALS[name] - len(points) - RANDOM_TIME  # every byte-cut trial left a torn save


def test_kill_nanogpt_while_it_rewrites_ckpt_in_place_and_the_agent_commits(scratch):
    """The agent commits while nanoGPT keeps rewriting ckpt.pt every few milliseconds (never quiet for anything
    like a settle interval): a whole file is committed without waiting, a commit whose source changed under the
    copy is dropped and retried at the next scan. The trainer is killed at a random moment (often inside a
    save); durable storage holds only whole copies, each labelled with the iter_num inside it, and both boxes
    resume."""
    kind = KINDS["nanogpt"]
    rng = random.Random("%s-loop" % SEED)
    commits, aborted, trials = 0, 0, 40
    kind.save(os.path.join(scratch, "warm"), 1)  # torch's first save in a process is slow: not in the children
    for i in range(trials):
        root = os.path.join(scratch, "l%03d" % i)
        durable = os.path.join(root, "durable")
        ctx = box(os.path.join(root, "box1"), durable)
        pid = os.fork()
        if pid == 0:
            try:  # save, a few ms of training, save again, in place, forever
                for it in range(10, 100_000, 5):
                    patterns.write_nanogpt_ckpt(ctx.ckpt_dir, it)
                    time.sleep(0.01)
            finally:
                os._exit(0)
        hook = CheckpointCommitHook(ctx)
        first_commit_by = time.monotonic() + 10.0
        kill_after = None
        while kill_after is None or time.monotonic() < kill_after:
            ctx.clock.advance(1.1)  # the hook rescans at most once a (fake) second
            hook.periodic()
            if kill_after is None and any(t == "checkpoint_committed" for t, _ in ctx.emit.events):
                kill_after = time.monotonic() + rng.uniform(0.0, 0.2)
            assert time.monotonic() < first_commit_by, "no commit in 10 s of an in-place trainer"
            time.sleep(0.002)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        hook.join_worker(None)
        commits += sum(1 for t, _ in ctx.emit.events if t == "checkpoint_committed")
        aborted += sum(1 for t, _ in ctx.emit.events if t == "checkpoint_commit_aborted")
        for d in committed_dirs(durable):
            m = fsutil.read_json(os.path.join(d, "MANIFEST.json"))
            r = kind.check(os.path.join(d, "ckpt.pt"))
            assert r.ok and r.step == m["step"] and m["name"] == "ckpt.pt.step-%d" % r.step, (d, r, m)
            assert m["step_source"] == "ckpt.pt:iter_num"
        check_trial(kind, ctx, durable, os.path.join(root, "after"), steps=None)
        shutil.rmtree(root, ignore_errors=True)
    print("\nnanogpt in-place loop: %d trials, %d commits, %d commits dropped (rewritten while copying)"
          % (trials, commits, aborted))
    assert commits >= trials
