"""Launch `onbox run` on boxes, detached, and return at once, in parallel over several boxes.

The box's agent does the detaching (it survives our ssh session, U1-U3); here we only start it, read back the
run it reports, and probe it in a SEPARATE call (U4: never chain a kill or a probe into the launching command).
Several boxes run in parallel with a bound on concurrency.
`check_job_options`: what the box's `onbox run` would refuse of the job's options (secrets, files on the box,
MLflow), refused here before any ssh.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import shlex
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from controller.boxes.agent import REMOTE_PUSHED, REMOTE_PYZ, parse_json_any
from controller.boxes.inventory import Box
from controller.boxes.ssh import Ssh
from onbox import untrusted
from onbox.errors import JobFailed, OnboxError, UnfitError, UsageError
from onbox.paths import valid_run_name


@dataclasses.dataclass
class LaunchResult:
    box: str
    name: str
    ok: bool
    pid: Optional[int] = None
    state: Optional[str] = None
    run_dir: Optional[str] = None
    workdir: Optional[str] = None
    error: Optional[str] = None
    hint: Optional[str] = None
    exit_code: int = 0
    seconds: float = 0.0
    tracker: Optional[str] = None  # the tracker URL the agent on the box was given
    tunnel: Optional[Dict[str, Any]] = None  # the reverse tunnel that URL goes through (controller/boxes/tunnel.py)
    # which run this launch is, and why (controller/launch/relaunch.py): resumed, new, or named by --name
    match: Optional[Dict[str, Any]] = None
    # what the agent recorded as making the run this run (command, workdir, durable, ckpt_dir): the launch log's
    recorded: Optional[Dict[str, Any]] = None

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def not_started(self) -> str:
        """A launch that started nothing, in words: `refused` when the agent or this launch said no (exit 2: a
        live run, a held lease, a bad input), else that no run started and why. The run's name only where the
        reason names it: a run that never started does not exist."""
        return ("refused, nothing started: %s" if self.exit_code == 2 else "no run started: %s") % self.error


def remote_env(ssh: Ssh, box: Box) -> Tuple[str, Dict[str, Any]]:
    """The box's home directory and its last push record (one short call)."""
    res = ssh.run(box.target(), script='printf "%%s\\n" "$HOME"; [ -f %s ] || echo NO-PYZ; cat %s 2>/dev/null || true'
                  % (REMOTE_PYZ, REMOTE_PUSHED), timeout=30, what="read the push record")
    home, _, rest = res.text.partition("\n")
    if rest.startswith("NO-PYZ"):
        raise UsageError("onbox.pyz is not on box %s yet" % box.name, hint="push it first: onboxctl push %s" % box.name)
    try:
        pushed = untrusted.loads_json(rest, "the push record") if rest.strip() else {}
    except ValueError:
        pushed = {}
    return home.strip(), pushed if isinstance(pushed, dict) else {}


def onbox_run_argv(box: Box, home: str, name: str, cmd: Sequence[str], onbox_args: Sequence[str]) -> List[str]:
    pyz = "%s/%s" % (home.rstrip("/"), REMOTE_PYZ)
    return [box.python, pyz, "run", "--json", "--name", name, *onbox_args, "--", *cmd]


def box_workdir(home: str, pushed: Dict[str, Any], workdir: Optional[str]) -> str:
    """The directory a launch runs in on the box: --workdir, else the last pushed code dir, else the home."""
    wd = workdir or pushed.get("code") or ""
    if wd and not isinstance(wd, str):
        wd = ""
    if wd and not wd.startswith("/"):
        wd = "%s/%s" % (home.rstrip("/"), wd)
    return wd or home


def box_script(box: Box, workdir: str, argv: Sequence[str], onbox_env: Optional[Dict[str, str]]) -> str:
    """`cd DIR && exec env ONBOX_X=.. ARGV`: an onbox command in the directory and environment of a launch. Run
    settings without a flag of their own travel as ONBOX_<FIELD> (onbox/config.py env layer); ONBOX_BOX: heartbeats
    carry the inventory's name for the box, so `status` matches `box ls`."""
    envs = ["%s=%s" % (k, v) for k, v in sorted(dict({"ONBOX_BOX": box.name}, **(onbox_env or {})).items())]
    return ("cd %s && exec " % shlex.quote(workdir)) + " ".join(shlex.quote(a) for a in ["env", *envs, *argv])


def parse_json_tail(text: str) -> Dict[str, Any]:
    """The JSON object a command printed ({} when there is none)."""
    doc = parse_json_any(text)
    return doc if isinstance(doc, dict) else {}


