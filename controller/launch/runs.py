"""start(plan): `onboxctl run` acting on what launch/plan.py's prepare() resolved. Without --name each box is asked
which run the launch continues (launch/relaunch.py), then the boxes are launched in parallel (launch/start.py) or
as one node group (launch/nodes.py), each started run enrolled for the keeper (`enrol`, the command's) and recorded
in this machine's launch log."""
from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Callable, List, Optional, Set, Union

from controller.launch.plan import RunPlan
from controller.launch.relaunch import Choice
from controller.launch.start import LaunchResult, launch_many
from onbox.errors import OnboxError

# enrol(run, boxes, cmd): a started run's records for the keeper (a no-op without --recover)
Enrol = Callable[[str, List[str], List[str]], None]


def start(plan: RunPlan, enrol: Enrol, say: Optional[Callable[[str], None]] = None,
          warn: Callable[[str], None] = lambda text: None) -> List[LaunchResult]:
    """Launch the plan: one LaunchResult per box (node order with --nodes). `say` hears the run each box
    continues (`gpu1: resuming RUN from step S: ...`), `warn` a launch log that could not be written."""
    if plan.nodes:
        from controller.launch.nodes import launch_group

        assert plan.group is not None
        results = launch_group(plan.ssh, [box for box, _ in plan.resolved], plan.cmd, plan.group, plan.onbox_args,
                               workdir=plan.workdir, parallel=plan.parallel, timeout=plan.timeout,
                               onbox_env=plan.onbox_env, tunnel_to=plan.tunnel_to, master_addr=plan.master_addr)
        if all(r.ok for r in results):
            enrol(plan.group, list(plan.boxes), plan.cmd)
        return results
    choices: List[Union[Choice, LaunchResult]] = list(plan.choices)
    if plan.finds_runs:
        choices = find_runs(plan)
    for c in choices:
        if say is not None and isinstance(c, Choice) and c.decision != "named":
            say("%s: %s" % (c.box, c.line()))
    jobs = [(box, box_cmd, c.run) for (box, box_cmd), c in zip(plan.resolved, choices) if isinstance(c, Choice)]
    launched = iter(launch_many(plan.ssh, jobs, plan.onbox_args, workdir=plan.workdir, parallel=plan.parallel,
                                timeout=plan.timeout, onbox_env=plan.onbox_env, tunnel_to=plan.tunnel_to)
                    if jobs else [])
    started: List[LaunchResult] = []
    for c in choices:
        if isinstance(c, Choice):
            res = next(launched)
            res.match = c.to_dict()
        else:
            res = c  # a box whose run could not be found failed there
        started.append(res)
    for (box, box_cmd), res in zip(plan.resolved, started):
        if res.ok:
            enrol(res.name, [box.name], box_cmd)
    record_launches(started, warn)
    return started


def find_runs(plan: RunPlan) -> List[Union[Choice, LaunchResult]]:
    """For each box, the run this launch continues (controller/launch/relaunch.py): a Choice, or the failed LaunchResult
    of a box whose agent could not be asked or whose run is still alive (that box is not launched). --new: a new
    run on each box, under a name none of its runs has."""
    from controller.launch.relaunch import ask, candidate_names, decide, free_name

    boxes = {box.name for box, _ in plan.resolved}
    logs = [[e for e in plan.launch_log if e["command"] == list(box_cmd)] for _, box_cmd in plan.resolved]

    def one(i: int) -> Any:
        box, box_cmd = plan.resolved[i]
        return ask(plan.ssh, box, box_cmd, plan.forwarded, plan.workdir, plan.onbox_env,
                   candidate_names(logs[i], box.name, boxes - {box.name}), timeout=plan.timeout)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, plan.parallel)) as pool:
        futures = [pool.submit(one, i) for i in range(len(plan.resolved))]
        answers: List[Any] = []
        for f in futures:
            try:
                answers.append(f.result())
            except OnboxError as e:
                answers.append(e)
    out: List[Union[Choice, LaunchResult]] = []
    claimed: Set[str] = set()
    for i, ((box, _), default, answer) in enumerate(zip(plan.resolved, plan.choices, answers)):
        try:
            if isinstance(answer, OnboxError):
                raise answer
            if plan.new:
                choice = dataclasses.replace(default, run=free_name(default.run, set(answer.get("names") or [])))
            else:
                choice = decide(box, answer, logs[i], default.run, plan.take_over, claimed)
        except OnboxError as e:
            out.append(LaunchResult(box=box.name, name=getattr(e, "run", default.run), ok=False, error=e.message,
                                    hint=e.hint, exit_code=int(e.exit_code)))
            continue
        if choice.decision == "resume":
            claimed.add(choice.run)
        out.append(choice)
    return out


def record_launches(results: List[LaunchResult], warn: Callable[[str], None]) -> None:
    """Every run a box started, into this machine's launch log (what its agent recorded as making it this run)."""
    from controller.launch.launchlog import LaunchLog

    rows = [dict(r.recorded, run=r.name, box=r.box) for r in results
            if r.ok and isinstance(r.recorded, dict) and isinstance(r.recorded.get("command"), list)]
    if not rows:
        return
    problem = LaunchLog().record(rows)
    if problem:
        warn("%s: the launch is not recorded (a relaunch on another box will not find it by itself; --name names "
             "it)" % problem)
