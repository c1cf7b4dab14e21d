"""The generated sbatch script, checked against golden files (tests/golden/sbatch_*.sh; a mismatch prints a diff;
UPDATE_GOLDEN=1 rewrites them), and the `onbox sbatch` command's parsing and bad input."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from onbox.errors import UsageError
from onbox.slurm.script import SbatchScript, default_agent, profile_defaults
from tests.conftest import subprocess_env
from tests.golden import check_golden

AGENT = ["python3", "/shared/onbox.pyz"]




def onbox_sbatch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onbox", "sbatch", *args], env=subprocess_env(),
                          capture_output=True, text=True, timeout=60)


def test_single_node_script_matches_golden():
    spec = SbatchScript(command=["python", "train.py", "--lr", "3e-4", "two words"], agent=AGENT,
                        run_args=["--durable", "/shared/ckpt", "--restart", "never", "--env", "A=$HOME"],
                        name="exp1", time="4:00:00", partition="gpu", sbatch_args=["--gres=gpu:1", "--mem=64G"],
                        version="1.2.3").validate()
    check_golden("sbatch_single.sh", spec.render())


def test_array_multinode_usr2_script_matches_golden():
    spec = SbatchScript(command=["torchrun", "--nnodes=2", "train.py"], agent=["/usr/bin/python3", "-m", "onbox"],
                        run_args=["--durable", "/shared/ckpt", "--restart", "never"],
                        nodes=2, array="0-3%2", signal="SIGUSR2", lead=300, version="1.2.3").validate()
    check_golden("sbatch_array_multinode.sh", spec.render())


def test_cli_print_matches_golden_and_passes_run_options_through_in_order():
    cp = onbox_sbatch("--print", "--time", "4:00:00", "--partition", "gpu", "--agent", "python3 /shared/onbox.pyz",
                      "--durable", "/shared/ckpt", "--restart", "never", "--env", "A=$HOME", "--name", "exp1",
                      "--sbatch-arg=--gres=gpu:1", "--sbatch-arg=--mem=64G",
                      "--", "python", "train.py", "--lr", "3e-4", "two words")
    assert cp.returncode == 0, cp.stderr
    text = cp.stdout.replace("(onbox %s)" % __import__("onbox").__version__, "(onbox 1.2.3)")
    check_golden("sbatch_single.sh", text)


def test_script_is_valid_bash_and_names_runs_like_slurmjob(tmp_path):
    """The shell's run name (what the script passes to --name) equals SlurmJob.run_name for the same env."""
    from onbox.slurm.job import SlurmJob

    cases = [({"SLURM_JOB_ID": "42"}, None), ({"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40",
                                              "SLURM_ARRAY_TASK_ID": "3"}, None),
             ({"SLURM_JOB_ID": "44"}, "exp1"), ({"SLURM_JOB_ID": "45", "SLURM_ARRAY_JOB_ID": "40",
                                                 "SLURM_ARRAY_TASK_ID": "7"}, "exp1")]
    probe = tmp_path / "agent.sh"
    probe.write_text('#!/bin/bash\nwhile [ "$1" != "--name" ]; do shift; done; echo "$2"\n')
    probe.chmod(0o755)
    for env, base in cases:
        text = SbatchScript(command=["true"], agent=[str(probe)], name=base).validate().render()
        script = tmp_path / "s.sh"
        script.write_text(text)
        cp = subprocess.run(["bash", str(script)], env={"PATH": os.environ["PATH"], **env},
                            stdout=subprocess.PIPE, text=True, timeout=30, check=True)
        want = SlurmJob.from_env(env).run_name(base)  # type: ignore[union-attr]
        assert cp.stdout.splitlines()[-1] == want


