"""prepare(): the launch `onboxctl run` would make, its options checked and its boxes resolved, in the foreground:
every refusal (a bad flag, an unknown pool, a damaged launch log, bad ssh settings) comes here, before any box is
asked or anything is started. launch/runs.py's start(plan) acts on it.

The keeper sits above this room (it relaunches through it), so the --recover checks come in as `recovery`, a
function the command passes; the policy it returns is kept on the plan for the enrolment after the launch.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from controller.boxes.inventory import Box, Inventory
from controller.boxes.ssh import Ssh, settings_from_env
from controller.launch.relaunch import Choice
from controller.launch.start import check_job_options, check_name, read_fanout
from controller.userconfig import check_tracker_url
from onbox.errors import UsageError
from onbox.paths import default_run_name

ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# the options --recover records for `onboxctl keep`: never forwarded to the box's `onbox run`
KEEP_OPTIONS = ("provision", "lost_after", "max_recoveries", "max_at_risk", "backoff", "recover_tries",
                "provision_timeout", "code", "include_secret")
# the options this side uses itself; every other one is forwarded as `--key value` to `onbox run`
OWN_OPTIONS = ("boxes", "name", "fanout", "parallel", "workdir", "timeout", "onbox_args", "tracker", "tunnel",
               "tracker_token_file", "heartbeat_interval", "sync_interval", "settings", "as_nodes", "master_addr",
               "recover", "new", "take_over", "as_json")
Recovery = Callable[[Optional[str], Dict[str, Any], List[str], Optional[str], Dict[str, Box]], Any]


@dataclasses.dataclass
class RunPlan:
    """A launch checked and resolved, ready for start(): the boxes with their commands, the run each is (the name
    given, or the default that start() may replace by the run it continues), and what every box's `onbox run`
    gets."""

    cmd: List[str]  # the command after `--` (may be empty: a fan-out line's own, or a --nodes relaunch)
    boxes: List[str]  # the boxes named on the command line, in order (node 0 first with --nodes)
    resolved: List[Tuple[Box, List[str]]]  # every box of the launch with its command
    name: Optional[str]
    new: bool
    take_over: bool  # for this launch only: never recorded for the keeper
    nodes: bool
    master_addr: Optional[str]
    forwarded: List[str]  # the box's `onbox run` options
    onbox_env: Dict[str, str]  # ONBOX_* settings for the box's agent
    workdir: Optional[str]
    parallel: int
    timeout: float
    tracker: Optional[str]
    tunnel_to: Optional[str]  # the tracker a reverse ssh tunnel carries to each box, or None
    recorded: Dict[str, Any]  # the options the keeper records (with KEEP_OPTIONS and the durable target)
    recover: Optional[str]
    ssh: Ssh
    group: Optional[str] = None  # --nodes: the group's run name
    choices: List[Choice] = dataclasses.field(default_factory=list)  # one per box, the run before any box is asked
    launch_log: List[Dict[str, Any]] = dataclasses.field(default_factory=list)  # newest first, when it is read
    policy: Any = None  # what `recovery` returned: the keeper's RecoveryPolicy, or None
    warnings: List[str] = dataclasses.field(default_factory=list)  # one line each, to say before it starts

    @property
    def onbox_args(self) -> List[str]:
        """What each box's `onbox run` gets: the forwarded options, and --take-over for this launch."""
        return self.forwarded + (["--take-over"] if self.take_over else [])

    @property
    def finds_runs(self) -> bool:
        """Whether start() asks each box which run this launch continues (no --name, not --nodes)."""
        return self.name is None and not self.nodes


