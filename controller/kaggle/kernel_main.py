"""The part of a Kaggle kernel's script that runs on Kaggle: it brings onbox.pyz (and the user's code) out of the
script, seeds the commit target from the previous version's output, and runs the command under `onbox run
--foreground` with the session's deadline.

`onboxctl kaggle push` writes the kernel's script as SPEC, PYZ_B64 and CODE_B64 (controller/kaggle/folder.py)
followed by this file's text, so this file runs on Kaggle's own Python with the standard library only (3.8+): it
reads its environment itself, and onbox.pyz does the rest. It imports nothing of onbox.

One session, on Kaggle:
  1. onbox.pyz, checked against SPEC's sha256, goes to <root>/temp/onbox-<run>/ (not /kaggle/working: only the
     trained state should become the version's output); the --code tree is unpacked beside it.
  2. Without an rclone remote the commit target is /kaggle/working/onbox-durable, which Kaggle keeps as the
     version's output. When it does not hold the run yet, the newest copy of `onbox-durable/<run>` found under
     /kaggle/input with the kernel's slug in its path (the previous version's output, mounted read-only because
     the kernel lists itself as a source; never a dataset's) is copied there first: the agent then finds the
     run's committed checkpoints in its durable target, restores the newest verified one and hands it to the
     trainer (ONBOX_RESUME_FROM), as on a replacement box. The copy keeps the chain whole: a session that commits
     nothing new still hands the previous checkpoints on.
  3. `onbox run --foreground --profile kaggle --name RUN`: the profile's [session] hours from the kernel's start
     (PID 1) are the run's deadline, so the checkpoint is asked for and committed before Kaggle's clock ends the
     session; the run exits 75 (session_limit) and the next push continues it.
  4. The outcome goes to /kaggle/working/onbox-kaggle.json and to the log's last `onbox-kaggle:` line, which
     `onboxctl kaggle status` reads back. The script exits 0 when the run is done or stopped by the session's
     end (the chain goes on), otherwise with the agent's exit code.

ONBOX_KAGGLE_ROOT replaces /kaggle (the tests run a session under a temporary root); ONBOX_HOME, when set, is where
the agent keeps its run directory (default: beside onbox.pyz, lost with the session like everything but the output).
"""
import base64
import hashlib
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import time

SPEC = globals().get("SPEC") or {}
PYZ_B64 = globals().get("PYZ_B64") or ""
CODE_B64 = globals().get("CODE_B64") or ""

DURABLE_DIR = "onbox-durable"  # under /kaggle/working: the runs' commit target, kept as the version's output
OUTCOME_FILE = "onbox-kaggle.json"
OUTCOME_SCHEMA = "onbox.kaggle.session/1"
LOG_PREFIX = "onbox-kaggle: "
MANIFEST_MAX_BYTES = 64 * 1024 * 1024  # onbox.untrusted's bound: a manifest past it has no step
SEARCH_DEPTH = 5  # /kaggle/input/<slug>/onbox-durable is 2 deep; newer mounts nest the owner and kind too
STATUS_TIMEOUT = 60
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def say(msg):
    print(LOG_PREFIX + msg, flush=True)


def layout(environ):
    """The session's folders: Kaggle's (/kaggle/input, /kaggle/working) or the same under ONBOX_KAGGLE_ROOT."""
    root = environ.get("ONBOX_KAGGLE_ROOT") or "/kaggle"
    temp = os.path.join(root, "temp")
    return {"root": root, "input": os.path.join(root, "input"), "working": os.path.join(root, "working"),
            "scratch": os.path.join(temp, "onbox-" + SPEC["run"])}


def unpack_pyz(scratch):
    data = base64.b64decode(PYZ_B64)
    digest = hashlib.sha256(data).hexdigest()
    if digest != SPEC["pyz_sha256"]:
        raise SystemExit("onbox-kaggle: the embedded onbox.pyz is damaged (sha256 %s, expected %s): push again"
                         % (digest, SPEC["pyz_sha256"]))
    path = os.path.join(scratch, "onbox.pyz")
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)
    return path


