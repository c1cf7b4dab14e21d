"""What `onbox run` checks and says in the foreground, before anything is created or detached, beyond
RunConfig.validate: the child's secrets can be read, its program can be run, the paths it was given are places
onbox may scan and write, the name is not another run's, and the warnings a careless setup deserves (a secret on
the command line, a token file others can read, no checkpoint dir)."""
from __future__ import annotations

import os
import re
import shutil
import sys
from typing import Any, Dict, List, Optional

from onbox.errors import UnfitError, UsageError
from onbox.supervisor.rundir import RunDir

# Names that usually hold credentials (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, DB_PASSWORD, ...).
SECRET_NAME_RE = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD", re.IGNORECASE)
# Directories that are never a checkpoint dir: the agent scans every file of its checkpoint dir (and restores into
# it), and `--ckpt-dir "$OUT/"` with OUT unset is `/`. Compared with symlinks resolved (on a merged-/usr system
# /lib is /usr/lib, so that one is refused too).
SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/root",
               "/run", "/sbin", "/sys", "/usr", "/var")
# The system's own trees: nothing in them is a checkpoint dir or a durable dir either (`--ckpt-dir /usr/share`
# had the first attempt told to resume from /usr/share/glib-2.0; `--durable /usr/share` wrote leases there) ...
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/opt", "/proc", "/run",
                "/sbin", "/sys", "/usr", "/var")
# ... but for the places in them meant for users' files: /var/tmp (FHS: temporary files kept across reboots,
# writable by every user; Slurm sites and TMPDIR use it) and /dev/shm (RAM-backed scratch some trainers save to) ...
USER_PLACES = ("/var/tmp", "/dev/shm")
# ... and, in these, a filesystem mounted below them: a data disk. AWS's Deep Learning AMI mounts the instance NVMe
# at /opt/dlami/nvme (profiles/aws.toml), SageMaker mounts /opt/ml, udisks /run/media/<user>/<disk>.
DATA_DISK_TREES = ("/opt", "/run", "/var")
DURABLE_HINT = ("give --durable a directory on a disk that outlives the box (a mounted volume: /workspace/durable, "
                "/mnt/..., a network disk) or an rclone remote:path")
CKPT_DIR_HINT = ("give --ckpt-dir the directory your trainer saves its checkpoints in (e.g. /workspace/ckpt), or "
                 "leave it out: the run then has <run dir>/checkpoints, which the trainer finds in $ONBOX_CKPT_DIR")


def check_paths(cfg: Any, run_dir: str) -> None:
    """The paths of a run, made absolute: still within the system's limits, a checkpoint dir onbox can scan without
    reading the machine or its own state, and no file the agent writes inside $ONBOX_HOME (UsageError, exit 2)."""
    from onbox.config import check_path, is_remote

    for key in ("ckpt_dir", "heartbeat_file", "workdir"):
        if getattr(cfg, key):
            check_path(key, getattr(cfg, key))
    if cfg.durable and not is_remote(cfg.durable):
        check_path("durable", cfg.durable)
        problem = durable_problem(cfg.durable)
        if problem:
            raise UsageError("--durable %s %s" % (cfg.durable, problem), hint=DURABLE_HINT)
    if cfg.ckpt_dir:
        problem = ckpt_dir_problem(cfg.ckpt_dir, run_dir)
        if problem:
            raise UsageError("--ckpt-dir %s %s" % (cfg.ckpt_dir, problem), hint=CKPT_DIR_HINT)
    if cfg.heartbeat_file:
        problem = written_file_problem(cfg.heartbeat_file)
        if problem:
            raise UsageError("--heartbeat-file %s %s" % (cfg.heartbeat_file, problem),
                             hint="give it a path outside $ONBOX_HOME, e.g. on the durable dir")


