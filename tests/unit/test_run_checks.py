"""What `onbox run` refuses before it starts (issue 19): the job's ONBOX_* contract set by the user, env files and
secrets that are not regular files, path options past the system's limits or with a `~` left in them, checkpoint
dirs that would make the agent read the machine or its own state, files the agent writes inside ONBOX_HOME."""
from __future__ import annotations

import os
import threading

import pytest

from onbox import config
from onbox.config import CONTRACT_VARS, RunConfig, check_env_entry, check_path, contract_var_hint, resolve
from onbox.errors import UsageError
from onbox.launch import container
from onbox.launch.checks import SYSTEM_DIRS, check_paths, ckpt_dir_problem, written_file_problem
from onbox.supervisor.childenv import child_env, read_env_file, read_secret
from onbox.untrusted import path_length_problem

FLAG_INSTEAD = {"ONBOX_RUN": "--name", "ONBOX_CKPT_DIR": "--ckpt-dir", "ONBOX_RESUME_FROM": "--resume-arg",
                "ONBOX_RESTART_COUNT": "counts the attempts", "ONBOX_METRICS_FILE": "--metrics-regex",
                "ONBOX_PREEMPT_FILE": "preemption"}


# -- the child's contract ------------------------------------------------------------------------------------------
def test_the_contract_is_one_list_that_childenv_sets_and_containers_pass():
    env = child_env({}, "r", "/ck", "/ck/a.pt", 2, "/m", "/p", {})
    assert {k for k in env if k.startswith("ONBOX_")} == set(CONTRACT_VARS) == set(FLAG_INSTEAD)
    assert tuple(CONTRACT_VARS) == container.CONTRACT


@pytest.mark.parametrize("var", sorted(FLAG_INSTEAD))
def test_a_contract_variable_set_by_the_user_is_refused_naming_what_to_do_instead(var):
    with pytest.raises(UsageError) as e:
        check_env_entry(var, "/elsewhere", "--env")
    assert e.value.message.startswith("--env: %s is onbox's to set for the job" % var)
    assert FLAG_INSTEAD[var] in e.value.message


def test_the_attempt_marker_is_onboxs_too_and_is_the_one_the_supervisor_sets():
    from onbox.config import MARKER_VARS
    from onbox.supervisor.leftovers import MARKER_VAR

    assert set(MARKER_VARS) == {MARKER_VAR}
    with pytest.raises(UsageError, match="stops what they leave behind"):
        check_env_entry(MARKER_VAR, "x", "--env-file a.env")


@pytest.mark.parametrize("var", ["ONBOX_PHASE", "ONBOX_PHASE_LR", "ONBOX_PHASE_TARGET_STEPS"])
def test_the_phase_variables_are_onboxs_too(var):
    with pytest.raises(UsageError, match=r"\[\[phase\]\]"):
        check_env_entry(var, "1", "--env")


@pytest.mark.parametrize("var", ["ONBOX_HOME", "ONBOX_PHASES", "ONBOX_RUNNER", "MY_ONBOX_RUN", "ONBOX_CKPT"])
def test_other_names_stay_the_users(var):
    assert contract_var_hint(var) is None
    check_env_entry(var, "x", "--env")


def test_the_contract_wins_over_anything_the_child_would_inherit_or_be_given():
    # a nested onbox inherits its parent's contract; a hand-edited config.json could carry one: onbox's value wins
    env = child_env({"ONBOX_CKPT_DIR": "/parent", "PYTHONUNBUFFERED": "0"}, "r", "/ck", None, 0, "/m", "/p",
                    {"ONBOX_CKPT_DIR": "/elsewhere", "ONBOX_RESUME_FROM": "/etc/passwd", "PYTHONUNBUFFERED": "0"})
    assert env["ONBOX_CKPT_DIR"] == "/ck" and env["ONBOX_RESUME_FROM"] == ""
    assert env["PYTHONUNBUFFERED"] == "0"  # what is not the contract stays the user's to set