def prepare(values: Mapping[str, Any], cmd: Sequence[str], recovery: Recovery,
            inv: Optional[Inventory] = None) -> RunPlan:
    """The launch of `onboxctl run`'s option `values` (click's names; None, () or False where not given) and `cmd`,
    or a UsageError. `recovery(recover, options, cmd, durable, inventory)` checks --recover and its companions when
    any is given (the keeper's check_recovery); what it returns is the plan's policy."""
    opts = dict(values)
    own = {k: opts.pop(k, None) for k in OWN_OPTIONS}
    keep_opts = {k: opts.pop(k, None) for k in KEEP_OPTIONS}
    cmd = list(cmd)
    boxes: Tuple[str, ...] = tuple(own["boxes"] or ())
    name, fanout, workdir, nodes = own["name"], own["fanout"], own["workdir"], bool(own["as_nodes"])
    settings: Tuple[str, ...] = tuple(own["settings"] or ())
    onbox_args: Tuple[str, ...] = tuple(own["onbox_args"] or ())
    warnings: List[str] = []
    _check_launch_kind(bool(own["new"]), name, nodes, own["master_addr"])
    if nodes:
        warnings += _check_nodes(boxes, fanout, name, cmd, opts, settings, onbox_args)
    planned: List[Tuple[str, List[str]]] = [(b, list(cmd)) for b in boxes]
    if fanout:
        planned += [(b, c or list(cmd)) for b, c in read_fanout(fanout)]
    if not planned:
        raise UsageError("no box given", hint="onboxctl run BOX [BOX...] -- CMD  (or --fanout FILE)")
    missing = [b for b, c in planned if not c]
    if missing and not nodes:
        raise UsageError("no command to run on %s" % ", ".join(missing), hint="put it after `--`: onboxctl run BOX -- python train.py")
    if name is not None:
        check_name(name)
    if workdir is not None and (not workdir or workdir.startswith("-") or any(ord(c) < 32 for c in workdir)):
        raise UsageError("invalid --workdir %r" % workdir, hint="a directory on the box, e.g. /workspace/code")
    for kv in opts.get("env") or ():
        if not ENV_NAME_RE.fullmatch(kv.partition("=")[0]) or "=" not in kv:
            raise UsageError("--env must look like KEY=VAL (KEY letters, digits and _), not %r" % kv)
    check_job_options(opts)
    tracker, tunnel_to = _tracker(own["tracker"], own["tunnel"])
    onbox_env = _onbox_env(tracker, own, settings)
    forwarded: List[str] = []
    for key, value in sorted(opts.items()):
        forwarded += _forward("--" + key.replace("_", "-"), value)
    forwarded += list(onbox_args)
    inv = inv or Inventory()
    recorded = dict(opts, **keep_opts)
    recorded["durable"] = opts.get("durable") or onbox_env.get("ONBOX_DURABLE")
    policy = None
    if own["recover"] is not None or any(v not in (None, ()) for v in keep_opts.values()):
        policy = recovery(own["recover"], recorded, cmd if nodes else list(planned[0][1]), recorded["durable"],
                          inv.load())
    group = check_name(name or default_run_name(cmd)) if nodes else None
    resolved = [(inv.resolve(box_name), box_cmd) for box_name, box_cmd in planned]
    choices = [] if nodes else _default_choices(resolved, name)
    ssh = Ssh(settings_from_env())
    launch_log: List[Dict[str, Any]] = []
    if name is None and not nodes and not own["new"]:
        from controller.launch.launchlog import LaunchLog

        launch_log = LaunchLog().load()[::-1]  # newest first; a damaged log is refused here, before any box is asked
    return RunPlan(cmd=cmd, boxes=list(boxes), resolved=resolved, name=name, new=bool(own["new"]),
                   take_over=bool(own["take_over"]), nodes=nodes, master_addr=own["master_addr"], forwarded=forwarded,
                   onbox_env=onbox_env, workdir=workdir, parallel=own["parallel"], timeout=own["timeout"],
                   tracker=tracker, tunnel_to=tunnel_to, recorded=recorded, recover=own["recover"], ssh=ssh,
                   group=group, choices=choices, launch_log=launch_log, policy=policy, warnings=warnings)


def _check_launch_kind(new: bool, name: Optional[str], nodes: bool, master_addr: Optional[str]) -> None:
    """--new, --name, --nodes and --master-addr together as they make sense."""
    if new and name is not None:
        raise UsageError("--new and --name together: --name names the run (an existing one is continued), --new "
                         "asks for a new run with the default name",
                         hint="drop --new to launch the run named by --name, or drop --name for a new run named "
                              "<program>-<UTC time>")
    if new and nodes:
        raise UsageError("--new goes with single-box and fan-out launches: a --nodes group is new unless --name "
                         "names a recorded one", hint="drop --new")
    if not nodes and master_addr is not None:
        raise UsageError("--master-addr goes with --nodes")