def unpack_code(scratch):
    """The --code tree, into scratch/code; a member that would land outside it is refused."""
    dest = os.path.join(scratch, "code")
    if os.path.isdir(dest):
        shutil.rmtree(dest)
    os.makedirs(dest)
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(CODE_B64)), mode="r:gz") as tar:
        for m in tar.getmembers():
            target = os.path.realpath(os.path.join(dest, m.name))
            if not (m.isfile() or m.isdir()) or not target.startswith(os.path.realpath(dest) + os.sep):
                raise SystemExit("onbox-kaggle: the code archive holds %r, which is no file inside it" % m.name)
        tar.extractall(dest)
    return dest


def newest_step(run_dir):
    """The highest step among the committed checkpoints (those with a MANIFEST.json) of one durable run dir."""
    best = -1
    ckpts = os.path.join(run_dir, "checkpoints")
    for name in sorted(os.listdir(ckpts)) if os.path.isdir(ckpts) else []:
        try:
            with open(os.path.join(ckpts, name, "MANIFEST.json")) as f:
                text = f.read(MANIFEST_MAX_BYTES + 1)
            step = json.loads(text).get("step") if len(text) <= MANIFEST_MAX_BYTES else None
        except (OSError, ValueError, AttributeError, RecursionError):  # a manifest nested 100,000 deep: no step
            continue
        if isinstance(step, int) and not isinstance(step, bool):
            best = max(best, step)
    return best


def find_previous(input_dir, run, slug):
    """The copy of onbox-durable/<run> in the kernel's own previous output under the inputs whose newest committed
    step is highest (None when there is none). Only a copy with the kernel's slug in its path counts: a dataset
    the kernel also mounts (--dataset, anyone's to publish) must not hand the session a checkpoint (a pickle the
    trainer loads) by holding an onbox-durable/<run> of its own. Bounded: SEARCH_DEPTH levels, directories only,
    no symlinks followed."""
    found = []
    base_depth = input_dir.rstrip(os.sep).count(os.sep)
    for dirpath, dirnames, _ in os.walk(input_dir):
        if os.path.basename(dirpath) == DURABLE_DIR:
            dirnames[:] = []
            mount = os.path.relpath(dirpath, input_dir).split(os.sep)[:-1]
            here = os.path.join(dirpath, run)
            if slug in mount and os.path.isdir(here) and not os.path.islink(here):
                found.append(here)
            continue
        if dirpath.count(os.sep) - base_depth >= SEARCH_DEPTH:
            dirnames[:] = []
        dirnames.sort()
    if not found:
        return None
    return max(found, key=newest_step)


def not_plain(dirpath, names):
    """What a seed copy leaves out (shutil.copytree's `ignore`): symlinks, FIFOs, devices. The previous output is
    what the previous session's code wrote: a link in the run's durable tree could point the agent's reads and
    writes anywhere, a FIFO hang the copy."""
    out = []
    for name in names:
        mode = os.lstat(os.path.join(dirpath, name)).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            out.append(name)
    if out:
        say("left out of the copy of %s (not plain files): %s" % (dirpath, ", ".join(repr(n) for n in out[:5])))
    return out


def make_writable(tree):
    """A copy of a read-only mount keeps its modes: the agent must be able to rename and retire in it."""
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
            if not os.path.islink(name):
                os.chmod(name, os.stat(name).st_mode | 0o200)


def seed(lay, run):
    """Copy the previous version's committed run into /kaggle/working/onbox-durable/<run> unless it is there.
    Returns what was done, for the outcome record."""
    target_root = os.path.join(lay["working"], DURABLE_DIR)
    target = os.path.join(target_root, run)
    if os.path.isdir(target):
        say("%s already holds run %s: it is continued from there" % (target_root, run))
        return {"seeded": False, "from": target, "step": newest_step(target)}
    slug = str(SPEC.get("kernel") or "/").split("/", 1)[1]
    source = find_previous(lay["input"], run, slug) if os.path.isdir(lay["input"]) else None
    if source is None:
        say("no earlier output of run %s under %s: it starts from scratch" % (run, lay["input"]))
        return {"seeded": False, "from": None, "step": None}
    os.makedirs(target_root, exist_ok=True)
    staging = os.path.join(target_root, ".onbox-seed-" + run)
    if os.path.exists(staging):
        shutil.rmtree(staging)
    shutil.copytree(source, staging, symlinks=True, ignore=not_plain)
    make_writable(staging)
    os.rename(staging, target)  # whole or not at all: the agent never sees half a copy
    step = newest_step(target)
    say("copied run %s from the previous output %s (newest committed step %s) to %s"
        % (run, source, step if step >= 0 else "none", target_root))
    return {"seeded": True, "from": source, "step": step}


