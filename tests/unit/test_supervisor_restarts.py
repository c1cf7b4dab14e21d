"""The restart decision (onbox/supervisor/restarts.py) on scripted exits: no process, no clock, no run dir."""
from __future__ import annotations

from typing import List

from onbox.config import RunConfig
from onbox.proc import ExitStatus
from onbox.supervisor import exits
from onbox.supervisor.restarts import RestartPolicy
from onbox.supervisor.state import RunState

OK = exits.classify(ExitStatus(code=0))
EXIT_1 = exits.classify(ExitStatus(code=1))
EXIT_2 = exits.classify(ExitStatus(code=2))
CUDA_OOM = exits.classify(ExitStatus(code=1), ["torch.OutOfMemoryError: CUDA out of memory."])
NO_GPUS = exits.classify(ExitStatus(code=125), ['docker: Error response from daemon: could not select device driver "" '
                                                'with capabilities: [[gpu]].'])


def policy(**fields) -> RestartPolicy:
    return RestartPolicy(RunConfig(name="r", command=["train"], **fields).validate())


def run_through(p: RestartPolicy, results: List[exits.Classification]) -> List[tuple]:
    """Each exit in turn, restarts counted as the loop counts them: (state, delay) per decision."""
    out, restarts = [], 0
    for result in results:
        d = p.decide(result, restarts)
        out.append((d.state, d.delay))
        restarts += d.state == RunState.BACKOFF
    return out


def test_a_success_ends_the_run_done_with_an_empty_message_and_the_exit_as_the_reason():
    d = policy().decide(OK, 0)
    assert (d.state, d.message, d.reason) == (RunState.DONE, "", OK.message)


def test_restart_always_restarts_a_success_at_once():
    d = policy(restart="always").decide(OK, 0)
    assert (d.state, d.delay, d.reason) == (RunState.BACKOFF, 0.0, "restart=always after success")


def test_restart_never_fails_the_run_on_the_first_failure():
    d = policy(restart="never").decide(EXIT_1, 0)
    assert (d.state, d.message, d.reason) == (RunState.FAILED, EXIT_1.message, EXIT_1.message)


def test_the_backoff_doubles_with_the_streak_up_to_its_cap():
    p = policy(backoff_initial=1.0, backoff_max=4.0, max_restarts=10, crash_loop_threshold=0)
    assert run_through(p, [EXIT_1] * 5) == [(RunState.BACKOFF, d) for d in (1.0, 2.0, 4.0, 4.0, 4.0)]


def test_a_success_starts_the_backoff_streak_again():
    p = policy(restart="always", backoff_initial=1.0, max_restarts=10, crash_loop_threshold=0)
    assert run_through(p, [EXIT_1, EXIT_1, OK, EXIT_1]) == [
        (RunState.BACKOFF, 1.0), (RunState.BACKOFF, 2.0), (RunState.BACKOFF, 0.0), (RunState.BACKOFF, 1.0)]


def test_the_restart_budget_spent_fails_the_run_saying_so():
    p = policy(max_restarts=2, crash_loop_threshold=0)
    assert [s for s, _ in run_through(p, [EXIT_1] * 3)] == [RunState.BACKOFF, RunState.BACKOFF, RunState.FAILED]
    d = p.decide(EXIT_1, 2)
    assert d.message == d.reason == "gave up after 2 restart(s): %s" % EXIT_1.message


def test_a_crash_loop_is_the_same_failure_in_a_row_and_names_its_class_and_hint():
    p = policy(crash_loop_threshold=3, max_restarts=10)
    assert [s for s, _ in run_through(p, [CUDA_OOM, EXIT_2, CUDA_OOM, CUDA_OOM])] == [RunState.BACKOFF] * 4
    d = p.decide(CUDA_OOM, 4)
    assert d.state == RunState.FAILED and d.fields == {"classification": exits.CUDA_OOM}
    assert d.message.startswith("crash loop: the same failure (cuda_oom) 3 times in a row; not restarting.")
    assert "— what to do: " + CUDA_OOM.hint in d.message and d.reason == d.message


def test_the_crash_loop_is_checked_before_the_restart_budget():
    d = policy(crash_loop_threshold=1, max_restarts=0).decide(EXIT_1, 0)
    assert d.message.startswith("crash loop:")


def test_a_fallback_to_an_older_checkpoint_starts_the_streak_again():
    p = policy(crash_loop_threshold=3, max_restarts=10, backoff_initial=1.0, backoff_max=100.0)
    for restarts in range(2):
        p.decide(EXIT_1, restarts)
    d = p.decide(EXIT_1, 2, fell_back=True)
    assert (d.state, d.delay) == (RunState.BACKOFF, 1.0) and p.streak == [EXIT_1.loop_key]


def test_a_phase_end_resets_the_streak():
    p = policy(crash_loop_threshold=2, max_restarts=10)
    p.decide(EXIT_1, 0)
    p.reset()
    assert p.decide(EXIT_1, 1).state == RunState.BACKOFF


def test_a_container_refused_its_gpus_fails_the_run_at_once_with_the_fix_restarts_left_or_not():
    assert NO_GPUS.classification == exits.NO_GPU_RUNTIME
    d = policy(max_restarts=10, crash_loop_threshold=3).decide(NO_GPUS, 0)
    assert d.state == RunState.FAILED and d.fields == {"classification": exits.NO_GPU_RUNTIME}
    assert d.message.startswith("not restarting: docker cannot give the container GPUs")
    assert "nvidia-ctk runtime configure --runtime=docker" in d.message
