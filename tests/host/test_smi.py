"""Parsers of npu-smi / nvidia-smi / gcc / Ascend version files, on recorded outputs (tests/fixtures/README.md)."""

from __future__ import annotations

from pathlib import Path

from tengyun.host.smi import (
    is_fast_link, parse_colon_table, parse_gcc_version, parse_key_value_file, parse_npu_smi_info,
    parse_nvidia_query, parse_topology, slowest_link,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "ops"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_npu_smi_info_910b3_reads_every_chip_with_hbm():
    info = parse_npu_smi_info(fixture("npu_smi_info_910b3_x8.txt"))
    assert info.version == "24.1.rc1.b030"
    assert [d.npu_id for d in info.devices] == list(range(8))
    first = info.devices[0]
    assert (first.name, first.health, first.chip_id, first.bus_id) == ("910B3", "OK", 0, "0000:C1:00.0")
    assert (first.memory_used_mb, first.memory_total_mb) == (0, 0)
    assert (first.hbm_used_mb, first.hbm_total_mb, first.device_memory_mb) == (3318, 65536, 65536)
    assert [d.bus_id for d in info.devices] == ["0000:C1:00.0", "0000:C2:00.0", "0000:81:00.0", "0000:82:00.0",
                                                "0000:01:00.0", "0000:02:00.0", "0000:41:00.0", "0000:42:00.0"]


def test_npu_smi_info_310p3_uses_ddr_when_there_is_no_hbm():
    info = parse_npu_smi_info(fixture("npu_smi_info_310p3_x2.txt"))
    assert info.version is None  # this recording starts at the table
    assert [(d.npu_id, d.name, d.bus_id, d.memory_total_mb, d.hbm_total_mb) for d in info.devices] == [
        (0, "310P3", "0000:82:00.0", 21534, None), (1, "310P3", "0000:89:00.0", 21534, None)]
    assert info.devices[1].device_memory_mb == 21534


def test_npu_smi_info_skips_elisions_and_the_process_table():
    info = parse_npu_smi_info(fixture("npu_smi_info_mindcluster.txt"))
    assert info.version == "23.0.5"
    assert [(d.npu_id, d.bus_id, d.memory_used_mb, d.memory_total_mb, d.hbm_total_mb) for d in info.devices] == [
        (0, "0000:61:00.0", 920, 13553, 32768), (7, "0000:3D:00.0", 2346, 15567, 32768)]


def test_npu_smi_board_gives_firmware_and_compatibility():
    board = parse_colon_table(fixture("npu_smi_board_910.txt"))
    assert board["Firmware Version"] == "7.1.0.7.220"
    assert board["Compatibility"] == "OK"
    assert board["PCIe Bus Info"] == "0000:61:00.0"
    assert board["PCI Device ID"] == "0xD801"


def test_ascend_version_files():
    assert parse_key_value_file(fixture("driver_version.info"))["version"] == "24.1.rc1"
    assert parse_key_value_file(fixture("firmware_version.info"))["version"] == "7.1.0.11.220"
    cann = parse_key_value_file(fixture("ascend_toolkit_install.info"))
    assert (cann["version"], cann["arch"]) == ("8.5.0", "aarch64")


def test_npu_topology_is_hccs_full_mesh_with_cpu_affinity():
    topo = parse_topology(fixture("npu_smi_topo_910b3_x8.txt"))
    assert topo.devices == [f"NPU{i}" for i in range(8)]
    assert len(topo.links) == 56 and set(topo.links.values()) == {"HCCS"}
    assert topo.cpu_affinity == {"NPU0": "144-167", "NPU1": "144-167", "NPU2": "96-119", "NPU3": "96-119",
                                 "NPU4": "0-23", "NPU5": "0-23", "NPU6": "48-71", "NPU7": "48-71"}
    assert topo.numa_affinity == {}


def test_nvidia_topology_reads_gpu_links_and_drops_nic_columns():
    topo = parse_topology(fixture("nvidia_smi_topo_a100_x8.txt"))
    assert topo.devices == [f"GPU{i}" for i in range(8)]
    assert set(topo.links.values()) == {"NV12"}
    assert topo.cpu_affinity["GPU7"] == "0-103" and topo.numa_affinity["GPU7"] == 0
    pcie = parse_topology(fixture("nvidia_smi_topo_a10_x4.txt"))
    assert pcie.link("GPU0", "GPU3") == "SYS" and pcie.link("GPU3", "GPU0") == "SYS"
    home = parse_topology(fixture("nvidia_smi_topo_1080ti_x2.txt"))
    assert home.link("GPU0", "GPU1") == "PHB" and home.numa_affinity == {}  # N/A


def test_tab_separated_topology_with_empty_affinity_cells():
    # nvidia-smi writes tabs and leaves CPU Affinity empty for GPUs off the first socket's CPUs list.
    text = ("\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
            "GPU0\t X \tNV18\t44-51,148-155\t0\t\tN/A\n"
            "GPU1\tNV18\t X \t\t1\t\tN/A\n")
    topo = parse_topology(text)
    assert topo.link("GPU0", "GPU1") == "NV18"
    assert topo.cpu_affinity == {"GPU0": "44-51,148-155"}
    assert topo.numa_affinity == {"GPU0": 0, "GPU1": 1}


def test_link_speed_classes():
    assert is_fast_link("HCCS") and is_fast_link("NV12") and is_fast_link("NV18")
    assert not is_fast_link("PIX") and not is_fast_link("SYS")
    assert slowest_link(["HCCS", "NV4"]) is None
    assert slowest_link(["PIX", "SYS", "PHB"]) == "SYS"
    assert slowest_link(["NV12", "PXB", "PIX"]) == "PXB"


def test_nvidia_query_and_gcc_banner():
    gpus = parse_nvidia_query("0, NVIDIA H100 80GB HBM3, 81559, 00000000:9D:00.0\n")
    assert [(g.index, g.name, g.memory_total_mib, g.bus_id) for g in gpus] == [
        (0, "NVIDIA H100 80GB HBM3", 81559, "0000:9D:00.0")]
    assert parse_gcc_version("gcc (Debian 12.2.0-14+deb12u1) 12.2.0\nCopyright (C) 2022\n") == "12.2.0"
    assert parse_gcc_version("gcc (GCC) 7.3.0\n") == "7.3.0"
    assert parse_gcc_version("clang version 17.0.6\n") is None
