"""GPU health readings through the NVML seam, driven by the documented-API fake (no GPU here)."""
from __future__ import annotations

import pynvml
import pytest

from onbox.clock import FakeClock
from onbox.gpu.nvml import NA, NvmlSeam, clock_event_reasons, running_processes
from onbox.gpu.readings import GpuMonitor, decode_throttle, gpu_readings, inventory
from onbox.gpu.xid import parse_kernel_log, pci_key
from tests.fakes.nvml import BrokenCount, FakeGpu, FakeNvml, FakeProcess

GiB = 1 << 30


def monitor(fake, kernel_log=None, **kw):
    return GpuMonitor(NvmlSeam(fake), kernel_log=kernel_log, clock=FakeClock(), **kw)


def test_driver_absent_is_not_available_not_an_error():
    doc = gpu_readings(NvmlSeam(FakeNvml(driver=False)))
    assert doc == {"available": False, "reason": "no NVIDIA driver (libnvidia-ml.so.1 not found)", "gpus": []}


def test_readings_units_and_contract_keys():
    fake = FakeNvml([FakeGpu(util_gpu=97, sm_clock_mhz=1410, power_mw=612_345, memory_used=40 * GiB,
                             temperature_c=71, processes=[FakeProcess(4242, 39 * GiB)])])
    g = monitor(fake).readings()["gpus"][0]
    assert g["util_percent"] == 97
    assert g["sm_clock_mhz"] == 1410
    assert g["power_w"] == pytest.approx(612.345)  # NVML reports milliwatts
    assert g["memory_used_bytes"] == 40 * GiB and g["memory_total_bytes"] == 80 * GiB
    assert g["temperature_c"] == 71
    assert g["throttle_reasons"] == [] and g["xid_events"] == []
    assert g["processes"] == [{"pid": 4242, "used_memory_bytes": 39 * GiB}]
    assert g["verdict"] == "healthy"
    for key in ("index", "name", "util_percent", "sm_clock_mhz", "power_w", "memory_used_bytes",
                "memory_total_bytes", "temperature_c", "throttle_reasons", "xid_events"):
        assert key in g


def test_decode_throttle_bits():
    assert decode_throttle(0x4 | 0x8 | 0x20 | 0x40 | 0x80) == [
        "SwPowerCap", "HwSlowdown", "SwThermalSlowdown", "HwThermalSlowdown", "HwPowerBrakeSlowdown"]
    assert decode_throttle(0x1) == ["GpuIdle"]
    assert decode_throttle(0x1000 | 0x4) == ["SwPowerCap", "0x1000"]
    assert decode_throttle(0) == []


def test_throttled_verdict_and_benign_reasons():
    g = monitor(FakeNvml([FakeGpu(throttle_mask=0x40, util_gpu=100)])).readings()["gpus"][0]
    assert g["verdict"] == "throttled" and "HwThermalSlowdown" in g["verdict_reason"]
    g = monitor(FakeNvml([FakeGpu(throttle_mask=0x1 | 0x10)])).readings()["gpus"][0]
    assert g["throttle_reasons"] == ["GpuIdle", "SyncBoost"] and g["verdict"] == "healthy"


def test_deprecated_throttle_call_is_the_fallback():
    fake = FakeNvml([FakeGpu(throttle_mask=0x4)], missing={"nvmlDeviceGetCurrentClocksEventReasons"})
    seam = NvmlSeam(fake)
    seam.available()
    assert clock_event_reasons(seam, fake.gpus[0]) == 0x4
    fake.missing.add("nvmlDeviceGetCurrentClocksThrottleReasons")
    assert clock_event_reasons(seam, fake.gpus[0]) is NA


def test_v3_missing_falls_back_to_v2():
    fake = FakeNvml([FakeGpu(processes=[FakeProcess(7, GiB)])],
                    missing={"nvmlDeviceGetComputeRunningProcesses_v3"})
    seam = NvmlSeam(fake)
    seam.available()
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        fake.nvmlDeviceGetComputeRunningProcesses(fake.gpus[0])  # what a naive caller meets
    assert [p.pid for p in running_processes(seam, fake.gpus[0])] == [7]


