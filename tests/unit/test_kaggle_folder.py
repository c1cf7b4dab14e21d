"""The kernel folder `onboxctl kaggle push` writes (golden files), the kaggle CLI's words as onboxctl reads them,
its credentials, and the session side's pieces that need no session."""
from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import subprocess
import tarfile

import pytest

from controller.kaggle import cli as kcli
from controller.kaggle import folder, kernel_main
from controller.kaggle.output import outcome_in_log
from onbox.errors import JobFailed, UnfitError, UsageError
from tests.golden import check_golden

PYZ = b"PK not a real onbox.pyz"


def spec(**kw):
    base = dict(owner="tester", run="gpt2_small.v1", command=["python", "train.py", "--out", "ckpt"],
                accelerator="NvidiaTeslaT4", datasets=["tester/shakespeare"], resume_args=["--init_from=resume"],
                onbox_args=["--keep-last=2"], continuing=True)
    base.update(kw)
    return folder.KernelSpec(**base)


def test_the_kernel_folder_matches_its_golden_files(tmp_path):
    written = folder.write(str(tmp_path / "k"), spec(), PYZ)
    assert sorted(os.path.basename(p) for p in written) == ["kernel-metadata.json", "onbox_kernel.py"]
    check_golden("kaggle/kernel-metadata.json", (tmp_path / "k" / "kernel-metadata.json").read_text())
    check_golden("kaggle/onbox_kernel.py.txt", (tmp_path / "k" / "onbox_kernel.py").read_text())


def test_the_script_carries_the_pyz_and_its_sha256_and_compiles(tmp_path):
    text = folder.script(spec(), PYZ, b"code")
    ns: dict = {}
    exec(compile(text.split("\n\n", 1)[0], "head", "exec"), ns)  # SPEC, PYZ_B64, CODE_B64: plain literals
    assert base64.b64decode(ns["PYZ_B64"]) == PYZ and base64.b64decode(ns["CODE_B64"]) == b"code"
    assert ns["SPEC"]["pyz_sha256"] == hashlib.sha256(PYZ).hexdigest()
    assert ns["SPEC"]["command"] == ["python", "train.py", "--out", "ckpt"] and ns["SPEC"]["kernel"] == spec().ref
    compile(text, "onbox_kernel.py", "exec")


def test_metadata_first_push_gpu_default_cpu_tpu_and_a_remote_never_lists_the_kernel_itself():
    first = folder.metadata(spec(continuing=False, accelerator=None))
    assert first["kernel_sources"] == [] and first["enable_gpu"] is True and "machine_shape" not in first
    assert folder.metadata(spec())["kernel_sources"] == ["tester/onbox-gpt2-small-v1"]
    assert folder.metadata(spec(durable="r2:ckpt"))["kernel_sources"] == []  # it resumes from the remote
    cpu = folder.metadata(spec(accelerator="cpu"))
    assert (cpu["enable_gpu"], cpu["enable_tpu"], "machine_shape" in cpu) == (False, False, False)
    tpu = folder.metadata(spec(accelerator="TpuV38"))
    assert (tpu["enable_gpu"], tpu["enable_tpu"], tpu["machine_shape"]) == (False, True, "TpuV38")


def test_the_slug_is_what_kaggle_derives_from_the_title():
    slugify = pytest.importorskip("slugify", reason="python-slugify comes with the kaggle CLI").slugify
    for run in ("gpt2", "gpt2_small.v1", "A--b__c", "x" * 128):
        s = spec(run=run)
        assert s.slug == slugify(s.title)[:folder.SLUG_MAX].rstrip("-") and len(s.title) >= 5


@pytest.mark.parametrize("kw, words", [
    (dict(owner="-rf"), "Kaggle username"),
    (dict(command=[]), "no command"),
    (dict(datasets=["nope"]), "OWNER/DATASET-SLUG"),
    (dict(accelerator="T4 --evil"), "no machine shape"),
])
def test_bad_specs_are_refused_before_anything_is_written(tmp_path, kw, words):
    with pytest.raises(UsageError, match=words):
        folder.write(str(tmp_path / "k"), spec(**kw), PYZ)
    assert not (tmp_path / "k").exists()


