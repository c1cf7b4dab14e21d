"""Training in a container: `onbox run --docker IMAGE -- CMD`, or `onbox run -- docker run ... IMAGE CMD`.

The child the agent supervises is the container's foreground client, `docker run` without `-d`: its exit code is
the trainer's, its output goes to the run's log, and it forwards the signals it gets to the container
(`--sig-proxy`, on by default for an attached client), where `--init` (a tiny init as PID 1) hands them to the
trainer: a trainer running as PID 1 itself would never see a TERM it has no handler for. What a client cannot do
is proxy SIGKILL, and a client that died leaves its container running: so when the agent escalates to KILL, and
after every attempt, it stops the container itself through the daemon, by the name and the cidfile it gave the
attempt (`docker kill`, `docker stop --time T`, each bounded). The stop comes as soon as the client's exit is seen,
whatever the run's settings, and before the agent clears the attempt's leftover processes from the host: the
daemon stops every process of the container, one TERM through its init, where the host-side sweep would TERM the
init and the trainer both (a trainer that takes a second TERM for "quit now" would abandon its save).

`--docker IMAGE` builds the line (docker_argv):
- GPUs: `--gpus all` (U31: a container launched without it trains on the CPU, silently 100x slower), or only the
  devices CUDA_VISIBLE_DEVICES names (`--gpus "device=0,1"`; inside, they are numbered from 0 again, so the
  variable itself is not passed on);
- `--shm-size` (default 16g): docker gives a container 64 MB of /dev/shm, and DataLoader workers hand every batch
  to the trainer through it; they die with a bus error once it is full (no gotcha of the catalogue names this one;
  U9 is its neighbour: workers multiply memory);
- the checkpoint dir, the run dir (ONBOX_METRICS_FILE, ONBOX_PREEMPT_FILE), a durable dir on a mounted path and
  the workdir, each mounted at the same path, so every ONBOX_* path means the same inside and out;
- `-e NAME` for each variable the agent sets for the job (the ONBOX_* contract with ONBOX_RESUME_FROM and
  ONBOX_CKPT_DIR, --env, --env-file, --secret, the node group's rendezvous): by name only, the CLI reads the
  values from its own environment, so no value (no secret, U34) is ever in an argv;
- `--init`, `--rm`, a name and a cidfile per attempt (`onbox-<run>-<attempt>`, `<run dir>/containers/<n>.cid`),
  labels onbox.run / onbox.attempt; `--network host` for a node of a multi-node group (torchrun's rendezvous and
  NCCL need the nodes' own addresses); then --docker-arg options as given, the image and the command.
Pin the image by digest (U30: a tag moves).
"""
from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
from typing import Any, Callable, List, Mapping, Optional, Sequence

from onbox import paths, toolrun, untrusted
from onbox.config import CONTRACT_VARS
from onbox.errors import UsageError
from onbox.proc import ProcRef, Stopped

DOCKER_TIMEOUT = 30.0  # seconds a docker CLI call may take beyond its own stop time
CIDFILE_MAX_BYTES = 4096  # docker writes one 64-hex-digit id
# `docker run` options that take no value: everything else takes one (or carries it after '=')
BOOL_LONG = {"--rm", "--init", "--detach", "--interactive", "--tty", "--privileged", "--publish-all", "--read-only",
             "--sig-proxy", "--no-healthcheck", "--oom-kill-disable", "--quiet", "--disable-content-trust"}
BOOL_SHORT = set("ditPq")
NOT_PASSED = ("CUDA_VISIBLE_DEVICES",)
# the child contract (config.CONTRACT_VARS, set by childenv.py): always passed, even where the agent's environment
# agrees
CONTRACT = tuple(CONTRACT_VARS)


def container_name(run: str, attempt: int) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "-", run)
    return "onbox-%s-%d" % (safe, attempt)


def cidfile_path(run_dir: str, attempt: int) -> str:
    return os.path.join(run_dir, paths.CONTAINERS_DIR, "%d.cid" % attempt)


def is_client_command(command: Sequence[str]) -> bool:
    """The command is itself a `docker run ...`: the agent supervises that client."""
    return len(command) >= 2 and os.path.basename(command[0]) == "docker" and command[1] == "run"


def split_run_options(args: Sequence[str]) -> int:
    """Index of the image in the words after `docker run` (len(args) when there is none)."""
    i = 0
    while i < len(args):
        tok = args[i]
        if tok == "--":
            return i + 1
        if tok.startswith("--"):
            i += 1 if ("=" in tok or tok in BOOL_LONG) else 2
        elif tok.startswith("-") and len(tok) > 1:
            flags = tok[1:]
            j = next((k for k, c in enumerate(flags) if c not in BOOL_SHORT), None)
            # -it: flags only; -v X / -itv X: the value is the next word; -v/x:/x: glued to the option
            i += 2 if j == len(flags) - 1 else 1
        else:
            return i
    return len(args)