def agent_argv(pyz, durable, ckpt_dir):
    argv = [sys.executable, pyz, "run", "--foreground", "--name", SPEC["run"], "--profile", "kaggle",
            "--durable", durable, "--ckpt-dir", ckpt_dir]
    for arg in SPEC.get("resume_args") or []:
        argv.append("--resume-arg=" + arg)
    return argv + list(SPEC.get("onbox_args") or []) + ["--"] + list(SPEC["command"])


def run_agent(argv, env, cwd):
    """The agent in the foreground; the session's stop signals are passed on to it (it checkpoints on them)."""
    child = subprocess.Popen(argv, env=env, cwd=cwd)

    def forward(signum, _frame):
        try:
            child.send_signal(signum)
        except OSError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    while True:
        try:
            return child.wait()
        except KeyboardInterrupt:  # a SIGINT raced the handler's installation: the child has it too
            continue


def last_exit(pyz, env):
    """The run's last exit as the agent records it (`onbox status RUN --json`), or None when it cannot say."""
    try:
        done = subprocess.run([sys.executable, pyz, "status", SPEC["run"], "--json"], env=env, capture_output=True,
                              timeout=STATUS_TIMEOUT)
        doc = json.loads(done.stdout.decode("utf-8", "replace"))
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    runs = doc.get("runs") if isinstance(doc, dict) else None
    run = runs[0] if isinstance(runs, list) and runs and isinstance(runs[0], dict) else doc
    return run.get("last_exit") if isinstance(run, dict) else None


def outcome_of(rc, last):
    if rc == 0:
        return "done"
    if rc == 75:
        return "session_limit" if (last or {}).get("classification") == "session_limit" else "preempted"
    return "failed"


def main():
    started = time.time()
    env = dict(os.environ)
    lay = layout(env)
    run = SPEC["run"]
    os.makedirs(lay["scratch"], exist_ok=True)
    os.makedirs(lay["working"], exist_ok=True)
    pyz = unpack_pyz(lay["scratch"])
    workdir = unpack_code(lay["scratch"]) if CODE_B64 else lay["working"]
    env.setdefault("ONBOX_HOME", os.path.join(lay["scratch"], "home"))
    if SPEC.get("durable"):
        durable, seeded = SPEC["durable"], {"seeded": False, "from": SPEC["durable"], "step": None}
        say("run %s commits to and resumes from %s" % (run, durable))
    else:
        durable, seeded = os.path.join(lay["working"], DURABLE_DIR), seed(lay, run)
    argv = agent_argv(pyz, durable, os.path.join(lay["scratch"], "ckpt"))
    say("running %s (onbox %s) in %s" % (" ".join(SPEC["command"]), SPEC.get("onbox_version", "?"), workdir))
    rc = run_agent(argv, env, workdir)
    last = last_exit(pyz, env)
    doc = {"schema": OUTCOME_SCHEMA, "run": run, "kernel": SPEC.get("kernel"), "outcome": outcome_of(rc, last),
           "exit_code": rc, "last_exit": last, "durable": durable, "seed": seeded, "started_at": started,
           "ended_at": time.time()}
    with open(os.path.join(lay["working"], OUTCOME_FILE + ".tmp"), "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    os.replace(os.path.join(lay["working"], OUTCOME_FILE + ".tmp"), os.path.join(lay["working"], OUTCOME_FILE))
    say(json.dumps({k: doc[k] for k in ("schema", "run", "outcome", "exit_code")}, sort_keys=True))
    if doc["outcome"] == "session_limit":
        say("the session's clock stopped run %s after its final commit: push again to continue it "
            "(onboxctl kaggle push ... --name %s)" % (run, run))
    return 0 if rc in (0, 75) else rc


if __name__ == "__main__":
    sys.exit(main())