def ckpt_dir_problem(ckpt_dir: str, run_dir: str) -> Optional[str]:
    """Why `ckpt_dir` (absolute) can never be a run's checkpoint dir, in words that follow its name; else None.
    Refused: the root, $ONBOX_HOME or anything in it (but the run's own <run dir>/checkpoints), a directory holding
    $ONBOX_HOME, the home directory, a system directory or anything in one (system_dir_problem). Symlinks are
    resolved first."""
    from onbox import paths
    from onbox.untrusted import is_under

    real = os.path.realpath(ckpt_dir)
    shown = _resolved(ckpt_dir, real)
    if real == "/":
        return "is the root of the filesystem%s: onbox would scan every file of the machine as a possible " \
               "checkpoint, and restore into it" % shown
    home = paths.onbox_home()
    if is_under(ckpt_dir, home):
        if real == os.path.realpath(os.path.join(run_dir, paths.CHECKPOINTS_DIR)):
            return None  # the run's own default, wherever ONBOX_HOME is
        return "is inside ONBOX_HOME (%s)%s, where onbox keeps its own state: run dirs and the heartbeat spool " \
               "would be committed as checkpoints" % (home, shown)
    if is_under(home, ckpt_dir):
        return "holds ONBOX_HOME (%s)%s: onbox's own state (run dirs, the heartbeat spool) would be scanned and " \
               "committed as checkpoints" % (home, shown)
    user_home = os.path.expanduser("~")
    if user_home not in ("", "~") and real == os.path.realpath(user_home):
        return "is your home directory%s: onbox would scan every file in it as a possible checkpoint" % shown
    if any(real == os.path.realpath(d) for d in SYSTEM_DIRS):
        return "is a system directory%s: onbox scans every file of its checkpoint dir and restores into it" % shown
    problem = system_dir_problem(real)
    if problem:
        return "%s%s: onbox scans every file of its checkpoint dir and restores into it" % (problem, shown)
    return None


def durable_problem(durable: str) -> Optional[str]:
    """Why the mounted path `durable` (absolute) can never be a durable target, in words that follow its name; else
    None: the root (`--durable "$DIR/"` with DIR unset), a system directory or anything in one. Symlinks are
    resolved first."""
    real = os.path.realpath(durable)
    shown = _resolved(durable, real)
    if real == "/":
        return "is the root of the filesystem%s: the run's checkpoints, leases and logs would go to /<run> on " \
               "the system disk, which is not durable storage" % shown
    problem = system_dir_problem(real)
    if problem:
        return "%s%s: the run's checkpoints, leases and logs would be written among the system's files" % (
            problem, shown)
    return None


def system_dir_problem(real: str) -> Optional[str]:
    """"is a system directory" or "is inside the system directory /usr" for the resolved path `real` when it is
    one of SYSTEM_TREES or lies in one (not in a USER_PLACES entry or the user's home, nor on a data disk mounted
    inside one of DATA_DISK_TREES); else None."""
    from onbox.untrusted import is_under

    for tree in SYSTEM_TREES:
        top = os.path.realpath(tree)
        if top == "/" or not is_under(real, top):
            continue
        if any(is_under(real, place) for place in _user_places()):
            return None
        if tree in DATA_DISK_TREES and real != top and _on_a_disk_of_its_own(real, top):
            continue
        return "is a system directory" if real == top else "is inside the system directory %s" % tree
    return None


def _user_places() -> List[str]:
    """USER_PLACES, and the user's home directory where it lies in a system tree (a service account's home such as
    /var/lib/jenkins): what is in it is the user's own."""
    given = os.path.expanduser("~")
    home = os.path.realpath(given)
    tops = {os.path.realpath(d) for d in SYSTEM_TREES + SYSTEM_DIRS}
    return list(USER_PLACES) + ([home] if os.path.isabs(given) and home != "/" and home not in tops else [])


def _on_a_disk_of_its_own(real: str, top: str) -> bool:
    """`real` (or its nearest existing ancestor: it may be created later) is on another filesystem than `top`: a
    disk mounted inside a system tree."""
    from onbox.fsutil import nearest_existing

    try:
        return os.stat(nearest_existing(real)).st_dev != os.stat(top).st_dev
    except OSError:
        return False


def _resolved(path: str, real: str) -> str:
    """" (X, symlinks resolved)" when resolving symlinks changed `path`, else ""."""
    return "" if real == os.path.normpath(path) else " (%s, symlinks resolved)" % real


def written_file_problem(path: str) -> Optional[str]:
    """Why the agent must not write the file `path` (absolute), in words that follow its name; else None: inside
    $ONBOX_HOME it could be a run's state.json, config.json or events.jsonl (or a secret), and appending to it
    corrupts what onbox reads back."""
    from onbox import paths
    from onbox.untrusted import is_under

    home = paths.onbox_home()
    if is_under(path, home):
        real = os.path.realpath(path)
        return "is inside ONBOX_HOME (%s)%s, where onbox keeps its own state: writing it could corrupt a run's " \
               "state.json or events" % (home, "" if real == os.path.normpath(path) else
                                         " (%s, symlinks resolved)" % real)
    return None