@pytest.mark.parametrize("args, needle", [
    (["--print"], "no command to run"),
    (["--print", "--signal", "BOGUS", "--", "x"], "unknown signal"),
    (["--print", "--signal-lead", "0", "--", "x"], "--signal-lead must be"),
    (["--print", "--signal-lead", "70000", "--", "x"], "--signal-lead must be"),
    (["--print", "--nodes", "0", "--", "x"], "--nodes must be"),
    (["--print", "--sbatch-arg", "mem=1G", "--", "x"], "not an sbatch option"),
    (["--print", "--foreground", "--", "x"], "always runs the agent in --foreground"),
    (["--print", "python", "train.py"], "put the command after --"),
    (["--print", "--preempt-signal", "USR2", "--", "x"], "use --signal"),
    (["--print", "--agent", "'unbalanced", "--", "x"], "--agent"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle):
    cp = onbox_sbatch(*args)
    assert cp.returncode == 2, (cp.stdout, cp.stderr)
    assert needle in cp.stderr
    assert "Traceback" not in cp.stderr


def test_json_print():
    import json

    cp = onbox_sbatch("--print", "--json", "--agent", "python3 /x.pyz", "--", "true")
    assert cp.returncode == 0, cp.stderr
    doc = json.loads(cp.stdout)
    assert doc["script"].startswith("#!/bin/bash\n") and "exec python3 /x.pyz run --foreground" in doc["script"]


def test_default_agent(tmp_path):
    pyz = tmp_path / "onbox.pyz"
    pyz.write_bytes(b"PK")
    assert default_agent(str(pyz)) == ["python3", str(pyz)]
    assert default_agent(str(tmp_path / "x.py")) == [sys.executable, "-m", "onbox"]


def test_profile_defaults_read_lead_and_signal(tmp_path, onbox_home):
    assert profile_defaults() == {"lead": 120, "signal": "USR1"}  # the built-in profiles/slurm.toml
    (onbox_home / "profiles").mkdir()
    (onbox_home / "profiles" / "slurm.toml").write_text('[preemption]\nsignal_lead = 300\n[run]\npreempt_signal = "USR2"\n')
    assert profile_defaults() == {"lead": 300, "signal": "USR2"}
    cp = subprocess.run([sys.executable, "-m", "onbox", "sbatch", "--print", "--agent", "a", "--", "x"],
                        env=subprocess_env({"ONBOX_HOME": str(onbox_home)}), capture_output=True, text=True, timeout=60)
    assert "#SBATCH --signal=B:USR2@300\n" in cp.stdout and "export ONBOX_PREEMPT_SIGNAL=USR2 " in cp.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text('[preemption]\nsignal_lead = "soon"\n')
    with pytest.raises(UsageError, match="signal_lead"):
        profile_defaults(str(bad))


def test_validate_normalises_signal():
    spec = SbatchScript(command=["x"], agent=AGENT, signal="sigusr2").validate()
    assert spec.signal == "USR2"
    with pytest.raises(UsageError):
        SbatchScript(command=[], agent=AGENT).validate()


def test_without_option():
    from onbox.slurm.script import without_option

    assert without_option(["--durable", "/d", "--restart", "never", "--durable=/e", "--x"], "--durable") == [
        "--restart", "never", "--x"]


@pytest.mark.parametrize("node_id", ["0", "1"])
def test_multinode_inner_command_keeps_args_verbatim_per_node(tmp_path, node_id):
    """The srun form runs the agent line through `bash -c '<inner>'`: quoting must survive two shells. A fake
    srun/scontrol on PATH stand in for Slurm (the real srun path is in tests/integration/test_slurm_script.py)."""
    import json

    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "srun").write_text('#!/bin/bash\nwhile [ "${1#-}" != "$1" ]; do shift; done; exec "$@"\n')
    (bindir / "scontrol").write_text("#!/bin/bash\necho node1; echo node2\n")
    agent = tmp_path / "agent.py"
    agent.write_text("import json, os, sys\nprint(json.dumps({'argv': sys.argv[1:], 'requeue': "
                     "os.environ.get('ONBOX_REQUEUE'), 'durable': os.environ.get('ONBOX_DURABLE'), "
                     "'master': os.environ.get('MASTER_ADDR')}))\n")
    for f in ("srun", "scontrol"):
        (bindir / f).chmod(0o755)
    cmd = ["python", "it's", "$HOME", '"quoted"', "a b"]
    text = SbatchScript(command=cmd, agent=[sys.executable, str(agent)], nodes=2,
                        run_args=["--durable", "/d", "--restart", "never"]).validate().render()
    script = tmp_path / "s.sh"
    script.write_text(text)
    env = {"PATH": "%s:%s" % (bindir, os.environ["PATH"]), "SLURM_JOB_ID": "9", "SLURM_NODEID": node_id,
           "SLURM_JOB_NODELIST": "node[1-2]", "ONBOX_DURABLE": "/env"}
    cp = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert cp.returncode == 0, cp.stderr
    doc = json.loads(cp.stdout.splitlines()[-1])
    assert doc["master"] == "node1"
    if node_id == "0":
        assert doc["argv"] == ["run", "--foreground", "--name", "slurm-9", "--durable", "/d", "--restart", "never",
                               "--", *cmd]
        assert doc["requeue"] == "1" and doc["durable"] == "/env"
    else:
        assert doc["argv"] == ["run", "--foreground", "--name", "slurm-9.node1", "--restart", "never", "--", *cmd]
        assert doc["requeue"] == "0" and doc["durable"] is None
