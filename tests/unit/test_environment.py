"""onbox.environment: the one typed reader of the variables that steer onbox itself, and the agent's environment
(the one the Supervisor was given) reaching the hooks instead of the process's own."""
from __future__ import annotations

from onbox.environment import Environment
from onbox.heartbeat.hook import HeartbeatHook, box_name
from onbox.subsystems import make_hooks
from tests.fakes.run_context import run_context


def test_every_variable_is_a_typed_field_and_an_empty_value_means_unset():
    env = Environment.read({"ONBOX_HOME": "/h", "ONBOX_BOX": "gpu1", "ONBOX_TRACKER": "", "ONBOX_PYZ": "/p.pyz",
                            "ONBOX_SSH_CONNECT_TIMEOUT": "7", "ONBOX_SSH_MULTIPLEX": "0", "ONBOX_SSH_X": "",
                            "ONBOX_TRACKER_TOKEN": "s3cret", "XDG_RUNTIME_DIR": "/run/user/0"})
    assert (env.home, env.box, env.tracker, env.pyz, env.xdg_runtime_dir) == ("/h", "gpu1", None, "/p.pyz",
                                                                               "/run/user/0")
    assert env.ssh == {"connect_timeout": "7", "multiplex": "0"}
    assert "s3cret" not in repr(env)  # a secret never reaches a log line through repr


def test_the_box_name_comes_from_the_environment_the_agent_was_given(monkeypatch):
    monkeypatch.setenv("ONBOX_BOX", "from-the-process")
    assert box_name({"ONBOX_BOX": "gpu7"}) == "gpu7"
    assert box_name() == "from-the-process"


def test_the_heartbeat_hook_and_the_slurm_role_read_the_supervisors_environment(tmp_path, monkeypatch):
    """subsystems.py and the heartbeat hook read os.environ although the Supervisor was given another mapping:
    a test (or an embedding program) that passed its own saw the process's values instead."""
    monkeypatch.setenv("ONBOX_BOX", "wrong")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    ctx = run_context(tmp_path, durable=None)
    ctx.environ = {"ONBOX_BOX": "gpu7", "SLURM_JOB_ID": "42", "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2",
                   "SLURM_PROCID": "1"}
    hook = HeartbeatHook(ctx, sinks=[])
    assert hook.box == "gpu7" and hook.slurm and hook.slurm.get("job_id") == "42"
    hooks = make_hooks(ctx)
    assert type(hooks.checkpoints).__name__ != "CheckpointCommitHook"  # node 1 of a Slurm job: restore-only