def test_a_folder_holding_other_files_is_refused_and_left_alone(tmp_path):
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "train.py").write_text("mine")
    with pytest.raises(UsageError, match="not a kernel folder's"):
        folder.write(str(tmp_path / "k"), spec(), PYZ)
    assert os.listdir(tmp_path / "k") == ["train.py"]
    folder.write(str(tmp_path / "k2"), spec(), PYZ)
    folder.write(str(tmp_path / "k2"), spec(), PYZ)  # its own files are rewritten


def test_the_code_archive_is_reproducible_and_leaves_out_vcs_and_caches(tmp_path):
    (tmp_path / "c" / ".git").mkdir(parents=True)
    (tmp_path / "c" / "__pycache__").mkdir()
    (tmp_path / "c" / "pkg").mkdir()
    for rel in ("train.py", "pkg/model.py", ".git/HEAD", "__pycache__/x.pyc"):
        (tmp_path / "c" / rel).write_text(rel)
    a, b = folder.pack_code(str(tmp_path / "c")), folder.pack_code(str(tmp_path / "c"))
    assert a == b
    with tarfile.open(fileobj=io.BytesIO(a), mode="r:gz") as t:
        assert sorted(t.getnames()) == ["pkg/model.py", "train.py"]


def recorder(stdout="", stderr="", rc=0):
    calls = []

    def run(argv, **kw):
        calls.append((list(argv), kw))
        return subprocess.CompletedProcess(argv, rc, stdout, stderr)
    return run, calls


def test_the_cli_is_called_with_a_list_argv_a_timeout_and_no_credentials(monkeypatch):
    monkeypatch.setenv("KAGGLE_KEY", "s3cr3t")
    run, calls = recorder(stdout="Kernel version 7 successfully pushed.  Please check progress at https://x\n")
    assert kcli.KaggleCli("kaggle", runner=run).push("/tmp/k") == 7
    argv, kw = calls[0]
    assert argv == ["kaggle", "-W", "kernels", "push", "-p", "/tmp/k"] and kw["timeout"] == kcli.PUSH_TIMEOUT
    assert not any("s3cr3t" in a for a in argv)


def test_a_push_error_that_exits_0_is_still_a_failure():
    run, _ = recorder(stdout="Kernel push error: Notebook exceeds maximum size\n")
    with pytest.raises(JobFailed, match="Kaggle refused the push: Notebook exceeds maximum size"):
        kcli.KaggleCli("kaggle", runner=run).push("/tmp/k")


@pytest.mark.parametrize("out, want", [
    ('tester/onbox-x has status "KernelWorkerStatus.RUNNING"\n', {"state": "running", "failure": None}),
    ('tester/onbox-x has status "complete"\n', {"state": "complete", "failure": None}),
    ('tester/onbox-x has status "KernelWorkerStatus.ERROR"\nFailure message: "out of memory"\n',
     {"state": "error", "failure": "out of memory"}),
])
def test_status_words_are_read_as_kaggle_prints_them(out, want):
    run, _ = recorder(stdout=out)
    assert kcli.KaggleCli("kaggle", runner=run).status("tester/onbox-x") == want


def test_status_of_a_kernel_kaggle_does_not_have_is_none_and_other_failures_raise():
    run, _ = recorder(stderr="404 Client Error: Not Found for url: ...", rc=1)
    assert kcli.KaggleCli("kaggle", runner=run).status("tester/onbox-x") is None
    run, _ = recorder(stderr="500 Server Error", rc=1)
    with pytest.raises(JobFailed, match="500 Server Error"):
        kcli.KaggleCli("kaggle", runner=run).status("tester/onbox-x")


def test_a_missing_cli_is_an_unfit_environment():
    with pytest.raises(UnfitError, match="kaggle CLI is not installed"):
        kcli.KaggleCli("/nonexistent/kaggle").status("tester/onbox-x")