def launch(ssh: Ssh, box: Box, cmd: Sequence[str], name: str, onbox_args: Sequence[str] = (),
           workdir: Optional[str] = None, timeout: float = 60.0,
           onbox_env: Optional[Dict[str, str]] = None, tunnel_to: Optional[str] = None,
           stdin: Optional[bytes] = None, probe_after: bool = True) -> LaunchResult:
    """Start one supervised run on `box`; never waits for the job itself. `tunnel_to`: a tracker URL this
    machine reaches; the box gets a reverse tunnel to it and the agent the tunnel's 127.0.0.1 URL. `stdin`: bytes
    for `onbox run`'s stdin (a node group's document: its key never goes into an argv). Without `probe_after` the
    state is the one `onbox run` reported, not asked again (the keeper: a python start less on a box that is
    starting its trainer)."""
    t0 = time.monotonic()
    res = LaunchResult(box=box.name, name=name, ok=False)
    onbox_env = dict(onbox_env or {})
    res.tracker = onbox_env.get("ONBOX_TRACKER")
    tun = None
    try:
        if tunnel_to:
            from controller.boxes.tunnel import box_url, open_tunnel

            tun = open_tunnel(ssh, box, tunnel_to)  # first: the master it rides on is the persistent one
            res.tracker = onbox_env["ONBOX_TRACKER"] = box_url(tunnel_to, tun.remote_port)
            res.tunnel = {"box_port": tun.remote_port, "to": tun.local}
        home, pushed = remote_env(ssh, box)
        res.workdir = box_workdir(home, pushed, workdir)
        # the agent daemonizes itself and returns once the child runs
        script = box_script(box, res.workdir, onbox_run_argv(box, home, name, cmd, onbox_args), onbox_env)
        ran = ssh.run(box.target(), script=script, timeout=timeout, what="onbox run", input_bytes=stdin,
                      check=False)
        if ran.returncode in (2, 3):  # the agent refused (a live lease, bad input) or the box is unfit: its words
            raise agent_refusal(box.name, name, ran.returncode, ran.err_text or ran.text)
        if ran.returncode != 0:
            from controller.boxes.ssh import SSH

            SSH.check(ran, what="onbox run", box=box.name)
        out = ran.text
        doc = parse_json_tail(out)
        res.name = str(doc.get("name") or doc.get("run") or name)
        res.pid = _int(doc.get("pid") or doc.get("child_pid"))
        res.run_dir = doc.get("run_dir")
        if isinstance(doc.get("command"), list):  # an older agent does not say
            res.recorded = {k: doc.get(k) for k in ("command", "workdir", "durable", "ckpt_dir")}
        if doc.get("ok") is False or doc.get("error"):
            raise JobFailed("onbox run on %s did not start %s: %s" % (box.name, res.name, doc.get("error")),
                            hint="see `onboxctl logs %s %s`" % (box.name, res.name))
        # the probe is its own call (U4)
        res.state = (probe(ssh, box, home, res.name) if probe_after else None) or doc.get("state")
        res.ok = True
        if tun is not None and res.tunnel is not None:  # the run is there: keep its tunnel up from now on
            from controller.boxes.tunnel import Records, start_supervisor

            records = Records()
            res.tunnel["supervisor"], why = start_supervisor(tun, records)
            res.tunnel["log"] = records.log_path(tun)
            if why:
                res.tunnel["unsupervised"] = why
    except OnboxError as e:
        res.error, res.hint, res.exit_code = e.message, e.hint, int(e.exit_code)
    res.seconds = round(time.monotonic() - t0, 3)
    return res


def agent_refusal(box: str, name: str, rc: int, said: str) -> OnboxError:
    """`onbox run`'s own refusal on `box` (exit 2: bad usage or input, such as a run whose live lease another agent
    holds; exit 3: the box is unfit), kept as ITS exit code with its message and hint: wrapped as a remote failure
    it read as exit 1, the job failed."""
    lines = [untrusted.printable(ln.strip()) for ln in said.splitlines() if ln.strip()]
    own = [ln[len("onbox: "):] for ln in lines if ln.startswith("onbox: ")]
    errors = [ln for ln in own if not ln.startswith("warning:")]  # a warning before the refusal is not it
    line = errors[-1] if errors else own[-1] if own else lines[-1] if lines else ""
    hint = next((ln[len("hint: "):] for ln in lines if ln.startswith("hint: ")), None)
    if rc == 2:  # the agent's own words for a refusal open with "run NAME refused, nothing started: " (an older
        # agent's "run NAME failed to start: "): the why follows
        line = re.sub(r"^run \S+ (failed to start|refused, nothing started): ", "", line)
    error = UsageError if rc == 2 else UnfitError
    return error("onbox run on %s: %s" % (box, line or "refused %s (exit %d), saying nothing" % (name, rc)), hint=hint)


