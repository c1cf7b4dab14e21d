"""`onbox init` and the code every template shares (onbox_trainkit.py), without running a training: the flat
YAML reader and overrides, the LR curve, precision by hardware (the CUDA queries faked at the torch seam), atomic
saves and directory publishing with real torch files, pruning, the stop flag with real signals, the files
`onbox init` writes (modes, refusals, --force), and each template's YAML matching its train.py's DEFAULTS."""
from __future__ import annotations

import ast
import importlib.util
import math
import os
import signal
import subprocess
import sys
import types

import pytest

from onbox.cli import cli
from onbox.clikit import run_cli
from onbox.templates import COMMON, HERE, KINDS, TRAINKIT, render
from tests.golden import check_golden

torch = pytest.importorskip("torch")


def load_kit():
    spec = importlib.util.spec_from_file_location("onbox_trainkit_under_test", os.path.join(COMMON, TRAINKIT))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


kit = load_kit()


def defaults_of(kind):
    """DEFAULTS of a template's train.py, read from its source (importing it would run nothing, but needs
    onbox_trainkit on sys.path)."""
    with open(os.path.join(HERE, kind, "train.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "DEFAULTS":
            return ast.literal_eval(node.value)
    raise AssertionError("no DEFAULTS in %s" % kind)


# ----------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kind", KINDS)
def test_each_templates_yaml_sets_exactly_its_defaults(kind):
    """The YAML a user edits and the DEFAULTS train.py checks it against never drift apart."""
    assert kit.read_flat_yaml(os.path.join(HERE, kind, "training_config.yaml")) == defaults_of(kind)


def test_scalars_are_yaml_1_2_core_not_1_1():
    p = kit.parse_scalar
    assert p("3e-4") == 3e-4 and isinstance(p("3e-4"), float)  # PyYAML (YAML 1.1) reads this as a string
    assert p("1.0e-3") == 1e-3 and p(".5") == 0.5 and p("-2") == -2 and isinstance(p("10"), int)
    assert p("no") == "no" and p("off") == "off"  # never booleans
    assert p("true") is True and p("False") is False and p("null") is None and p("~") is None and p("") is None
    assert p('"a # b"') == "a # b" and p("'it''s'") == "it's" and p("out/pretrain") == "out/pretrain"
    assert p("[0.9, 0.95]") == [0.9, 0.95] and p("[]") == []
    with pytest.raises(kit.ConfigError):
        p("{a: 1}")


def test_the_reader_takes_comments_and_crlf_and_refuses_what_it_cannot_read_flat(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_bytes(b"# head\r\nlr: 3e-4   # peak\r\nname: \"x # y\"\r\n\r\nbetas: [0.9, 0.95]\r\n")
    assert kit.read_flat_yaml(str(good)) == {"lr": 3e-4, "name": "x # y", "betas": [0.9, 0.95]}
    for text, words in (("model:\n  n_layer: 2\n", ":2: only flat"), ("steps:\n- 1\n", ":2: only flat"),
                        ("a: 1\na: 2\n", ":2: a is set twice"), ("a: &x 1\n", ":1: a:"),
                        ("a: |\n", ":1: a:")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(kit.ConfigError, match=words):
            kit.read_flat_yaml(str(bad))


def test_overrides_are_typed_by_the_defaults_and_unknown_keys_refused(tmp_path):
    defaults = {"lr": 0.1, "steps": 10, "name": "a", "flag": False, "resume": None, "betas": [0.9, 0.95]}
    f = tmp_path / "c.yaml"
    f.write_text("lr: 1\nsteps: 20\n")
    cfg = kit.load_config(defaults, ["--config", str(f), "--name=b", "--flag=true", "--resume=/x/step-5"], "")
    assert cfg == {"lr": 1.0, "steps": 20, "name": "b", "flag": True, "resume": "/x/step-5", "betas": [0.9, 0.95]}
    assert isinstance(cfg["lr"], float)
    for argv, words in ((["--steps=1.5"], "steps must be int"), (["--flag=1"], "flag must be bool"),
                        (["--lrr=1"], "unknown key"), (["steps=3"], "overrides are --key=value"),
                        (["--config"], "needs a path")):
        with pytest.raises(kit.ConfigError, match=words):
            kit.load_config(defaults, argv, "")
    f.write_text("lrr: 1\n")
    with pytest.raises(kit.ConfigError, match="unknown key lrr"):
        kit.load_config(defaults, ["--config", str(f)], "")


def test_write_flat_yaml_reads_back_as_written(tmp_path):
    values = {"a": None, "b": True, "c": 3, "d": 2.5e-5, "e": "", "f": "x: y # z", "g": [0.9, 0.95], "h": "auto"}
    kit.write_flat_yaml(str(tmp_path / "o.yaml"), values)
    assert kit.read_flat_yaml(str(tmp_path / "o.yaml")) == values


# ----------------------------------------------------------------------------------------------- schedule
def test_lr_warms_up_linearly_then_decays_by_a_half_cosine_to_the_floor():
    lr = lambda s: kit.lr_at(s, 1.0, 10, 110, 0.1)  # noqa: E731
    assert [lr(s) for s in (0, 5, 10)] == [0.0, 0.5, 1.0]
    assert math.isclose(lr(60), 0.1 + 0.9 * 0.5)  # half way down the cosine
    assert math.isclose(lr(110), 0.1) and math.isclose(lr(500), 0.1)
    after = [lr(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(after, after[1:]))
    # the LambdaLR built on it hands the optimizer the same numbers, step after step
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = kit.cosine_scheduler(torch, opt, 1.0, 10, 110, 0.1)
    seen = []
    for _ in range(20):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr(s) for s in range(20)])


# ----------------------------------------------------------------------------------------------- hardware
def fake_torch(cuda, bf16):
    """The torch seam for precision: only the CUDA queries pick_precision makes (no GPU on the test machine)."""
    return types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: cuda, is_bf16_supported=lambda: bf16))


@pytest.mark.parametrize("cuda,bf16,wanted,expect", [
    (True, True, "auto", "bf16"),   # Ampere and later
    (True, False, "auto", "fp16"),  # V100, T4: fp16 with loss scaling
    (False, False, "auto", "fp32"),  # CPU: emulated bf16 is slower than fp32
    (True, True, "fp32", "fp32"), (False, False, "fp16", "fp16"),
])
def test_precision_follows_the_hardware_unless_forced(cuda, bf16, wanted, expect):
    t = fake_torch(cuda, bf16)
    assert kit.pick_precision(t, kit.pick_device(t), wanted) == expect


def test_precision_refuses_an_unknown_name_and_the_scaler_is_on_only_for_fp16(capsys):
    with pytest.raises(SystemExit) as e:
        kit.pick_precision(fake_torch(False, False), "cpu", "fp8")
    assert e.value.code == 2 and "auto, bf16, fp16 or fp32, not 'fp8'" in capsys.readouterr().err
    assert kit.grad_scaler(torch, "cpu", "fp16").is_enabled()
    assert not kit.grad_scaler(torch, "cpu", "bf16").is_enabled()
    assert not kit.grad_scaler(torch, "cpu", "fp32").is_enabled()


# ----------------------------------------------------------------------------------------------- checkpoints
def test_atomic_save_replaces_whole_or_not_at_all(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    kit.atomic_torch_save(torch, {"step": 1, "w": torch.ones(4)}, path)
    assert torch.load(path, weights_only=True)["step"] == 1

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        kit.atomic_torch_save(torch, {"step": 2, "bad": Unpicklable()}, path)
    assert torch.load(path, weights_only=True)["step"] == 1  # the old checkpoint is intact
    assert os.listdir(str(tmp_path)) == ["ckpt.pt"]  # and no temp name is left behind


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    import random

    gen = torch.Generator().manual_seed(3)
    kit.seed_everything(torch, 7)
    state = kit.rng_state(torch, {"data": gen})
    kit.atomic_torch_save(torch, {"rng": state}, str(tmp_path / "r.pt"))
    want = (random.random(), torch.rand(2).tolist(), torch.rand(2, generator=gen).tolist())
    kit.set_rng_state(torch, torch.load(str(tmp_path / "r.pt"), weights_only=True)["rng"], {"data": gen})
    assert (random.random(), torch.rand(2).tolist(), torch.rand(2, generator=gen).tolist()) == want


def test_publish_dir_and_prune_by_step(tmp_path):
    staging = tmp_path / ".step-10.partial"
    staging.mkdir()
    (staging / "lit_model.pth").write_bytes(b"x")
    kit.publish_dir(str(staging), str(tmp_path / "step-10"))
    assert not staging.exists() and (tmp_path / "step-10" / "lit_model.pth").read_bytes() == b"x"
    for n in (900, 1000, 80):
        (tmp_path / ("checkpoint-%d" % n)).mkdir()
    removed = kit.prune(str(tmp_path / "checkpoint-*"), 2)
    assert [os.path.basename(p) for p in removed] == ["checkpoint-80"]  # by step, not by name
    assert sorted(os.listdir(str(tmp_path))) == ["checkpoint-1000", "checkpoint-900", "step-10"]
    assert kit.prune(str(tmp_path / "checkpoint-*"), 0) == []  # 0: keep all


def test_the_stop_flag_records_a_real_signal_and_the_preempt_file(tmp_path, monkeypatch):
    old = {s: signal.getsignal(getattr(signal, s)) for s in kit.StopFlag.SIGNALS}
    try:
        stop = kit.StopFlag().install()
        assert not stop.requested()
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler only records; nothing else happens
        assert stop.requested() and stop.reason() == "SIGUSR1"
    finally:
        for name, handler in old.items():
            signal.signal(getattr(signal, name), handler)
    flag = tmp_path / "PREEMPTED"
    monkeypatch.setenv("ONBOX_PREEMPT_FILE", str(flag))
    stop = kit.StopFlag()
    assert not stop.requested()
    flag.touch()
    assert stop.requested() and stop.reason() == "preempt file"


def test_resume_path_prefers_onbox_and_refuses_a_missing_path(tmp_path, monkeypatch):
    assert kit.resume_path(None) is None
    own = tmp_path / "mine.pt"
    own.touch()
    assert kit.resume_path(str(own)) == str(own)
    monkeypatch.setenv("ONBOX_RESUME_FROM", str(tmp_path / "gone.pt"))
    with pytest.raises(SystemExit, match="does not exist"):
        kit.resume_path(str(own))


# ----------------------------------------------------------------------------------------------- onbox init
class Result(types.SimpleNamespace):
    exit_code: int
    stdout: str
    stderr: str


@pytest.fixture
def invoke(capsys):
    """`onbox ARGS` through run_cli, as the real command line runs it (domain errors -> one line, exit code)."""
    def go(*args):
        with pytest.raises(SystemExit) as e:
            run_cli(cli, "onbox", list(args))
        out = capsys.readouterr()
        return Result(exit_code=e.value.code, stdout=out.out, stderr=out.err)
    return go


@pytest.mark.parametrize("kind", KINDS)
def test_init_writes_the_template_and_a_train_sh_that_sh_parses(kind, tmp_path, invoke):
    dest = tmp_path / "proj"
    r = invoke("init", kind, str(dest), "--name", "r1")
    assert r.exit_code == 0, r.stderr
    assert sorted(os.listdir(str(dest))) == ["onbox_trainkit.py", "train.py", "train.sh", "training_config.yaml"]
    assert os.stat(str(dest / "train.sh")).st_mode & 0o100 and not os.stat(str(dest / "train.py")).st_mode & 0o100
    sh = (dest / "train.sh").read_text()
    assert "@" not in sh.replace("$@", "") and "\r" not in sh  # every field filled; U26: LF only
    assert 'RUN_NAME=${RUN_NAME:-r1}' in sh and "--ckpt-dir \"$CKPT_DIR\" --durable \"$DURABLE\"" in sh
    assert ("--resume-arg=--resume={ckpt}" in sh) == (kind == "litgpt")
    subprocess.run(["sh", "-n", str(dest / "train.sh")], check=True, timeout=10)  # real sh: it parses
    assert (dest / "onbox_trainkit.py").read_bytes() == render(kind, "r1")[TRAINKIT]


def test_litgpt_train_sh_golden(tmp_path):
    check_golden("templates/litgpt_train.sh", render("litgpt", "lit-run")["train.sh"].decode("utf-8"))


def test_init_never_overwrites_without_force_and_force_touches_only_its_files(tmp_path, invoke):
    dest = tmp_path / "proj"
    dest.mkdir()
    (dest / "train.py").write_text("my own trainer\n")
    (dest / "data.txt").write_text("keep me\n")
    r = invoke("init", "plain", str(dest))
    assert r.exit_code == 2 and "already holds train.py" in r.stderr and "--force" in r.stderr
    assert "Traceback" not in r.stderr
    assert sorted(os.listdir(str(dest))) == ["data.txt", "train.py"]  # nothing written
    assert (dest / "train.py").read_text() == "my own trainer\n"
    r = invoke("init", "plain", str(dest), "--force", "--json")
    assert r.exit_code == 0, r.stderr
    assert (dest / "data.txt").read_text() == "keep me\n" and "onbox_trainkit" in (dest / "train.py").read_text()
    assert invoke("init", "plain", str(tmp_path / "x"), "--name", "bad name").exit_code == 2
    (tmp_path / "afile").write_text("")
    r = invoke("init", "plain", str(tmp_path / "afile"))
    assert r.exit_code == 2
    assert invoke("init", "keras", str(tmp_path / "y")).exit_code == 2  # click's choice: the kinds are listed


def test_a_typo_in_the_config_is_one_line_and_exit_2_before_any_training(tmp_path, invoke):
    assert invoke("init", "plain", str(tmp_path / "p")).exit_code == 0
    r = subprocess.run([sys.executable, str(tmp_path / "p" / "train.py"), "--max_step=10"], capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, ONBOX_CKPT_DIR=str(tmp_path / "ck")))
    assert r.returncode == 2 and r.stderr.startswith("config: --max_step: unknown key (known: ") and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and not (tmp_path / "ck").exists()  # refused before anything ran