def test_process_utilisation_not_found_is_na():
    fake = FakeNvml([FakeGpu()])
    seam = NvmlSeam(fake)
    assert seam.call("nvmlDeviceGetProcessUtilization", fake.gpus[0], 0) is NA


def test_unsupported_readings_are_none_not_errors():
    fake = FakeNvml([FakeGpu(unsupported={"nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetPowerUsage",
                                          "nvmlDeviceGetCurrentClocksEventReasons",
                                          "nvmlDeviceGetCurrentClocksThrottleReasons"})])
    g = monitor(fake).readings()["gpus"][0]
    assert g["power_w"] is None and g["throttle_reasons"] == [] and g["throttle_mask"] is None
    assert set(g["ecc"].values()) == {None}


def test_ecc_counters():
    fake = FakeNvml([FakeGpu(ecc={(1, 0): 2, (0, 1): 17})])
    ecc = monitor(fake).readings()["gpus"][0]["ecc"]
    assert ecc == {"corrected_volatile": 0, "uncorrected_volatile": 2, "corrected_aggregate": 17,
                   "uncorrected_aggregate": 0}


def test_xid_79_from_nvml_events_means_dead_card():
    fake = FakeNvml([FakeGpu(uuid="GPU-a"), FakeGpu(uuid="GPU-b", pci_bus_id="00000000:5E:00.0")])
    mon = monitor(fake)
    assert [g["verdict"] for g in mon.readings()["gpus"]] == ["healthy", "healthy"]
    fake.raise_xid(1, 79)
    fake.raise_xid(1, 13)
    doc = mon.readings()
    assert doc["gpus"][0]["verdict"] == "healthy"
    g1 = doc["gpus"][1]
    assert [e["xid"] for e in g1["xid_events"]] == [79, 13]
    assert g1["verdict"] == "dead" and "re-rent" in g1["verdict_reason"]
    assert mon.readings()["gpus"][1]["verdict"] == "dead"  # kept after the event was drained


def test_xid_registration_limited_to_supported_types():
    fake = FakeNvml([FakeGpu(supported_events=pynvml.nvmlEventTypeSingleBitEccError), FakeGpu()])
    mon = monitor(fake)
    doc = mon.readings()
    assert mon.xid_watcher.watched == [1]
    assert doc["xid_sources"]["nvml"] == "watching GPUs [1]"


DMESG = """\
[  100.1] nvidia: loading out-of-tree module taints kernel.
[ 5012.3] NVRM: Xid (PCI:0000:5e:00): 48, pid=311, name=python, Ch 00000010, DBE
[ 5013.0] NVRM: Xid (PCI:0000:3b:00): 31, pid=311, name=python, Ch 0000000e, intr 10000000
"""


def test_xid_from_kernel_log_mapped_by_pci_address():
    fake = FakeNvml([FakeGpu(), FakeGpu(pci_bus_id="00000000:5E:00.0")])
    reads = []

    def log():
        reads.append(1)
        return DMESG

    mon = monitor(fake, kernel_log=log, kernel_log_interval_s=60)
    doc = mon.readings()
    assert [(e["xid"], e["source"]) for e in doc["gpus"][0]["xid_events"]] == [(31, "dmesg")]
    assert doc["gpus"][1]["verdict"] == "dead" and "Xid 48" in doc["gpus"][1]["verdict_reason"]
    assert doc["xid_sources"]["dmesg"] == "readable"
    mon.readings()
    assert len(reads) == 1  # re-read only after the interval
    mon.clock.advance(61)
    mon.readings()
    assert len(reads) == 2


def test_kernel_log_unreadable_is_reported():
    doc = monitor(FakeNvml([FakeGpu()]), kernel_log=lambda: None).readings()
    assert doc["xid_sources"]["dmesg"] == "not readable"


def test_pci_key_forms_agree():
    assert pci_key("00000000:3B:00.0") == pci_key("0000:3b:00") == (0, 0x3B, 0)
    assert parse_kernel_log("NVRM: Xid (PCI:0000:99:00): 79, GPU has fallen off the bus.", {(0, 1, 0): 0})[0] \
        .gpu_index == 0  # one GPU takes every line