def _tracker(tracker: Optional[str], tunnel: Optional[bool]) -> Tuple[Optional[str], Optional[str]]:
    """--tracker checked, and the tracker a tunnel carries to the boxes (its knobs refused now, not after the
    launch)."""
    if tracker is not None:
        tracker = check_tracker_url(tracker, "--tracker")
    elif tunnel:
        raise UsageError("--tunnel needs --tracker", hint="e.g. --tracker http://127.0.0.1:8787")
    from controller.boxes.tunnel import is_local

    tunnel_to = tracker if tracker and (tunnel or (tunnel is None and is_local(tracker))) else None
    if tunnel_to:
        from controller.boxes.tunnel import WatchKnobs

        WatchKnobs.from_env()  # its supervisor's settings, refused now rather than after the launch
    return tracker, tunnel_to


def _onbox_env(tracker: Optional[str], own: Dict[str, Any], settings: Tuple[str, ...]) -> Dict[str, str]:
    """The ONBOX_* settings the box's agent gets: the tracker's and the beat's flags, and each --set FIELD=VALUE."""
    onbox_env = {}
    for field, value in (("tracker", tracker), ("tracker_token_file", own["tracker_token_file"]),
                         ("heartbeat_interval", own["heartbeat_interval"]),
                         ("sync_interval", own["sync_interval"])):
        if value is not None:
            onbox_env["ONBOX_" + field.upper()] = str(value)
    for kv in settings:
        field, sep, value = kv.partition("=")
        if not sep or not ENV_NAME_RE.fullmatch(field.replace("-", "_")):
            raise UsageError("--set must look like FIELD=VALUE, not %r" % kv)
        onbox_env["ONBOX_" + field.replace("-", "_").upper()] = value
    return onbox_env


def _forward(flag: str, value: Any) -> List[str]:
    if value is None or value == () or value is False:
        return []
    if value is True:
        return [flag]
    if isinstance(value, tuple):
        out: List[str] = []
        for v in value:
            out += [flag, str(v)]
        return out
    return [flag, str(value)]


def _default_choices(resolved: List[Tuple[Box, List[str]]], name: Optional[str]) -> List[Choice]:
    """Each box's run before any box is asked: --name's (with '-<box>' when several), else a new default name."""
    several = len(resolved) > 1
    choices = []
    for box, box_cmd in resolved:
        base = name or default_run_name(box_cmd)
        run_name = check_name("%s-%s" % (base, box.name) if several else base)
        choices.append(Choice(box.name, "named" if name else "new", run_name,
                              why="named by --name" if name else "asked for with --new"))
    return choices


def _check_nodes(boxes: Tuple[str, ...], fanout: Optional[str], name: Optional[str], cmd: List[str],
                 opts: Dict[str, Any], settings: Tuple[str, ...], onbox_args: Tuple[str, ...]) -> List[str]:
    """--nodes: two boxes or more on the command line, a durable target (the other nodes restore from it), a
    command or a --name to relaunch from the boxes' records (which hold the durable target). Returns the
    warnings."""
    if fanout:
        raise UsageError("--nodes takes its boxes on the command line, in node order, not from --fanout")
    if len(boxes) < 2:
        raise UsageError("--nodes needs two boxes or more", hint="onboxctl run gpu1 gpu2 --nodes -- torchrun ...")
    if not cmd and not name:
        raise UsageError("no command to run", hint="onboxctl run gpu1 gpu2 --nodes -- torchrun ... (or --name RUN "
                                                   "to relaunch a group from its records)")
    if cmd and not opts.get("durable") and not any(s.replace("-", "_").startswith("durable=") for s in settings) and \
            not any(a == "--durable" or a.startswith("--durable=") for a in onbox_args):
        raise UsageError("--nodes needs --durable", hint="node 0 commits there and the other nodes restore from "
                                                         "it: an rclone remote, or a mount every node shares")
    words = " ".join(cmd)
    if "c10d" in words and "rdzv" in words:
        return ["torchrun's c10d rendezvous ignores --node-rank and may put rank 0 (the rank that saves) on another "
                "node than node 0 (the node that commits); onbox sets torchrun's static rendezvous through PET_* "
                "variables: drop the --rdzv-* flags"]
    return []
