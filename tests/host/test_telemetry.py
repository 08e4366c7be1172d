"""Device readings from recorded npu-smi / nvidia-smi / hccn_tool outputs (tests/fixtures/README.md)
and from this host's /proc."""

from __future__ import annotations

from pathlib import Path

import pytest

from tengyun.host import probe
from tengyun.host.smi import parse_hccn_link, parse_npu_smi_info, parse_nvidia_csv
from tengyun.host.telemetry import CpuUse, DeviceReading, npu_readings, nvidia_readings, parse_meminfo, visible_ids

FIXTURES = Path(__file__).parents[1] / "fixtures" / "ops"
MIB = 1 << 20


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_npu_smi_910b3_gives_hbm_aicore_temperature_power_and_health_per_chip():
    readings = npu_readings(parse_npu_smi_info(fixture("npu_smi_info_910b3_x8.txt")), None)
    assert [r.device for r in readings] == [f"npu:{i}" for i in range(8)]
    assert readings[0] == DeviceReading("npu:0", 3318 * MIB, 65536 * MIB, 0.0, 43.0, 101.8, True, "npu-smi")
    assert [r.power_watts for r in readings] == [101.8, 92.0, 102.0, 99.8, 98.6, 99.7, 103.8, 98.2]
    assert [r.temperature_celsius for r in readings] == [43, 39, 40, 40, 45, 44, 45, 44]


def test_npu_readings_keep_the_visible_devices_only():
    info = parse_npu_smi_info(fixture("npu_smi_info_910b3_x8.txt"))
    assert [r.device for r in npu_readings(info, "2,3")] == ["npu:2", "npu:3"]
    assert len(npu_readings(info, "GPU-not-an-id")) == 8  # not a plain id list: all


def test_npu_smi_310p3_without_hbm_reads_ddr():
    readings = npu_readings(parse_npu_smi_info(fixture("npu_smi_info_310p3_x2.txt")), None)
    assert [(r.device, r.memory_used_bytes, r.memory_total_bytes, r.power_watts, r.temperature_celsius)
            for r in readings] == [("npu:0", 1074 * MIB, 21534 * MIB, 15.8, 42.0),
                                   ("npu:1", 1070 * MIB, 21534 * MIB, 15.4, 43.0)]


def test_npu_smi_mindcluster_reads_hbm_even_when_empty():
    readings = npu_readings(parse_npu_smi_info(fixture("npu_smi_info_mindcluster.txt")), None)
    assert [(r.device, r.memory_used_bytes, r.memory_total_bytes, r.power_watts) for r in readings] == [
        ("npu:0", 0, 32768 * MIB, 73.1), ("npu:7", 0, 32768 * MIB, 67.0)]


def test_npu_chip_that_is_not_ok_reads_unhealthy():
    text = fixture("npu_smi_info_910b3_x8.txt").replace("| 1     910B3               | OK     ",
                                                        "| 1     910B3               | Alarm  ")
    readings = npu_readings(parse_npu_smi_info(text), None)
    assert [r.healthy for r in readings] == [True, False] + [True] * 6


def test_nvidia_smi_csv_is_read_by_header_names_and_units():
    rows = parse_nvidia_csv(fixture("nvidia_smi_query_1080ti_1060.csv"))  # no index column: row order
    readings = nvidia_readings(rows, None)
    assert readings == [
        DeviceReading("cuda:0", 2856 * MIB, 11175 * MIB, 0.36, 60.0, 106.56, None, "nvidia-smi"),
        DeviceReading("cuda:1", 4 * MIB, 6078 * MIB, 0.0, 49.0, 5.68, None, "nvidia-smi")]
    assert [r.device for r in nvidia_readings(rows, "1")] == ["cuda:1"]


def test_nvidia_smi_telemetry_query_with_not_available_power():
    # The query probe.nvidia_smi_telemetry runs; nvidia-smi prints [N/A] where a board has no sensor.
    text = (f"{', '.join(['index', 'memory.used [MiB]', 'memory.total [MiB]', 'utilization.gpu [%]'])}, "
            "temperature.gpu, power.draw [W]\n"
            "3, 81000 MiB, 81559 MiB, 100 %, 71, [N/A]\n")
    assert probe.NVIDIA_TELEMETRY_QUERY == "index,memory.used,memory.total,utilization.gpu,temperature.gpu,power.draw"
    assert nvidia_readings(parse_nvidia_csv(text), None) == [
        DeviceReading("cuda:3", 81000 * MIB, 81559 * MIB, 1.0, 71.0, None, None, "nvidia-smi")]


def test_hccn_tool_link_status():
    assert parse_hccn_link(fixture("hccn_tool_link_up.txt")) == "UP"
    assert parse_hccn_link(fixture("hccn_tool_link_down.txt")) == "DOWN"
    assert parse_hccn_link("hccn_tool: command not supported\n") is None


def test_visible_ids():
    assert visible_ids("0, 2") == {0, 2}
    assert visible_ids(None) is None and visible_ids("") is None and visible_ids("GPU-1a2b") is None


def test_meminfo_of_this_host_matches_its_physical_memory():
    meminfo = parse_meminfo(probe.meminfo())
    assert meminfo["MemTotal"] == probe.memory_bytes()  # both from the kernel's totalram
    assert 0 < meminfo["MemAvailable"] <= meminfo["MemTotal"]
    assert parse_meminfo("MemTotal:       16318468 kB\nHugePages_Total:       0\n") == {
        "MemTotal": 16318468 * 1024, "HugePages_Total": 0}


def test_cpu_use_is_cpu_seconds_over_wall_seconds_times_cores():
    use = CpuUse()
    assert use.ratio(10.0, 100.0, 4) is None  # the first call has no interval
    assert use.ratio(12.0, 101.0, 4) == pytest.approx(0.5)  # 2 CPU s in 1 s on 4 cores
    assert use.ratio(30.0, 102.0, 4) == 1.0  # clamped (children reaped in the interval)

