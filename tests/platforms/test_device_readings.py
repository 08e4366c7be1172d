"""Platform.device_readings / link_status: the CPU for real on this host; NPU and CUDA through
stand-in npu-smi / nvidia-smi / hccn_tool executables on PATH that print recorded outputs
(tests/fixtures/ops), and NVML through a stand-in pynvml module."""

from __future__ import annotations

import os
import stat
import sys
import types
from pathlib import Path

import pytest

from tengyun.host import probe
from tengyun.host.telemetry import DeviceReading, parse_meminfo
from tengyun.platforms.cuda import platform as cuda
from tengyun.platforms.cpu.platform import CpuPlatform
from tengyun.platforms.cuda.platform import CudaPlatform
from tengyun.platforms.npu.platform import NpuPlatform

FIXTURES = Path(__file__).parents[1] / "fixtures" / "ops"
MIB = 1 << 20


@pytest.fixture
def tools(tmp_path, monkeypatch):
    """tools(name, script body) puts an executable shell script ``name`` first on PATH."""
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

    def install(name: str, body: str) -> None:
        path = tmp_path / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)

    return install


def test_cpu_reading_on_this_host_is_the_process_rss_host_ram_and_cpu_use():
    platform = CpuPlatform()
    first, = platform.device_readings()
    assert first.device == "cpu" and first.source == "/proc"
    assert first.utilization is None  # no interval yet
    assert first.memory_total_bytes == parse_meminfo(probe.meminfo())["MemTotal"]
    assert 0 < first.memory_used_bytes < first.memory_total_bytes
    busy_until = probe.process_tree_cpu_s(os.getpid()) + 0.2
    while probe.process_tree_cpu_s(os.getpid()) < busy_until:  # burn 0.2 CPU seconds
        pass
    second, = platform.device_readings()
    assert 0 < second.utilization <= 1
    assert platform.link_status() is None


def test_npu_readings_come_from_npu_smi_and_links_from_hccn_tool(tools, monkeypatch):
    tools("npu-smi", f'[ "$1" = info ] && cat {FIXTURES / "npu_smi_info_910b3_x8.txt"}')
    tools("hccn_tool", f'[ "$2" = 1 ] && cat {FIXTURES / "hccn_tool_link_down.txt"} || '
                       f'cat {FIXTURES / "hccn_tool_link_up.txt"}')
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0,1")
    platform = NpuPlatform()
    assert platform.device_readings() == [
        DeviceReading("npu:0", 3318 * MIB, 65536 * MIB, 0.0, 43.0, 101.8, True, "npu-smi"),
        DeviceReading("npu:1", 3314 * MIB, 65536 * MIB, 0.0, 39.0, 92.0, True, "npu-smi")]
    assert platform.link_status() == {"npu:0": "UP", "npu:1": "DOWN"}


def test_npu_without_tools_reads_nothing_rather_than_initialising_a_device(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # neither npu-smi nor hccn_tool; torch_npu not imported
    monkeypatch.setattr(probe, "HCCN_TOOL", tmp_path / "hccn_tool")
    assert NpuPlatform().device_readings() == []
    assert NpuPlatform().link_status() is None


def test_cuda_readings_come_from_nvidia_smi_without_nvml(tools, monkeypatch):
    tools("nvidia-smi", f"cat {FIXTURES / 'nvidia_smi_query_1080ti_1060.csv'}")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed
    cuda._nvml.cache_clear()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    try:
        assert [(r.device, r.memory_used_bytes, r.power_watts, r.source) for r in CudaPlatform().device_readings()] \
            == [("cuda:0", 2856 * MIB, 106.56, "nvidia-smi"), ("cuda:1", 4 * MIB, 5.68, "nvidia-smi")]
    finally:
        cuda._nvml.cache_clear()


def fake_pynvml() -> types.ModuleType:
    """NVML's Python API as nvidia-ml-py exposes it, for two GPUs; GPU 1 has no power sensor."""
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def power(handle):
        if handle == 1:
            raise NVMLError("Not Supported")
        return 312_500  # milliwatts

    nvml.NVMLError = NVMLError
    nvml.NVML_TEMPERATURE_GPU = 0
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetCount = lambda: 2
    nvml.nvmlDeviceGetHandleByIndex = lambda index: index
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=(h + 1) << 30, total=80 << 30, free=0)
    nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=[75, 0][h], memory=0)
    nvml.nvmlDeviceGetTemperature = lambda h, sensor: [61, 40][h]
    nvml.nvmlDeviceGetPowerUsage = power
    return nvml


def test_cuda_readings_prefer_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    cuda._nvml.cache_clear()
    try:
        assert CudaPlatform().device_readings() == [
            DeviceReading("cuda:1", 2 << 30, 80 << 30, 0.0, 40, None, None, "nvml")]
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
        assert CudaPlatform().device_readings()[0] == DeviceReading("cuda:0", 1 << 30, 80 << 30, 0.75, 61, 312.5,
                                                                    None, "nvml")
    finally:
        cuda._nvml.cache_clear()