def test_a_contract_variable_is_refused_from_every_layer(tmp_path):
    with pytest.raises(UsageError, match="--ckpt-dir"):
        resolve({"env": {"ONBOX_CKPT_DIR": "/x"}, "command": ["true"]}, environ={})
    rf = tmp_path / "run.toml"
    rf.write_text("[run]\ncommand = ['true']\nenv = {ONBOX_RUN = 'other'}\n")
    with pytest.raises(UsageError, match="--name"):
        resolve({}, environ={}, run_file=str(rf))
    env_file = tmp_path / "job.env"
    env_file.write_text("A=1\nexport ONBOX_RESUME_FROM=/etc/passwd\n")
    with pytest.raises(UsageError, match="line 2: ONBOX_RESUME_FROM is onbox's"):
        read_env_file(str(env_file))


# -- env files and secrets are regular files of bounded size ------------------------------------------------------
def test_an_env_file_that_is_a_device_is_refused_without_reading_it():
    with pytest.raises(UsageError, match="/dev/zero is a character device, not a regular file"):
        read_env_file("/dev/zero")


def _refused_without_blocking(fn, *args):
    """fn(*args) must raise UsageError promptly: a FIFO without a writer used to block forever."""
    caught = []

    def call():
        try:
            fn(*args)
        except UsageError as e:
            caught.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "reading a FIFO blocked"
    assert caught and "FIFO" in caught[0].message, caught
    return caught[0]


def test_an_env_file_or_a_secret_that_is_a_fifo_is_refused_at_once(tmp_path, onbox_home):
    fifo = tmp_path / "job.env"
    os.mkfifo(fifo)
    _refused_without_blocking(read_env_file, str(fifo))
    (onbox_home / "secrets").mkdir()
    os.mkfifo(onbox_home / "secrets" / "HF_TOKEN")
    _refused_without_blocking(read_secret, "HF_TOKEN")


def test_an_env_file_past_its_bound_is_refused(tmp_path):
    big = tmp_path / "big.env"
    big.write_text("A=" + "x" * (1024 * 1024) + "\n")
    with pytest.raises(UsageError, match="too large"):
        read_env_file(str(big))


# -- path options: the system's limits and `~` ---------------------------------------------------------------------
def test_path_length_limits_are_the_systems():
    assert path_length_problem("/" + "a" * 255) is None
    assert "256 bytes" in path_length_problem("/" + "a" * 256)
    assert "256 bytes" in path_length_problem("/x/" + "é" * 128 + "/y")  # bytes as the filesystem stores them
    deep = "/".join(["d" * 200] * 20)  # 4019 bytes
    assert path_length_problem(deep + "/" + "e" * 75) is None  # 4095
    assert "4096 bytes" in path_length_problem(deep + "/" + "e" * 76)


@pytest.mark.parametrize("key, value", [
    ("ckpt_dir", "/ck/" + "c" * 300),
    ("durable", "remote:bucket/" + "k" * 256),
    ("durable", "remote:" + "/".join(["d" * 200] * 21)),
    ("heartbeat_file", "/" + "/".join(["h" * 250] * 17)),
    ("env_files", "/" + "e" * 256),
])
def test_a_path_option_past_the_limits_is_refused_from_any_layer(key, value):
    with pytest.raises(UsageError, match="too long for the system"):
        RunConfig(command=["true"], **{key: [value] if key == "env_files" else value}).validate()


def test_tilde_is_expanded_in_every_path_option_from_every_layer(tmp_path, monkeypatch):
    home = tmp_path / "me"
    monkeypatch.setenv("HOME", str(home))
    rf = tmp_path / "run.toml"
    rf.write_text("[run]\ncommand = ['true']\ndurable = '~/durable'\nheartbeat_file = '~/hb.jsonl'\n")
    cfg = resolve({"ckpt_dir": "~/ck", "env_files": ["~/job.env"]}, environ={"ONBOX_TRACKER_TOKEN_FILE": "~/tok"},
                  run_file=str(rf), profile_defaults={"workdir": "~/src"})
    assert (cfg.durable, cfg.heartbeat_file, cfg.ckpt_dir) == (str(home / "durable"), str(home / "hb.jsonl"),
                                                               str(home / "ck"))
    assert cfg.env_files == [str(home / "job.env")] and cfg.tracker_token_file == str(home / "tok")
    assert cfg.workdir == str(home / "src")
    # an rclone remote is not a local path: its `~` is the remote's business
    assert resolve({"durable": "s3:~/b", "command": ["true"]}, environ={}).durable == "s3:~/b"


def test_a_tilde_that_cannot_be_expanded_is_refused():
    with pytest.raises(UsageError, match="cannot expand ~no-such-user-x19"):
        check_path("ckpt_dir", "~no-such-user-x19/ck")