def check_executable(exe: str, workdir: str, env: Dict[str, str]) -> None:
    """The program the run starts exists and may be executed (a relative path is from `workdir`, a bare name is
    looked up on the PATH of `env`)."""
    if os.sep in exe:
        path = exe if os.path.isabs(exe) else os.path.join(workdir, exe)
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise UsageError("cannot run %s: no such executable file (missing, or not chmod +x)" % exe,
                             hint="check the path (relative paths are from %s)" % workdir)
        return
    if shutil.which(exe, path=env.get("PATH", os.defpath)) is None:
        raise UsageError("cannot run %s: not found on PATH" % exe,
                         hint="give the full path, or fix PATH (the agent uses this shell's PATH)")


def check_runs_dir(runs: str) -> None:
    """Refuse early, nothing created: a runs directory under a regular file (exit 2: ONBOX_HOME names a file) or
    in a directory no file can be created in (exit 3, unwritable_home)."""
    from onbox.fsutil import is_writable_dir, nearest_existing

    probe = nearest_existing(runs)
    if not os.path.isdir(probe):
        raise UsageError("the runs directory %s is not writable: %s is not a directory" % (runs, probe),
                         hint="set ONBOX_HOME to a directory (unset, it is ~/.onbox)")
    if not is_writable_dir(probe):  # access(2) lies for root and read-only mounts
        raise unwritable_home(probe)
    if sys.platform != "linux":  # pragma: no cover
        raise UsageError("onbox runs jobs on Linux only")


def unwritable_home(where: str) -> UnfitError:
    """ONBOX_HOME cannot take a file at `where` (exit 3: the environment is unfit, the input was fine): read-only,
    full, or not this user's to write; the message names it and the fix."""
    from onbox import fsutil, paths

    home = paths.onbox_home()
    why = fsutil.space_problem(where)
    if why == "read-only":
        return UnfitError("ONBOX_HOME %s is read-only: nothing can be created in %s" % (home, where),
                          hint="remount its filesystem read-write, or set ONBOX_HOME to a writable directory "
                               "(e.g. export ONBOX_HOME=/workspace/.onbox)")
    if why:
        return UnfitError("ONBOX_HOME %s is %s: nothing can be created in %s" % (home, why, where),
                          hint="free space there (`df -h %s`, `df -i %s`), or set ONBOX_HOME to a directory on "
                               "another disk" % (home, home))
    return UnfitError("ONBOX_HOME %s is not writable by this user (uid %d): nothing can be created in %s" % (
        home, os.geteuid(), where), hint="fix its owner or permissions, or set ONBOX_HOME to a directory you can "
                                         "write (e.g. export ONBOX_HOME=~/.onbox)")


RECORDED = ("command", "ckpt_dir", "durable")  # what makes a run this run: another one needs another name


def check_same_run(cfg: Any, rd: RunDir) -> None:
    """A different command (or checkpoint dir, or durable target) under the name of an existing run would
    continue that run and be handed its checkpoint: refused (exit 2) unless --resume says it is meant."""
    hint = "give the new run another --name, or move %s away" % rd.path
    try:
        saved = rd.load_config()
    except FileNotFoundError:
        return
    except TypeError:
        raise UsageError("the record of the existing run %s is not a JSON object" % rd.config_path, hint=hint)
    except (OSError, ValueError) as e:
        raise UsageError("cannot read the record of the existing run %s: %s" % (rd.config_path, e), hint=hint)
    differ = [k for k in RECORDED if (saved.get(k) or None) != (getattr(cfg, k) or None)]
    if differ:
        was = "; ".join("%s was %s" % (k, _shown(saved.get(k))) for k in differ)
        raise UsageError("run %s already exists with another %s (%s)" % (cfg.name, " and ".join(differ), was),
                         hint="give this run a new --name, or pass --resume to continue %s (and its "
                              "checkpoints) with the new settings on purpose" % cfg.name)


def _shown(value: Any) -> str:
    if isinstance(value, list):
        import shlex

        return shlex.join(str(v) for v in value)
    return str(value) if value else "unset"


def check_child_secrets(cfg: Any) -> None:
    """Every --env-file and --secret readable and well-formed now; the values are read and dropped (the agent
    reads them again when each attempt starts, so they never travel in argv or config.json)."""
    from onbox.supervisor.childenv import secret_env

    secret_env(cfg.env_files, cfg.secrets)


