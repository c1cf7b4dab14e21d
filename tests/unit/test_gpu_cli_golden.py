"""`onbox gpu` and `onbox reap` text output against golden files (tests/golden/gpu/). After a deliberate change:
UPDATE_GOLDEN=1 pytest tests/unit/test_gpu_cli_golden.py, then review the diff."""
from __future__ import annotations

import re

from click.testing import CliRunner

import onbox.commands.gpu as cmd
from onbox.clock import FakeClock
from onbox.gpu.nvml import NvmlSeam
from onbox.gpu.readings import GpuMonitor
from onbox.gpu.reaper import Decision
from tests.fakes.nvml import FakeGpu, FakeNvml, FakeProcess
from tests.golden import check_golden
from tests.unit.test_gpu_reaper_rules import holder

GiB = 1 << 30
DMESG = "[ 7.0] NVRM: Xid (PCI:0000:5e:00): 79, pid=0, GPU has fallen off the bus.\n"


def check(name, text):
    text = re.sub(r"\(scan \d+ ms\)", "(scan N ms)", text)  # the one machine-dependent figure
    check_golden("gpu/" + name, text)


def test_gpu_text(monkeypatch, tmp_path, onbox_home):
    fake = FakeNvml([
        FakeGpu(util_gpu=100, sm_clock_mhz=1290, power_mw=699_000, memory_used=71 * GiB, temperature_c=86,
                throttle_mask=0x4 | 0x40, processes=[FakeProcess(4242, 70 * GiB)], ecc={(1, 1): 0}),
        FakeGpu(uuid="GPU-1", pci_bus_id="00000000:5E:00.0", unsupported={"nvmlDeviceGetTotalEccErrors"}),
        FakeGpu(uuid="GPU-2", pci_bus_id="00000000:86:00.0", memory_used=20 * GiB, util_gpu=0),
    ])
    fake.raise_xid(0, 13)
    monkeypatch.setattr(cmd, "_seam", lambda: NvmlSeam(fake))
    monkeypatch.setattr(cmd, "_monitor", lambda seam: GpuMonitor(seam, kernel_log=lambda: DMESG, clock=FakeClock()))
    r = CliRunner().invoke(cmd.gpu, ["--devices", str(tmp_path / "none*")])
    assert r.exit_code == 0, r.output
    check("gpu.txt", r.output)


def test_reap_table(monkeypatch):
    ds = [
        Decision(holder(pid=4242, sid=4200, owner="current", run="train", attempt=3, nvml_visible=True,
                        gpu_memory_bytes=70 * GiB), "keep", "current attempt 3 of run train: never reaped"),
        Decision(holder(pid=3100, sid=3000, owner="earlier", run="train", attempt=2, age_s=3600,
                        command="python -c from multiprocessing.spawn import spawn_main"), "reap",
                 "orphan of run train attempt 2 (session 3000)"),
        Decision(holder(pid=777, sid=777, uid=1001, user="bob", gpus=[1], age_s=86400), "keep",
                 "owned by bob: needs root and --all-users"),
        Decision(holder(pid=5150, sid=1, owner="earlier", run="img", attempt=0, age_s=120, other_pid_ns=True,
                        container="4f" * 32, command="python train.py"), "reap",
                 "orphan of run img attempt 0 (container 4f4f4f4f4f4f)"),
    ]
    r = CliRunner().invoke(_table_cmd(ds, force=False))
    ds[1].outcome = "killed by SIGKILL (ignored SIGTERM)"
    ds[3].outcome = "terminated by SIGTERM"
    for d in (ds[0], ds[2]):
        d.outcome = "not touched: " + d.reason
    r2 = CliRunner().invoke(_table_cmd(ds, force=True))
    check("reap_table.txt", r.output + "--- with --force\n" + r2.output)


def _table_cmd(ds, force):
    import click

    @click.command()
    def show():
        cmd._print_table(ds, force)

    return show