# -- where a checkpoint dir may be -------------------------------------------------------------------------------
@pytest.fixture
def places(tmp_path, monkeypatch):
    home = tmp_path / "me"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    onbox_home = tmp_path / "onbox-home"
    monkeypatch.setenv("ONBOX_HOME", str(onbox_home))
    return tmp_path, home, onbox_home


def test_the_root_is_refused_also_through_a_symlink_or_dotdots(places):
    tmp, _home, oh = places
    run_dir = str(oh / "runs" / "x")
    (tmp / "out").symlink_to("/")
    assert "root of the filesystem" in ckpt_dir_problem("/", run_dir)
    assert "root of the filesystem (/, symlinks resolved)" in ckpt_dir_problem(str(tmp / "out"), run_dir)
    assert "root of the filesystem" in ckpt_dir_problem(os.path.abspath(str(tmp) + "/.." * 30), run_dir)


@pytest.mark.parametrize("d", [d for d in SYSTEM_DIRS if os.path.isdir(d)])
def test_system_dirs_are_refused_but_not_what_lies_below_them(places, d):
    run_dir = str(places[2] / "runs" / "x")
    assert "system directory" in ckpt_dir_problem(d, run_dir) or "home directory" in ckpt_dir_problem(d, run_dir)


def test_a_dir_below_a_system_dir_is_fine(places):
    assert ckpt_dir_problem("/var/tmp/onbox-ckpt-x19", str(places[2] / "runs" / "x")) is None
    assert ckpt_dir_problem(str(places[0] / "ck"), str(places[2] / "runs" / "x")) is None


def test_the_home_dir_is_refused(places):
    _tmp, home, oh = places
    assert "home directory" in ckpt_dir_problem(str(home), str(oh / "runs" / "x"))
    assert ckpt_dir_problem(str(home / "ck"), str(oh / "runs" / "x")) is None


def test_onbox_home_is_refused_in_both_directions_but_the_runs_own_default(places):
    tmp, _home, oh = places
    run_dir = str(oh / "runs" / "x")
    for inside in (run_dir, os.path.join(run_dir, "ck"), str(oh / "runs" / "y" / "checkpoints"), str(oh)):
        assert "inside ONBOX_HOME" in ckpt_dir_problem(inside, run_dir), inside
    assert "holds ONBOX_HOME" in ckpt_dir_problem(str(tmp), run_dir)
    assert ckpt_dir_problem(os.path.join(run_dir, "checkpoints"), run_dir) is None
    (tmp / "link").symlink_to(oh)
    assert "symlinks resolved" in ckpt_dir_problem(str(tmp / "link" / "runs" / "x"), run_dir)


def test_a_file_the_agent_writes_must_not_be_inside_onbox_home(places):
    tmp, _home, oh = places
    (oh / "runs").mkdir(parents=True)
    (tmp / "hb").symlink_to(oh / "runs")
    assert "inside ONBOX_HOME" in written_file_problem(str(oh / "runs" / "x" / "state.json"))
    assert "symlinks resolved" in written_file_problem(str(tmp / "hb" / "x" / "state.json"))
    assert written_file_problem(str(tmp / "hb.jsonl")) is None


def test_check_paths_names_the_option(places):
    tmp, _home, oh = places
    run_dir = str(oh / "runs" / "x")
    with pytest.raises(UsageError, match=r"^--ckpt-dir / is the root") as e:
        check_paths(RunConfig(name="x", ckpt_dir="/"), run_dir)
    assert "--ckpt-dir" in e.value.hint
    with pytest.raises(UsageError, match=r"^--heartbeat-file .*state.json is inside ONBOX_HOME"):
        check_paths(RunConfig(name="x", heartbeat_file=os.path.join(run_dir, "state.json")), run_dir)
    check_paths(RunConfig(name="x", ckpt_dir=str(tmp / "ck"), heartbeat_file=str(tmp / "hb.jsonl"),
                          durable="remote:b"), run_dir)


def test_is_remote_matches_the_durable_targets_rule():
    from onbox.checkpoints.durable.targets import make_target

    for durable in ("remote:b", ":s3,provider=AWS:b/c", "/mnt/a:b", "rel/a:b", "rel"):
        assert config.is_remote(durable) == (type(make_target(durable, "r")).__name__ == "RcloneTarget"), durable