def warnings(cli_env: Dict[str, str], cfg: Any) -> List[str]:
    """One line each, for stderr: setups that work but leak (U34), and a run without --ckpt-dir (onbox then
    commits only what the trainer writes where $ONBOX_CKPT_DIR points)."""
    from onbox import fsutil, paths
    from onbox.config import parse_secret_spec

    out = []
    leaky = sorted(k for k in cli_env if SECRET_NAME_RE.search(k))
    if leaky:
        out.append("--env %s look%s like a secret: the value stays in this agent's command line (`ps` shows it for "
                   "the whole run) and in config.json; use --secret %s (the file %s) or --env-file PATH instead" % (
                       ", ".join(leaky), "s" if len(leaky) == 1 else "", leaky[0],
                       os.path.join(paths.secrets_dir(), leaky[0])))
    files = [("the tracker token file", cfg.tracker_token_file)] if cfg.tracker_token_file else []
    files += [("the MLflow token file", cfg.mlflow_token_file)] if cfg.mlflow_token_file else []
    files += [("the --env-file", p) for p in cfg.env_files]
    files += [("the secret", os.path.join(paths.secrets_dir(), parse_secret_spec(s)[1])) for s in cfg.secrets]
    for what, path in files:
        mode = fsutil.readable_by_others(path)
        if mode is not None:
            out.append("%s %s is readable by %s (mode %04o): `chmod 600 %s`" % (
                what, path, "everyone" if mode & 0o004 else "its group", mode, path))
    if not cfg.ckpt_dir:
        out.append("no --ckpt-dir: onbox commits and restores only what the trainer writes to $ONBOX_CKPT_DIR (%s); "
                   "point the trainer there, or give --ckpt-dir its output dir"
                   % os.path.join(paths.run_dir(cfg.name), paths.CHECKPOINTS_DIR))
    return out


def node_group(cfg: Any) -> Any:
    """`--node-group PATH|-`: the group (from stdin with `-`, then returned to be stored), its rendezvous put into
    the job's environment (NNODES, NODE_RANK, MASTER_ADDR/PORT, torchrun's PET_*)."""
    from onbox.multinode.role import MAX_DOC_BYTES, child_vars, load_group, read_group_stream
    from onbox.subsystems import node_preflight

    if not cfg.node_group:
        return None
    if cfg.node_group == "-":
        group = read_group_stream(sys.stdin.buffer.read(MAX_DOC_BYTES + 1), "stdin")  # `< /dev/zero` ends here
    else:
        cfg.node_group = os.path.abspath(os.path.expanduser(cfg.node_group))
        group = load_group(cfg.node_group)
    if group.rank == 0 and cfg.name != group.run:
        raise UsageError("node 0 of group %s must run as %s, not %s" % (group.group, group.run, cfg.name),
                         hint="the other nodes restore what node 0 commits under <durable>/%s" % group.run)
    node_preflight(group)
    shared_durable_check(cfg, group)
    cfg.env.update(child_vars(group))
    return group if cfg.node_group == "-" else None


def check_container(cfg: Any) -> None:
    """--docker with a command to run inside, or a `docker run` the agent can supervise (attached)."""
    from onbox.launch.container import check_client_command, is_client_command

    if cfg.docker_image and is_client_command(cfg.command):
        raise UsageError("--docker IMAGE builds the `docker run` line itself: give it the command to run inside",
                         hint="onbox run --docker IMAGE -- python train.py (or drop --docker and keep your line)")
    if is_client_command(cfg.command):
        check_client_command(cfg.command)


GROUP_MARK = ".onbox-group"


def shared_durable_check(cfg: Any, group: Any) -> None:
    """The other nodes restore what node 0 commits: they must see node 0's durable target. On a mounted path,
    node 0 (launched first) writes the group's id into <durable>/<run>/.onbox-group and every other node must
    read the same id there; a path that is only node 0's local disk fails here, before the job starts. An rclone
    remote is the same for every node by its name."""
    from onbox import fsutil, untrusted

    if not cfg.durable or not os.path.isabs(cfg.durable):
        return
    mark = os.path.join(cfg.durable, group.run, GROUP_MARK)
    if group.rank == 0:
        try:
            os.makedirs(os.path.dirname(mark), exist_ok=True)
            fsutil.atomic_write(mark, group.group + "\n")
        except OSError as e:
            raise UnfitError("cannot write %s: %s" % (mark, e.strerror or e),
                             hint="give --durable a writable directory")
        return
    try:  # a shared disk others write to: a bounded read of a regular file only
        seen: Optional[str] = untrusted.read_text(mark, 1024, "group mark").strip()
    except (OSError, ValueError):
        seen = None
    if seen != group.group:
        raise UnfitError("node %d does not see node 0's durable target: %s %s" % (
            group.rank, mark, "holds another group's id" if seen else "is missing"),
            hint="every node restores what node 0 commits: give --durable an rclone remote (remote:path) or a "
                 "directory all nodes mount, and launch node 0 first (onboxctl does)")