def check_client_command(command: Sequence[str]) -> None:
    """A `docker run` the agent can supervise: attached (no -d), so its exit is the trainer's."""
    opts = list(command[2:2 + split_run_options(command[2:])])
    for tok in opts:
        if tok in ("--detach", "--detach=true") or (tok.startswith("-") and not tok.startswith("--")
                                                      and "d" in tok[1:] and set(tok[1:]) <= BOOL_SHORT):
            raise UsageError("`docker run -d` detaches the container: onbox would see the client exit at once "
                             "and the job run unsupervised", hint="drop -d/--detach: onbox detaches itself and keeps "
                             "the client in the foreground")


def gpu_option(env: Mapping[str, str]) -> List[str]:
    """`--gpus all`, or the devices CUDA_VISIBLE_DEVICES names, or none when it names none."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return ["--gpus", "all"]  # U31
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    if not devices or devices == ["-1"]:
        return []
    return ["--gpus", '"device=%s"' % ",".join(devices)]


def passed_names(env: Mapping[str, str], agent_env: Mapping[str, str]) -> List[str]:
    """The variables the job gets from the agent (not those of the agent's own environment): names only."""
    return sorted(k for k, v in env.items() if k not in NOT_PASSED and (k in CONTRACT or agent_env.get(k) != v))


def mounts(paths: Sequence[Optional[str]]) -> List[str]:
    """`-v P:P` for each distinct path, skipping one inside another already mounted."""
    chosen: List[str] = []
    for p in sorted({os.path.abspath(p) for p in paths if p}, key=len):
        if not any(p == c or p.startswith(c.rstrip("/") + "/") for c in chosen):
            chosen.append(p)
    out: List[str] = []
    for p in sorted(chosen):
        out += ["-v", "%s:%s" % (p, p)]
    return out


def docker_argv(cfg: Any, command: Sequence[str], env: Mapping[str, str], agent_env: Mapping[str, str],
                run: str, run_dir: str, ckpt_dir: str, attempt: int, docker: str = "docker") -> List[str]:
    """The `docker run` line for one attempt of `--docker IMAGE` (module docstring)."""
    extra = list(cfg.docker_args)
    has = lambda *opts: any(a == o or a.startswith(o + "=") for a in extra for o in opts)  # noqa: E731
    durable = cfg.durable if cfg.durable and os.path.isabs(cfg.durable) else None
    argv = [docker, "run", "--rm", "--init", "--name", container_name(run, attempt),
            "--cidfile", cidfile_path(run_dir, attempt),
            "--label", "onbox.run=%s" % run, "--label", "onbox.attempt=%d" % attempt]
    if not has("--shm-size", "--ipc"):
        argv += ["--shm-size", cfg.docker_shm_size]
    if not has("--gpus", "--runtime"):
        argv += gpu_option(env)
    if cfg.node_group and not has("--network", "--net"):
        argv += ["--network", "host"]
    argv += mounts([ckpt_dir, run_dir, durable, cfg.workdir])
    if cfg.workdir and not has("-w", "--workdir"):
        argv += ["-w", cfg.workdir]
    for name in passed_names(env, agent_env):
        argv += ["-e", name]
    return argv + extra + [cfg.docker_image, *command]


def client_argv(command: Sequence[str], cidfile: str) -> List[str]:
    """The user's `docker run`, with a cidfile the agent can stop the container by (unless it names one)."""
    opts = command[2:2 + split_run_options(command[2:])]
    if any(a == "--cidfile" or a.startswith("--cidfile=") for a in opts):
        return list(command)
    return [command[0], "run", "--cidfile", cidfile, *command[2:]]


Runner = Callable[..., "subprocess.CompletedProcess[str]"]


class ContainerSeam:
    """The ProcessSeam for a container job: spawn builds (or completes) the `docker run` line; a KILL to the
    client's group also kills the container; clearing an attempt's session also stops its container."""

    def __init__(self, inner: Any, cfg: Any, run: str, run_dir: str, ckpt_dir: str,
                 agent_env: Mapping[str, str], log: Callable[[str], None] = lambda m: None,
                 runner: Optional[Runner] = None) -> None:
        self.inner = inner
        self.cfg = cfg
        self.run = run
        self.run_dir = run_dir
        self.ckpt_dir = ckpt_dir
        self.agent_env = dict(agent_env)
        self.log = log
        self.runner = runner or toolrun.call
        self.docker = cfg.command[0] if is_client_command(cfg.command) and not cfg.docker_image else "docker"
        self.current: Optional[str] = None  # name or cidfile of the attempt's container
        self.stopped: Optional[str] = None  # the container this seam already stopped (once per attempt)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # adopt, signal_pid, session_members, reap_zombies

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Optional[str], log_path: str) -> Any:
        # An earlier attempt's container that outlived its agent and client (both killed: an OOM kill, a crash)
        # trains on: stopped first, whatever reap_orphans says, or two trainers write one checkpoint dir.
        self.stop_container(float(self.cfg.term_timeout))
        n = int(env.get("ONBOX_RESTART_COUNT") or 0)
        cid = cidfile_path(self.run_dir, n)
        os.makedirs(os.path.dirname(cid), mode=0o700, exist_ok=True)
        if os.path.exists(cid):  # docker refuses to overwrite one: a leftover of an attempt of the same number
            os.unlink(cid)
        if self.cfg.docker_image:
            argv = docker_argv(self.cfg, argv, env, self.agent_env, self.run, self.run_dir, self.ckpt_dir, n)
            self.current = container_name(self.run, n)
        else:
            argv = client_argv(argv, cid)
            self.current = None  # the cidfile names it once docker created it
        self.stopped = None
        return self.inner.spawn(argv, env, cwd, log_path)

    def poll(self, child: Any) -> Any:
        """The client's exit status; once it has ended, its container is stopped (a client that was killed, by
        the OOM killer or by hand, leaves its container training on, unsupervised)."""
        status = self.inner.poll(child)
        if status is not None:
            self.stop_container(float(self.cfg.term_timeout))
        return status

    def _ref(self) -> Optional[str]:
        """The attempt's container: its name, else the id in the newest cidfile (also after an agent restart)."""
        if self.current:
            return self.current
        files = sorted(glob.glob(os.path.join(self.run_dir, paths.CONTAINERS_DIR, "*.cid")),
                       key=lambda p: int(re.sub(r"\D", "", os.path.basename(p)) or 0))
        for path in reversed(files):
            try:  # bounded, regular files only: a FIFO in the run dir must not hang the agent's stop path
                cid = untrusted.read_text(path, CIDFILE_MAX_BYTES, "cidfile").strip()
            except (OSError, ValueError):
                continue
            if re.match(r"^[0-9a-f]{12,64}$", cid):
                return cid
        return None

    def _docker(self, args: List[str], timeout: float) -> bool:
        """One bounded docker CLI call; True when it did its work or the container is already gone."""
        argv = [self.docker, *args]
        try:
            cp = self.runner(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            self.log("`%s` failed: %s" % (" ".join(argv), e))
            return False
        err = (cp.stderr or "").strip()
        if cp.returncode != 0 and "No such container" not in err:
            self.log("`%s` exited %d: %s" % (" ".join(argv), cp.returncode, err[-300:]))
            return False
        return True

    def signal_group(self, pgid: int, sig: int) -> bool:
        ok = self.inner.signal_group(pgid, sig)
        ref = self._ref()
        if sig == signal.SIGKILL and ref:  # a client cannot proxy KILL: the daemon delivers it
            self._docker(["kill", "--signal", "KILL", ref], DOCKER_TIMEOUT)
        return bool(ok)

    def kill_session(self, sid: int, timeout: float, log: Optional[Callable[[str], None]] = None,
                     leader_start: Optional[int] = None, also: Optional[Callable[[], List[ProcRef]]] = None,
                     on_step: Optional[Callable[[str, List[ProcRef], Stopped], None]] = None) -> Stopped:
        self.stop_container(timeout)  # first: the daemon stops the container through its init (module docstring)
        found: Stopped = self.inner.kill_session(sid, timeout, log=log, leader_start=leader_start, also=also,
                                                 on_step=on_step)
        return found

    def stop_container(self, timeout: float) -> None:
        """The attempt's container is gone afterwards: `docker stop --time T` (TERM, then KILL after T seconds);
        a no-op (one quick CLI call) when it already went with its client, none when this seam stopped it."""
        ref = self._ref()
        if not ref or ref == self.stopped:
            return
        if self._docker(["stop", "--time", str(int(max(0, timeout))), ref], timeout + DOCKER_TIMEOUT):
            self.stopped = ref  # a failed stop is tried again when the attempt's leftovers are cleared


def seam_for(cfg: Any, rd: Any, ckpt_dir: str, agent_env: Mapping[str, str],
             log: Callable[[str], None]) -> Optional[ContainerSeam]:
    """The container seam when the run is a container job, else None (the plain ProcessSeam)."""
    if not cfg.docker_image and not is_client_command(cfg.command):
        return None
    from onbox import paths
    from onbox.supervisor.shim import KeptProcessSeam

    # the docker client under its keeper, as any attempt's child (shim.py): its exit outlives the agent
    return ContainerSeam(KeptProcessSeam(rd.file(paths.CHILD_EXIT_FILE)), cfg, rd.name, rd.path, ckpt_dir, agent_env,
                         log=log)