def test_pinned_when_memory_held_and_nvml_sees_nobody():
    fake = FakeNvml([FakeGpu(memory_used=30 * GiB, processes=[])])
    g = monitor(fake).readings()["gpus"][0]
    assert g["verdict"] == "pinned" and "cannot see" in g["verdict_reason"]


def test_pinned_counts_holders_not_of_the_current_attempt():
    fake = FakeNvml([FakeGpu(memory_used=30 * GiB, processes=[FakeProcess(1, 30 * GiB)])])
    mon = monitor(fake)
    holders = {0: [{"owner": "earlier"}, {"owner": "earlier"}, {"owner": "current"}]}
    g = mon.readings(holders=holders)["gpus"][0]
    assert g["verdict"] == "pinned" and "2 holders" in g["verdict_reason"]
    assert mon.readings(holders={0: [{"owner": "current"}]})["gpus"][0]["verdict"] == "healthy"


def test_inventory_unchanged():
    inv = inventory(NvmlSeam(FakeNvml([FakeGpu(memory_used=5)])))
    assert inv.available and inv.gpus[0].memory_used_bytes == 5


def test_lost_gpu_is_a_dead_card_and_the_others_still_read():
    fake = FakeNvml([FakeGpu(uuid="GPU-a"), FakeGpu(uuid="GPU-b", lost=True), FakeGpu(uuid="GPU-c")])
    doc = monitor(fake).readings()
    assert [g["index"] for g in doc["gpus"]] == [0, 1, 2]
    assert [g["verdict"] for g in doc["gpus"]] == ["healthy", "dead", "healthy"]
    assert "GPU is lost" in doc["gpus"][1]["verdict_reason"] and "re-rent" in doc["gpus"][1]["verdict_reason"]


def test_gpu_lost_after_handle_lookup():
    fake = FakeNvml([FakeGpu()])
    mon = monitor(fake)
    assert mon.readings()["gpus"][0]["verdict"] == "healthy"
    fake.gpus[0].lost = True
    assert mon.readings()["gpus"][0]["verdict"] == "dead"


def test_pinned_by_nobody_visible_anywhere():
    fake = FakeNvml([FakeGpu(memory_used=30 * GiB, processes=[])])
    g = monitor(fake).readings(holders={})["gpus"][0]
    assert g["verdict"] == "pinned" and "neither NVML nor this box's processes" in g["verdict_reason"]
    busy = FakeNvml([FakeGpu(memory_used=30 * GiB, util_gpu=80, processes=[])])
    assert monitor(busy).readings(holders={})["gpus"][0]["verdict"] == "healthy"


def test_nvml_failure_reads_as_not_available_with_the_reason():
    doc = monitor(BrokenCount([FakeGpu()])).readings()
    assert doc["available"] is False and doc["gpus"] == []
    assert doc["reason"].startswith("NVML failed: ") and "ersion" in doc["reason"]


def test_old_driver_gets_v2_not_the_misread_v3():
    fake = FakeNvml([FakeGpu(processes=[FakeProcess(4242, 3 * GiB)])], driver_version="525.85.12")
    seam = NvmlSeam(fake)
    seam.available()
    assert [p.pid for p in fake.nvmlDeviceGetComputeRunningProcesses(fake.gpus[0])] != [4242]  # the trap
    assert [(p.pid, p.usedGpuMemory) for p in running_processes(seam, fake.gpus[0])] == [(4242, 3 * GiB)]
    fake.driver_version = "535.104.05"
    assert [p.pid for p in running_processes(seam, fake.gpus[0])] == [4242]


def test_unknown_utilisation_is_not_idle():
    fake = FakeNvml([FakeGpu(memory_used=30 * GiB, processes=[], unsupported={"nvmlDeviceGetUtilizationRates"})])
    g = monitor(fake).readings()["gpus"][0]
    assert g["util_percent"] is None and g["verdict"] == "healthy"
