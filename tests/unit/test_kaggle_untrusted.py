"""What onboxctl reads from Kaggle, and what it sends there, checked here: the session's `onbox run` options (the
agent's own checks, before anything is written or sent), the names a pull downloads, the tree it moves into DEST,
the log and status text it prints, and the previous output a session resumes from (never a dataset's)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess

import pytest

from controller.kaggle import cli as kcli
from controller.kaggle import folder, kernel_main, onboxargs, output
from controller.kaggle.output import check_tree, outcome_in_log, output_pattern, pull
from controller.results.pull import PullsRecord
from onbox.errors import JobFailed, UsageError

DEEP = "[" * 100000 + "]" * 100000


@pytest.mark.parametrize("args, says", [
    (["--grace=nan"], "--grace must be a number"),
    (["--grace", "inf"], "--grace must be a number"),
    (["--bogus"], "No such option: --bogus"),
    (["--grace"], "requires an argument"),
    (["--ckpt-dir=/"], "is the root of the filesystem"),
    (["--ckpt-dir", "/usr"], "is a system directory"),
    (["--ckpt-dir=../../../.."], "(/ on Kaggle) is the root"),
    (["--name=other"], "--name is set by the kernel's script"),
    (["--durable=/mnt/x"], "--durable is set by the kernel's script"),
    (["--profile", "runpod"], "--profile is set by the kernel's script"),
    (["python"], "python is no `onbox run` option"),
    (["--keep-last=2", "--"], "`--` ends the options"),
    (["--restart", "sometimes"], "Invalid value for '--restart'"),
    (["--deadline=soon"], "--deadline 'soon'"),
    (["--ckpt-dir="], "--ckpt-dir needs a value"),
])
def test_a_session_option_the_agent_would_refuse_is_refused_here_naming_it(args, says):
    with pytest.raises(UsageError, match=re.escape(says)) as e:
        onboxargs.check(args, [], "gpt", code=True)
    assert e.value.message.startswith("--onbox-arg ")


@pytest.mark.parametrize("args", [[], ["--keep-last=2"], ["--grace", "30"], ["--ckpt-dir=ck"],
                                  ["--ckpt-dir=/kaggle/working/ckpt"], ["--sync-interval=30", "--keep-best=loss"],
                                  ["--deadline=11h"], ["--restart", "never", "--max-restarts=0"]])
def test_the_session_options_people_give_still_pass(args):
    onboxargs.check(args, ["--init_from=resume"], "gpt", code=True)


def test_output_names_that_lead_out_or_hold_control_characters_are_never_fetched():
    p = re.compile(output_pattern("r"))
    assert p.search("onbox-durable/r/checkpoints/step_1/MANIFEST.json") and p.search("onbox-kaggle.json")
    assert p.search("onbox-durable/r/logs/out.log") and p.search("onbox-durable/r/checkpoints/s/caf\u00e9")
    for name in ("onbox-durable/r/../../x", "onbox-durable/r/a/../../../etc/x", "onbox-durable/r/..",
                 "onbox-durable/r/./a", "onbox-durable/r//a", "/etc/passwd", "onbox-durable/r/a\\..\\b",
                 "onbox-durable/r/\x1b]0;PWN\x07/MANIFEST.json", "onbox-durable/r/a\n", "onbox-kaggle.json\n",
                 "onbox-durable/rr/a", "onbox-durable/r/", "x/onbox-kaggle.json", "onbox-durable/r/a\x9bb"):
        assert not p.search(name), repr(name)


def test_a_downloaded_tree_with_a_symlink_or_a_fifo_is_refused(tmp_path):
    (tmp_path / "s" / "a").mkdir(parents=True)
    (tmp_path / "s" / "a" / "f").write_text("x")
    check_tree(str(tmp_path / "s"))
    os.symlink("/etc", tmp_path / "s" / "a" / "out")
    with pytest.raises(JobFailed, match="a/out, which is no plain file"):
        check_tree(str(tmp_path / "s"))
    os.unlink(tmp_path / "s" / "a" / "out")
    os.mkfifo(tmp_path / "s" / "a" / "fifo")
    with pytest.raises(JobFailed, match="no plain file"):
        check_tree(str(tmp_path / "s"))


PAYLOAD = b"fine\n"


def committed(root, run, name, step, manifest_name=None):
    d = root / kernel_main.DURABLE_DIR / run / "checkpoints" / name
    d.mkdir(parents=True)
    (d / "ok.txt").write_bytes(PAYLOAD)
    (d / "MANIFEST.json").write_text(json.dumps({
        "schema": "onbox.manifest/1", "name": manifest_name or name, "kind": "dir", "hash": "sha256", "step": step,
        "created": 2.0, "files": [{"path": "ok.txt", "size": len(PAYLOAD),
                                   "sha256": hashlib.sha256(PAYLOAD).hexdigest()}]}))


class StagingCli:
    """A KaggleCli whose `output` lays out what a download would have brought (the test's tree)."""

    def __init__(self, lay):
        self.lay, self.patterns = lay, []

    def output(self, ref, dest, pattern=None):
        self.patterns.append(pattern)
        self.lay(dest)


def test_a_pull_moves_nothing_when_the_download_holds_a_symlink_and_prints_no_escape(tmp_path):
    said = []

    def hostile(dest):
        committed(tmp_path.joinpath(dest), "r", "step_00002", 2)
        os.symlink(str(tmp_path / "outside"), os.path.join(dest, kernel_main.DURABLE_DIR, "r", "logs"))

    with pytest.raises(JobFailed, match="no plain file"):
        pull(StagingCli(hostile), "me/onbox-r", "me", "r", str(tmp_path / "home"),
             record=PullsRecord(str(tmp_path / "pulls.json")), say=said.append)
    assert os.listdir(tmp_path / "home") == [] and not (tmp_path / "outside").exists()

    def escapes(dest):  # a checkpoint whose manifest names a file with an escape sequence
        committed(tmp_path.joinpath(dest), "r", "step_00003", 3)
        m = os.path.join(dest, kernel_main.DURABLE_DIR, "r", "checkpoints", "step_00003", "MANIFEST.json")
        with open(m) as f:
            doc = json.load(f)
        doc["files"].append({"path": "\x1b]0;PWNED\x07x", "size": 1, "sha256": "0" * 64})
        with open(m, "w") as f:
            json.dump(doc, f)

    cli = StagingCli(escapes)
    report = pull(cli, "me/onbox-r", "me", "r", str(tmp_path / "home"), load=False,
                  record=PullsRecord(str(tmp_path / "pulls.json")), say=said.append)
    assert not report.ok and cli.patterns == [output_pattern("r")]
    assert said and not any("\x1b" in line or "\x07" in line for line in said), said
    assert any("\\x1b" in line for line in said), said


def test_a_log_or_an_outcome_line_nested_past_the_bound_is_text_not_a_traceback():
    assert kcli.log_lines(DEEP) == [DEEP]
    assert outcome_in_log([kernel_main.LOG_PREFIX + "{\"a\": " + DEEP + "}"]) is None
    assert kcli.log_lines(json.dumps([{"data": "a\rb\n"}])) == ["a", "b"]  # tqdm's \r: lines, not escapes


def recorder(stdout="", stderr="", rc=0):
    def run(argv, **kw):
        return subprocess.CompletedProcess(argv, rc, stdout, stderr)
    return run


def test_kaggles_words_in_a_failure_message_are_one_line_with_no_control_character():
    hostile = "boom\x1b]0;PWNED\x07\nforged line"
    for call, run in ((lambda c: c.push("/tmp/k"), recorder(stdout="Kernel push error: " + hostile)),
                      (lambda c: c.push("/tmp/k"), recorder(stdout=hostile)),
                      (lambda c: c.status("me/k"), recorder(stderr=hostile, rc=1)),
                      (lambda c: c.status("me/k"), recorder(stdout='me/k has status "\x1b[2J"'))):
        with pytest.raises(JobFailed) as e:
            call(kcli.KaggleCli("kaggle", runner=run))
        text = e.value.message
        assert "\x1b" not in text and "\x07" not in text and "\n" not in text, repr(text)
        assert "\\x1b" in text, repr(text)


def test_a_session_resumes_only_from_the_kernels_own_output_never_a_datasets(tmp_path):
    inputs = tmp_path / "input"
    committed(inputs / "onbox-r", "r", "step_00005", 5)
    committed(inputs / "shakespeare", "r", "step_99999", 99999)  # a dataset planting a newer "checkpoint"
    committed(inputs / "datasets" / "eve" / "evil", "r", "step_99998", 99998)
    found = kernel_main.find_previous(str(inputs), "r", "onbox-r")
    assert found == str(inputs / "onbox-r" / kernel_main.DURABLE_DIR / "r")
    committed(inputs / "notebooks" / "me" / "onbox-r", "r", "step_00007", 7)  # a newer mount layout of the same
    assert kernel_main.find_previous(str(inputs), "r", "onbox-r") == str(
        inputs / "notebooks" / "me" / "onbox-r" / kernel_main.DURABLE_DIR / "r")
    assert kernel_main.find_previous(str(inputs), "r", "onbox-other") is None


def test_a_manifest_nested_past_the_recursion_limit_has_no_step_and_does_not_end_the_session(tmp_path):
    committed(tmp_path, "r", "step_00001", 1)
    bad = tmp_path / kernel_main.DURABLE_DIR / "r" / "checkpoints" / "step_00009"
    bad.mkdir()
    (bad / "MANIFEST.json").write_text(DEEP)
    assert kernel_main.newest_step(str(tmp_path / kernel_main.DURABLE_DIR / "r")) == 1


def test_a_dataset_with_the_kernels_own_slug_is_refused():
    spec = folder.KernelSpec(owner="me", run="r", command=["python", "t.py"], datasets=["eve/onbox-r"])
    with pytest.raises(UsageError, match="has the kernel's own slug"):
        spec.check()
    folder.KernelSpec(owner="me", run="r", command=["python", "t.py"], datasets=["eve/onbox-r-data"]).check()


def test_the_pull_asks_for_the_committed_tree_only(tmp_path):
    cli = StagingCli(lambda dest: committed(tmp_path.joinpath(dest), "r", "step_00002", 2))
    report = pull(cli, "me/onbox-r", "me", "r", str(tmp_path / "home"), load=False,
                  record=PullsRecord(str(tmp_path / "pulls.json")))
    assert report.ok and report.newest == "step_00002" and cli.patterns == [output.output_pattern("r")]


def test_an_env_option_that_looks_like_a_secret_is_named_and_a_plain_one_is_not():
    assert onboxargs.check(["--env", "WANDB_API_KEY=x", "--env=HF_TOKEN=y", "--env=BATCH=4"], [], "r", False) == [
        "HF_TOKEN", "WANDB_API_KEY"]
    assert onboxargs.check(["--env=BATCH=4", "--env=LR=0.1"], [], "r", False) == []


def test_a_seed_copies_the_kernels_own_previous_output_without_links_or_fifos(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_main, "SPEC", {"run": "r", "kernel": "me/onbox-r"})
    lay = {"input": str(tmp_path / "input"), "working": str(tmp_path / "working")}
    mount = tmp_path / "input" / "onbox-r"
    committed(mount, "r", "step_00004", 4)
    run_dir = mount / kernel_main.DURABLE_DIR / "r"
    (tmp_path / "secret").write_text("outside")
    os.symlink(str(tmp_path / "secret"), run_dir / "checkpoints" / "step_00004" / "link")
    os.symlink("/", run_dir / "logs")
    os.mkfifo(run_dir / "fifo")
    done = kernel_main.seed(lay, "r")
    assert done["seeded"] and done["step"] == 4
    copy = tmp_path / "working" / kernel_main.DURABLE_DIR / "r"
    got = sorted(os.path.relpath(os.path.join(d, n), copy) for d, ds, fs in os.walk(copy) for n in ds + fs)
    assert got == ["checkpoints", "checkpoints/step_00004", "checkpoints/step_00004/MANIFEST.json",
                   "checkpoints/step_00004/ok.txt"]


def test_a_run_dir_that_is_a_symlink_in_the_previous_output_is_not_resumed_from(tmp_path):
    durable = tmp_path / "input" / "onbox-r" / kernel_main.DURABLE_DIR
    durable.mkdir(parents=True)
    committed(tmp_path / "elsewhere", "r", "step_00004", 4)
    os.symlink(str(tmp_path / "elsewhere" / kernel_main.DURABLE_DIR / "r"), durable / "r")
    assert kernel_main.find_previous(str(tmp_path / "input"), "r", "onbox-r") is None
