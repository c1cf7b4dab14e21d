"""The shared foundation: atomic writes, config layering, the NVML seam, the CLI's error mapping."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from onbox import fsutil
from onbox.config import RunConfig, parse_signal, resolve
from onbox.errors import UsageError
from onbox.gpu.nvml import NA, GpuDriverError, NvmlSeam
from onbox.gpu.readings import inventory
from tests.conftest import subprocess_env
from tests.fakes.nvml import FakeGpu, FakeNvml


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    p = tmp_path / "state.json"
    fsutil.atomic_write_json(p, {"a": 1})
    fsutil.atomic_write_json(p, {"a": 2})
    assert json.loads(p.read_text()) == {"a": 2}
    assert [x.name for x in tmp_path.iterdir()] == ["state.json"]


def test_atomic_write_failure_keeps_old_content(tmp_path):
    p = tmp_path / "f"
    fsutil.atomic_write(p, b"old")

    class Boom:
        def encode(self, _):
            raise RuntimeError("boom")

    with pytest.raises(TypeError):
        fsutil.atomic_write(p, Boom())  # type: ignore[arg-type]
    assert p.read_bytes() == b"old"
    assert [x.name for x in tmp_path.iterdir()] == ["f"]


def test_free_space_walks_up_to_existing_dir(tmp_path):
    fs = fsutil.free_space(tmp_path / "not" / "yet")
    assert fs.path == str(tmp_path)
    assert fs.free_bytes > 0 and fs.total_bytes >= fs.free_bytes


def test_config_precedence_cli_over_env_over_file_over_profile(tmp_path):
    run_file = tmp_path / "run.toml"
    run_file.write_text('[run]\nmax-restarts = 7\ngrace = 20\nsync_interval = 5\nenv = { A = "1" }\n')
    cfg = resolve(
        cli={"grace": 3.0},
        environ={"ONBOX_SYNC_INTERVAL": "9", "ONBOX_NAME": "ignored"},
        run_file=str(run_file),
        profile_defaults={"grace": 120, "max_restarts": 2, "notice_source": "aws"},
    )
    assert cfg.grace == 3.0  # cli
    assert cfg.sync_interval == 9.0  # env beats the run file
    assert cfg.max_restarts == 7  # run file beats the profile
    assert cfg.notice_source == "aws"  # profile beats the default
    assert cfg.env == {"A": "1"}
    assert cfg.name == ""  # ONBOX_NAME is an output variable, never an input


@pytest.mark.parametrize("text,needle", [
    ("[run]\nmax_restart = 3\n", "unknown key 'max_restart'"),
    ("[run]\nmax_restarts = 'x'\n", "bad value for max_restarts"),
    ("[run\n", "not valid TOML"),
])
def test_bad_run_file_is_a_usage_error_naming_the_problem(tmp_path, text, needle):
    f = tmp_path / "run.toml"
    f.write_text(text)
    with pytest.raises(UsageError) as e:
        resolve(cli={}, environ={}, run_file=str(f))
    assert needle in str(e.value) and str(f) in str(e.value)


def test_signal_names():
    assert parse_signal("usr2").name == "SIGUSR2"
    assert parse_signal("SIGTERM").name == "SIGTERM"
    with pytest.raises(UsageError):
        parse_signal("NOPE")
    with pytest.raises(UsageError):
        RunConfig(checkpoint_signal="BOGUS").validate()


def test_nvml_without_driver_is_not_an_error():
    seam = NvmlSeam(FakeNvml(driver=False))
    inv = inventory(seam)
    assert not inv.available and "no NVIDIA driver" in inv.reason
    assert seam.call("nvmlDeviceGetCount") is NA
    with pytest.raises(GpuDriverError) as e:
        seam.require()
    assert e.value.hint


def test_nvml_inventory_and_missing_optional_function():
    fake = FakeNvml([FakeGpu(memory_used=3 << 30)], missing={"nvmlDeviceGetUUID"})
    inv = inventory(NvmlSeam(fake))
    assert inv.available and inv.cuda_driver_version == "12.4"
    assert inv.gpus[0].memory_used_bytes == 3 << 30
    assert inv.gpus[0].uuid is NA
    assert inv.to_dict()["gpus"][0]["uuid"] is None


def test_real_pynvml_on_this_gpu_less_machine_reports_not_available():
    inv = inventory(NvmlSeam())
    if inv.available:  # a lent GPU box: the reading must be real
        assert inv.gpus and inv.driver_version
    else:
        assert inv.reason


def test_cli_version_and_unknown_command():
    env = subprocess_env()
    out = subprocess.run([sys.executable, "-m", "onbox", "--version"], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "onbox" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "onbox", "frobnicate"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "No such command" in bad.stderr
    assert os.path.basename(sys.executable)