def probe(ssh: Ssh, box: Box, home: str, name: str, timeout: float = 30.0) -> Optional[str]:
    """`onbox status NAME --json` on the box: the run's state right after launch."""
    pyz = "%s/%s" % (home.rstrip("/"), REMOTE_PYZ)
    r = ssh.run(box.target(), [box.python, pyz, "status", name, "--json"], timeout=timeout, check=False,
                what="onbox status")
    doc = parse_json_tail(r.text)
    run = doc.get("run") if isinstance(doc.get("run"), dict) else doc
    state = run.get("state") if isinstance(run, dict) else None
    return str(state) if state else None


def launch_many(ssh: Ssh, jobs: Sequence[Tuple[Box, Sequence[str], str]], onbox_args: Sequence[str] = (),
                workdir: Optional[str] = None, parallel: int = 8, timeout: float = 60.0,
                onbox_env: Optional[Dict[str, str]] = None, tunnel_to: Optional[str] = None) -> List[LaunchResult]:
    """Launch (box, cmd, name) jobs with at most `parallel` at a time; results in the order given."""
    if not jobs:
        raise UsageError("no boxes to launch on")
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        futures = [pool.submit(launch, ssh, box, cmd, name, onbox_args, workdir, timeout, onbox_env, tunnel_to)
                   for box, cmd, name in jobs]
        return [f.result() for f in futures]


def read_fanout(path: str) -> List[Tuple[str, List[str]]]:
    """A fan-out file: one box a line, optionally with its own command: `BOX` or `BOX -- CMD ARGS...`."""
    out = []
    try:  # bounded, regular files only: a FIFO must not hang onboxctl, /dev/zero must not grow it
        lines = untrusted.read_text(path, untrusted.CONFIG_MAX_BYTES, "fan-out file").splitlines()
    except (OSError, ValueError) as e:  # ValueError: refused (UntrustedInput) or not UTF-8
        raise UsageError("cannot read fan-out file %s: %s" % (path, untrusted.reason(e)))
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            words = shlex.split(line)
        except ValueError as e:
            raise UsageError("%s:%d: %s" % (path, n, e))
        if len(words) > 1 and words[1] != "--":
            raise UsageError("%s:%d: expected `BOX` or `BOX -- CMD ...`, got %r" % (path, n, line))
        out.append((words[0], words[2:]))
    return out


def check_name(name: str) -> str:
    if not valid_run_name(name) or name.endswith("\n"):  # the shared regex ends in `$`, which lets "x\n" through
        raise UsageError("invalid run name %r" % name,
                         hint="use letters, digits, '.', '_' and '-' (at most 128), starting with a letter or digit")
    return name


def _int(v: Any) -> Optional[int]:
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def check_job_options(opts: Dict[str, Any]) -> None:
    """What `onbox run` on the box would refuse, refused here before any ssh: secret names, box paths, MLflow."""
    from onbox.config import check_mlflow_experiment, parse_secret_spec, url_problem

    for spec in opts.get("secret") or ():
        parse_secret_spec(spec)
    for what in [("--env-file", p) for p in opts.get("env_file") or ()] + \
            [("--mlflow-token-file", opts.get("mlflow_token_file"))]:
        flag, path = what
        if path is not None and (not path or path.startswith("-") or any(ord(c) < 32 for c in path)):
            raise UsageError("invalid %s %r" % (flag, path), hint="a file on the box, e.g. /workspace/job.env")
    url = opts.get("mlflow")
    if url is not None:
        problem = url_problem(url) or ("spaces or control characters in it" if any(c.isspace() or ord(c) < 32
                                                                                    for c in url) else None)
        if not problem and "@" in url.split("//", 1)[-1].split("/", 1)[0]:
            problem = "credentials in the URL: the agent reads the token from --mlflow-token-file"
        if problem:
            raise UsageError("--mlflow %r: %s" % (url, problem), hint="e.g. --mlflow http://mlflow.internal:5000")
    if opts.get("mlflow_experiment") is not None:
        check_mlflow_experiment(opts["mlflow_experiment"])
    if opts.get("mlflow_experiment") is not None and opts.get("mlflow") is None:
        raise UsageError("--mlflow-experiment goes with --mlflow", hint="e.g. --mlflow http://mlflow.internal:5000")