def test_credentials_env_first_then_kaggle_json_and_none_is_exit_3(tmp_path):
    assert kcli.credentials({"KAGGLE_USERNAME": "me", "KAGGLE_KEY": "k"}).owner == "me"
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    env = {"KAGGLE_CONFIG_DIR": str(cfg), "HOME": str(tmp_path)}
    with pytest.raises(UnfitError, match="no Kaggle credentials") as e:
        kcli.credentials(env)
    assert e.value.exit_code == 3 and "never takes a key on its command line" in (e.value.hint or "")
    (cfg / "kaggle.json").write_text(json.dumps({"username": "them", "key": "k"}))
    found = kcli.credentials(env)
    assert (found.owner, found.source) == ("them", str(cfg / "kaggle.json"))
    (cfg / "kaggle.json").write_text("{not json")
    with pytest.raises(UsageError, match="cannot be read"):
        kcli.credentials(env)


def test_a_log_is_read_from_kaggles_json_array_and_the_outcome_from_its_last_line():
    done = {"schema": kernel_main.OUTCOME_SCHEMA, "run": "r", "outcome": "session_limit", "exit_code": 75}
    raw = json.dumps([{"stream_name": "stdout", "time": 0.1, "data": "step 1\nstep"},
                      {"stream_name": "stdout", "time": 0.2, "data": " 2\n"},
                      {"stream_name": "stdout", "time": 9.0, "data": kernel_main.LOG_PREFIX + json.dumps(done) + "\n"}])
    lines = kcli.log_lines(raw)
    assert lines[:2] == ["step 1", "step 2"]
    assert outcome_in_log(lines) == done
    assert kcli.log_lines("plain\ntext") == ["plain", "text"] and outcome_in_log(["plain"]) is None


def test_the_previous_output_with_the_newest_step_is_found_within_the_depth_bound(tmp_path):
    def committed(base, step):
        d = tmp_path / base / kernel_main.DURABLE_DIR / "r" / "checkpoints" / ("s%d" % step)
        d.mkdir(parents=True)
        (d / "MANIFEST.json").write_text(json.dumps({"step": step}))
        return str(tmp_path / base / kernel_main.DURABLE_DIR / "r")
    committed("onbox-r", 5)
    newer = committed("notebooks/tester/onbox-r", 9)
    committed("a/b/c/d/onbox-r/too-deep", 99)
    assert kernel_main.find_previous(str(tmp_path), "r", "onbox-r") == newer
    assert kernel_main.find_previous(str(tmp_path), "other", "onbox-r") is None


def test_the_session_runs_the_agent_in_the_foreground_with_the_profile_its_target_and_the_options_passed_on(
        monkeypatch):
    monkeypatch.setattr(kernel_main, "SPEC", folder.session_spec(spec(durable="r2:bucket/ckpt"), "0" * 64))
    argv = kernel_main.agent_argv("/t/onbox.pyz", "r2:bucket/ckpt", "/t/ckpt")
    cut = argv.index("--")
    assert argv[1:4] == ["/t/onbox.pyz", "run", "--foreground"] and argv[cut + 1:] == spec().command
    head = argv[:cut]
    assert head[head.index("--profile") + 1] == "kaggle" and head[head.index("--durable") + 1] == "r2:bucket/ckpt"
    assert head[head.index("--name") + 1] == "gpt2_small.v1" and head[head.index("--ckpt-dir") + 1] == "/t/ckpt"
    assert "--resume-arg=--init_from=resume" in head and "--keep-last=2" in head


@pytest.mark.parametrize("rc, classification, want", [
    (0, None, "done"), (75, "session_limit", "session_limit"), (75, "preempted", "preempted"), (1, "failure", "failed"),
])
def test_the_session_names_its_outcome_from_the_agents_exit(rc, classification, want):
    assert kernel_main.outcome_of(rc, {"classification": classification}) == want
