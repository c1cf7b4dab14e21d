"""Platform profiles: every built-in validates; bad ones name file, key and problem; detection; overrides."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from onbox.config import RunConfig, resolve
from onbox.errors import UsageError
from onbox.platform import profiles
from tests.conftest import subprocess_env

EXPECTED = {"autodl", "runpod", "vastai", "lambda", "paperspace", "china", "generic-ssh", "slurm", "kubernetes",
            "aws", "gcp", "azure", "local", "kaggle", "colab"}
RUNCONFIG_FIELDS = {f.name for f in dataclasses.fields(RunConfig)}


def test_every_platform_has_a_valid_profile_with_sources():
    assert set(profiles.builtin_names()) == EXPECTED
    for p in profiles.load_all():
        for table in ("billing", "preemption", "paths"):
            t = p.table(table)
            assert t["source"], (p.name, table)
            assert profiles.MONTH_RE.match(t["verified"]), (p.name, table)
        assert p.table("preemption")["notice_source"] in profiles.NOTICE_SOURCES
        assert isinstance(p.table("billing")["irreversible"], bool)


def test_china_has_its_four_platforms_with_their_own_paths():
    assert set(profiles.load("china").data["platforms"]) == {"matpool", "gpushare", "featurize", "lanrui"}
    g = profiles.load("china/gpushare")
    assert (g.table("paths")["fast"], g.table("paths")["durable"]) == ("/hy-tmp", "/hy-netdisk")
    assert g.table("env")["HF_ENDPOINT"] == "https://hf-mirror.com"  # inherited from the family
    assert g.name == "china/gpushare"


def test_run_defaults_are_runconfig_fields_and_resolve_accepts_them():
    for p in profiles.load_all():
        d = p.run_defaults()
        assert set(d) <= RUNCONFIG_FIELDS, p.name
        resolve({}, environ={}, profile_defaults=d)  # validates
    slurm = resolve({}, environ={}, profile_defaults=profiles.load("slurm").run_defaults())
    assert (slurm.preempt_signal, slurm.requeue, slurm.grace) == ("USR1", True, 30.0)
    aws = resolve({}, environ={}, profile_defaults=profiles.load("aws").run_defaults())
    assert (aws.notice_source, aws.grace) == ("aws", 120.0)


@pytest.mark.parametrize("name,env,paths,expected", [
    ("runpod", {"RUNPOD_POD_ID": "abc"}, [], "runpod"),
    ("vast", {"VAST_CONTAINERLABEL": "C.123"}, [], "vastai"),
    ("slurm", {"SLURM_JOB_ID": "42"}, [], "slurm"),
    ("slurm-in-k8s", {"SLURM_JOB_ID": "42", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}, [], "slurm"),
    ("k8s", {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, [], "kubernetes"),
    ("autodl", {}, ["root/autodl-tmp"], "autodl"),
    ("lambda", {}, ["lambda/nfs"], "lambda"),
    ("gpushare", {}, ["hy-tmp"], "china/gpushare"),
    ("nothing", {}, [], "generic-ssh"),
])
def test_detect_from_environment_and_directories(tmp_path, name, env, paths, expected):
    for p in paths:
        (tmp_path / p).mkdir(parents=True)
    got, why = profiles.detect(env, root=str(tmp_path))
    assert got == expected, why


def test_detect_aws_from_dmi_file(tmp_path):
    dmi = tmp_path / "sys/class/dmi/id"
    dmi.mkdir(parents=True)
    (dmi / "sys_vendor").write_text("Amazon EC2\n")
    assert profiles.detect({}, root=str(tmp_path))[0] == "aws"


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_user_file_overrides_any_field(onbox_home):
    _write(onbox_home / "profiles" / "runpod.toml",
           '[preemption]\ngrace_seconds = 12\n[paths]\ndurable = "/runpod-volume"\n[env]\nHF_TOKEN_FILE = "/x"\n')
    p = profiles.load("runpod")
    assert p.table("preemption")["grace_seconds"] == 12
    assert p.table("preemption")["signal"] == "TERM"  # untouched fields kept
    assert p.table("paths")["durable"] == "/runpod-volume"
    assert p.run_defaults()["grace"] == 12.0
    assert p.run_defaults()["env"]["HF_TOKEN_FILE"] == "/x"
    assert len(p.files) == 2


@pytest.mark.parametrize("text,key,problem", [
    ('[preemption]\ngrace = 3\n', "preemption.grace", "unknown key"),
    ('[billing]\nirreversible = "yes"\n', "billing.irreversible", "expected bool"),
    ('[billing]\nverified = "June 2026"\n', "billing.verified", "YYYY-MM"),
    ('[preemption]\nnotice_source = "ibm"\n', "preemption.notice_source", "expected one of"),
    ('[preemption]\nsignal = "SIGFOO"\n', "preemption.signal", "unknown signal"),
    ('gotchas = ["U7", "seven"]\n', "gotchas", "expected ids"),
    ('[run]\nrestart = "sometimes"\n', "run", "restart must be one of"),
    ('[run]\nno_such_key = 1\n', "run", "unknown key"),
])
def test_bad_override_names_file_key_and_problem(onbox_home, text, key, problem):
    path = _write(onbox_home / "profiles" / "runpod.toml", text)
    with pytest.raises(UsageError) as e:
        profiles.load("runpod")
    assert path in e.value.message and key in e.value.message and problem in e.value.message


def test_new_user_profile_must_be_complete(onbox_home):
    path = _write(onbox_home / "profiles" / "mybox.toml", 'name = "mybox"\ntitle = "Mine"\nkind = "ssh"\n')
    with pytest.raises(UsageError) as e:
        profiles.load("mybox")
    assert path in e.value.message and "billing" in e.value.message and "missing" in e.value.message


def test_unknown_and_malformed_profiles_exit_2_with_one_clean_line(tmp_path):
    env = subprocess_env({"ONBOX_HOME": str(tmp_path)})
    r = subprocess.run([sys.executable, "-m", "onbox", "profiles", "show", "nope"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 2
    assert r.stderr.splitlines()[0] == "onbox: unknown profile 'nope'"
    assert "Traceback" not in r.stderr
    bad = _write(tmp_path / "profiles" / "runpod.toml", "[billing\nmeter_stop = 1\n")
    r = subprocess.run([sys.executable, "-m", "onbox", "profiles", "show", "runpod"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 2
    assert bad in r.stderr.splitlines()[0] and "not valid TOML" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_list_show_detect(tmp_path):
    env = subprocess_env({"ONBOX_HOME": str(tmp_path), "RUNPOD_POD_ID": "p1"})
    env.pop("SLURM_JOB_ID", None)
    env.pop("KUBERNETES_SERVICE_HOST", None)

    def run(*args):
        r = subprocess.run([sys.executable, "-m", "onbox", "profiles", *args], capture_output=True, text=True,
                           env=env, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout

    import json
    names = {row["name"] for row in json.loads(run("list", "--json"))}
    assert names == EXPECTED
    shown = json.loads(run("show", "vastai", "--json"))
    assert shown["billing"]["meter_stop"] == "destroy" and shown["run_defaults"]["grace"] == 0.0
    assert "verified 2026-" in run("show", "vastai")
    assert json.loads(run("detect", "--json"))["profile"] == "runpod"
    assert run("detect", "--profile", "slurm").startswith("slurm (--profile given)")


def test_profiles_dir_is_found_in_a_checkout():
    assert profiles.builtin_dir() in (profiles.PACKAGE_DIR, profiles.REPO_DIR)
    assert os.path.exists(os.path.join(profiles.builtin_dir(), "generic-ssh.toml"))


@pytest.mark.parametrize("what", ["profile", "run file"])
def test_a_toml_file_that_is_not_utf8_is_a_clean_usage_error(tmp_path, onbox_home, what):
    # a file saved as UTF-16 or Latin-1 by an editor: UnicodeDecodeError used to reach the user as a traceback
    if what == "profile":
        path = str(onbox_home / "profiles" / "runpod.toml")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        load = lambda: profiles.load("runpod")  # noqa: E731
    else:
        path = str(tmp_path / "run.toml")
        load = lambda: resolve({}, environ={}, run_file=path)  # noqa: E731
    with open(path, "wb") as f:
        f.write(b"\xff\xfe[\x00r\x00u\x00n\x00]\x00")
    with pytest.raises(UsageError) as e:
        load()
    assert path in e.value.message and "UTF-8" in e.value.message


def test_a_meter_stop_command_that_hangs_is_stopped_at_its_timeout_and_said(tmp_path):
    import sys
    import time

    import pytest

    from controller.results.teardown import run_meter_stop
    from onbox.errors import JobFailed

    started = time.monotonic()
    with pytest.raises(JobFailed) as e:
        run_meter_stop([sys.executable, "-c", "import time; time.sleep(60)"], "b1", timeout=1.0)
    assert time.monotonic() - started < 30  # stopped at its timeout, not waited for
    assert "did not finish within 1 s: it was stopped" in e.value.message
    assert "b1" in (e.value.hint or "") and "may still bill" in (e.value.hint or "")
