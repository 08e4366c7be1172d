"""`tengyun doctor`: every check's OK, WARN and FAIL on recorded machine outputs, and the real
command on this CPU-only machine."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from tengyun.host.compat import load_table, version_key
from tengyun.ops.doctor import Status, check_gcc, check_numa, check_topology, exit_code, run_checks
from tengyun.host.probe import CommandOutput, HostFacts

FIXTURES = Path(__file__).parents[1] / "fixtures" / "ops"
GiB = 2**30


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def ran(text: str) -> CommandOutput:
    return CommandOutput(0, text, "")


# An 8-node Kunpeng host (24 CPUs per node), NPUs placed as the recorded topo's CPU Affinity says.
KUNPENG_NODES = {n: f"{24 * n}-{24 * n + 23}" for n in range(8)}
NPU_NODES = {"0000:C1:00.0": 6, "0000:C2:00.0": 6, "0000:81:00.0": 4, "0000:82:00.0": 4,
             "0000:01:00.0": 0, "0000:02:00.0": 0, "0000:41:00.0": 2, "0000:42:00.0": 2}


def ascend_host(**changes) -> HostFacts:
    """A healthy Atlas 800T A2: CANN 8.5.0, torch 2.6.0 + torch_npu 2.6.0.post5 (a documented
    pair), driver of Ascend HDK 25.5.0, eight healthy 910B3 on HCCS."""
    devices = [{"type": "npu", "index": i, "name": "Ascend910B3", "total_memory": 64 * GiB} for i in range(8)]
    facts = HostFacts(
        python_version="3.10.14", machine="aarch64", cpu_count=192, memory_bytes=1536 * GiB,
        packages={"torch": "2.6.0", "torch_npu": "2.6.0.post5", "transformers": "4.51.0", "tengyun": "0.1.0"},
        torch_probe={"torch": "2.6.0", "torch_npu": "2.6.0.post5", "npu_available": True, "devices": devices,
                     "platform": "npu", "npu_scatter_pa_kv_cache": True, "atb": "loaded"},
        env={"ASCEND_TOOLKIT_HOME": "/usr/local/Ascend/ascend-toolkit/latest",
             "ASCEND_OPP_PATH": "/usr/local/Ascend/ascend-toolkit/latest/opp",
             "LD_LIBRARY_PATH": "/usr/local/Ascend/ascend-toolkit/latest/lib64:/usr/local/Ascend/driver/lib64"},
        files={"cann": fixture("ascend_toolkit_install.info"),
               "driver": fixture("driver_version.info").replace("Version=24.1.rc1", "Version=25.5.0"),
               "firmware": fixture("firmware_version.info")},
        commands={"npu-smi info": ran(fixture("npu_smi_info_910b3_x8.txt")),
                  "npu-smi info -t topo": ran(fixture("npu_smi_topo_910b3_x8.txt")),
                  "npu-smi info -t board -i 0": ran(fixture("npu_smi_board_910.txt")),
                  "nvidia-smi query": None, "nvidia-smi topo -m": None,
                  "gcc --version": ran("gcc (GCC) 10.3.1\n")},
        numa_nodes=dict(KUNPENG_NODES), pci_numa=dict(NPU_NODES),
    )
    return dataclasses.replace(facts, **changes)


def cpu_host(**changes) -> HostFacts:
    facts = HostFacts(python_version="3.11.7", machine="x86_64", cpu_count=2, memory_bytes=24 * GiB,
                      packages={"torch": "2.13.0+cpu", "torch_npu": None},
                      torch_probe={"torch": "2.13.0+cpu", "devices": [], "platform": "cpu"},
                      commands={"npu-smi info": None, "nvidia-smi topo -m": None,
                                "gcc --version": ran("gcc (Debian 12.2.0-14+deb12u1) 12.2.0\n")},
                      numa_nodes={0: "0-1"})
    return dataclasses.replace(facts, **changes)


def by_check(findings, check):
    return [f for f in findings if f.check == check]


def only(findings, check):
    found = by_check(findings, check)
    assert len(found) == 1, found
    return found[0]


def _without_nnal(scatter: bool) -> HostFacts:
    """The healthy host with NNAL missing (the ATB library's recorded load error), its torch_npu
    with or without npu_scatter_pa_kv_cache."""
    probe = {k: v for k, v in ascend_host().torch_probe.items() if k != "atb"}
    return ascend_host(torch_probe={**probe, "atb_error": fixture("atb_load_error_nnal_missing.txt"),
                                    "npu_scatter_pa_kv_cache": scatter})


def test_nnal_missing_fails_when_the_cache_write_needs_atb_and_names_its_set_env():
    finding = only(run_checks(_without_nnal(scatter=False)), "NNAL")
    assert finding.status == Status.FAIL
    assert "libatb.so: cannot open shared object file" in finding.detail
    assert "no npu_scatter_pa_kv_cache" in finding.detail
    assert "`source /usr/local/Ascend/nnal/atb/set_env.sh`" in finding.fix


def test_nnal_missing_only_warns_where_npu_scatter_pa_kv_cache_writes_the_cache():
    finding = only(run_checks(_without_nnal(scatter=True)), "NNAL")
    assert finding.status == Status.WARN and "/usr/local/Ascend/nnal/atb/set_env.sh" in finding.fix


def test_healthy_ascend_host_is_all_ok():
    findings = run_checks(ascend_host())
    assert {f.status for f in findings} == {Status.OK}, [f for f in findings if f.status != Status.OK]
    assert exit_code(findings) == 0
    assert only(findings, "platform").detail.startswith("npu: 8 device(s)")
    assert only(findings, "NNAL").detail == "the ATB library (libatb.so) loads"
    assert only(findings, "torch_npu").detail == "torch_npu 2.6.0.post5 with CANN 8.5.0 (documented pair)"
    assert only(findings, "driver").detail == "NPU driver 25.5.0 (CANN 8.5.0 is documented with >= 25.5.0)"
    assert only(findings, "NPUs").detail.startswith("8 NPU(s) healthy: NPU0 910B3 65536 MB")
    assert only(findings, "topology").detail.startswith("TP 8 groups of NPU0, NPU1")
    assert "NPU0 0000:C1:00.0 -> node 6, NPU1 0000:C2:00.0 -> node 6, NPU2 0000:81:00.0 -> node 4" \
        in only(findings, "NUMA").detail


def test_cpu_host_reports_the_cpu_platform_and_skips_ascend():
    findings = run_checks(cpu_host())
    assert exit_code(findings) == 0
    assert only(findings, "platform").detail == "CPU: 2 cores, 24.0 GiB RAM (no NPU or GPU found)"
    assert only(findings, "Ascend").status == Status.OK
    assert not by_check(findings, "CANN") and not by_check(findings, "driver")
    assert only(findings, "NUMA").detail == "1 NUMA node: binding is a no-op here"


def test_torch_npu_built_for_another_torch_fails_naming_both():
    probe = dict(ascend_host().torch_probe, torch="2.5.1")
    findings = run_checks(ascend_host(torch_probe=probe))
    failed = [f for f in by_check(findings, "torch_npu") if f.status == Status.FAIL]
    assert len(failed) == 1
    assert failed[0].detail == "torch_npu 2.6.0.post5 is built for torch 2.6.0 but torch 2.5.1 is installed"
    assert failed[0].fix == "pip install torch==2.6.0, or a torch_npu for torch 2.5.1 (2.5.1, 2.5.1.post1)"
    assert exit_code(findings) == 1


def test_torch_npu_paired_with_another_cann_warns_with_the_documented_pairs():
    probe = dict(ascend_host().torch_probe, torch_npu="2.6.0.post3")
    f = only(run_checks(ascend_host(torch_probe=probe)), "torch_npu")
    assert f.status == Status.WARN
    assert f.detail == "torch_npu 2.6.0.post3 is documented with CANN 8.3.RC1, not CANN 8.5.0"
    assert f.fix == "install CANN 8.3.RC1, or torch_npu 2.6.0.post5 for CANN 8.5.0"


def test_unknown_torch_npu_build_warns():
    probe = dict(ascend_host().torch_probe, torch_npu="2.6.0.dev20250101")
    f = only(run_checks(ascend_host(torch_probe=probe)), "torch_npu")
    assert f.status == Status.WARN and "not in the compatibility table" in f.detail


def test_missing_torch_npu_on_an_ascend_host_fails_with_the_pip_line():
    probe = {k: v for k, v in ascend_host().torch_probe.items() if k not in ("torch_npu", "npu_available")}
    facts = ascend_host(torch_probe=dict(probe, platform="cpu"),
                        packages=dict(ascend_host().packages, torch_npu=None))
    findings = run_checks(facts)
    f = only(findings, "torch_npu")
    assert (f.status, f.fix) == (Status.FAIL, "pip install torch-npu==2.6.0.post5")
    assert only(findings, "platform").status == Status.WARN  # npu-smi is here, torch_npu is not


def test_set_env_not_sourced_fails_with_the_source_line():
    f = only(run_checks(ascend_host(env={"LD_LIBRARY_PATH": "/usr/lib"})), "set_env.sh")
    assert f.status == Status.FAIL
    assert f.detail == ("the CANN environment is not sourced: ASCEND_TOOLKIT_HOME, ASCEND_OPP_PATH, "
                        "LD_LIBRARY_PATH without Ascend libraries")
    assert f.fix.startswith("run `source /usr/local/Ascend/ascend-toolkit/set_env.sh`")


def test_missing_cann_fails():
    findings = run_checks(ascend_host(files=dict(ascend_host().files, cann=None)))
    assert only(findings, "CANN").status == Status.FAIL


def test_driver_older_than_the_cann_hdk_warns():
    facts = ascend_host(files=dict(ascend_host().files, driver=fixture("driver_version.info")))  # 24.1.rc1
    f = only(run_checks(facts), "driver")
    assert f.status == Status.WARN
    assert f.detail == "NPU driver 24.1.rc1 is older than Ascend HDK 25.5.0, which CANN 8.5.0 is documented with"
    assert f.fix == "upgrade the NPU driver to >= 25.5.0"


def test_firmware_older_than_documented_warns_and_incompatible_fails():
    cann_800 = fixture("ascend_toolkit_install.info").replace("version=8.5.0", "version=8.0.0")
    facts = ascend_host(files=dict(ascend_host().files, cann=cann_800))  # HDK 24.1.rc2 / firmware 7.3.0.1.231
    f = only(run_checks(facts), "firmware")
    assert f.status == Status.WARN
    assert f.detail.startswith("NPU firmware 7.1.0.11.220 is older than 7.3.0.1.231")
    board = fixture("npu_smi_board_910.txt").replace("Compatibility                  : OK",
                                                     "Compatibility                  : NOK")
    facts = ascend_host(commands=dict(ascend_host().commands, **{"npu-smi info -t board -i 0": ran(board)}))
    f = only(run_checks(facts), "firmware")
    assert f.status == Status.FAIL and f.detail == "npu-smi reports driver/firmware Compatibility: NOK"


def test_unhealthy_npu_fails_and_missing_npu_smi_fails():
    text = fixture("npu_smi_info_910b3_x8.txt").replace("| 3     910B3               | OK            |",
                                                         "| 3     910B3               | Alarm         |")
    facts = ascend_host(commands=dict(ascend_host().commands, **{"npu-smi info": ran(text)}))
    f = only(run_checks(facts), "NPUs")
    assert (f.status, f.detail) == (Status.FAIL, "1 of 8 NPUs not healthy: NPU3 Alarm")
    facts = ascend_host(commands=dict(ascend_host().commands, **{"npu-smi info": None}))
    f = only(run_checks(facts), "NPUs")
    assert (f.status, f.detail) == (Status.FAIL, "npu-smi is not installed")


def test_tp_group_across_a_pcie_link_warns():
    facts = cpu_host(commands={"nvidia-smi topo -m": ran(fixture("nvidia_smi_topo_a10_x4.txt"))})
    f = only(check_topology(facts, tp_size=2), "topology")
    assert f.status == Status.WARN
    assert f.detail == ("TP group GPU0-GPU1 crosses SYS (GPU0-GPU1); TP group GPU2-GPU3 crosses SYS (GPU2-GPU3) "
                        "(links seen: SYS)")
    nvlink = cpu_host(commands={"nvidia-smi topo -m": ran(fixture("nvidia_smi_topo_a100_x8.txt"))})
    assert only(check_topology(nvlink, tp_size=8), "topology").status == Status.OK
    hccs = ascend_host()
    assert only(check_topology(hccs, tp_size=4), "topology").detail.startswith("TP 4 groups")


def test_numa_findings():
    assert only(check_numa(ascend_host()), "NUMA").status == Status.OK
    unknown = ascend_host(pci_numa=dict(NPU_NODES, **{"0000:42:00.0": -1}))
    f = only(check_numa(unknown), "NUMA")
    assert f.status == Status.WARN and "0000:42:00.0" in f.fix
    assert only(check_numa(ascend_host(pci_numa={})), "NUMA").status == Status.WARN


def test_cuda_host_names_the_optional_kernels_and_how_to_get_them():
    devices = [{"type": "cuda", "index": 0, "name": "NVIDIA H200", "total_memory": 140 * GiB}]
    bare = cpu_host(torch_probe={"torch": "2.13.0", "torch_cuda": "12.8", "devices": devices, "platform": "cuda"})
    findings = run_checks(bare)
    assert only(findings, "flash-attn").status == Status.WARN and only(findings, "flash-attn").fix.startswith(
        "pip install flash-attn")
    assert only(findings, "fla").status == Status.WARN and "fla-core" in only(findings, "fla").fix
    equipped = dataclasses.replace(bare, packages={**bare.packages, "flash_attn": "2.8.3", "fla_core": "0.6.0"})
    findings = run_checks(equipped)
    assert only(findings, "flash-attn").status == only(findings, "fla").status == Status.OK
    assert "decode graphs on" in only(findings, "flash-attn").detail
    assert not by_check(run_checks(cpu_host()), "flash-attn")  # CPU hosts: not a concern


def test_gcc_findings():
    assert only(check_gcc(ascend_host()), "gcc").detail == "gcc 10.3.1"
    old = only(check_gcc(ascend_host(commands={"gcc --version": ran("gcc (GCC) 7.3.0\n")})), "gcc")
    assert (old.status, old.fix) == (Status.WARN, "install gcc >= 10.2 for kernel builds")
    missing = only(check_gcc(cpu_host(commands={"gcc --version": None})), "gcc")
    assert missing.status == Status.WARN and missing.detail == "gcc not found"


def test_gcc_newer_than_the_cann_release_documents_warns():
    cann_800 = fixture("ascend_toolkit_install.info").replace("version=8.5.0", "version=8.0.0")
    gcc_12 = {"gcc --version": ran("gcc (Debian 12.2.0-14+deb12u1) 12.2.0\n")}
    new = only(check_gcc(ascend_host(files=dict(ascend_host().files, cann=cann_800), commands=gcc_12)), "gcc")
    assert new.status == Status.WARN
    assert new.detail.startswith("gcc 12.2.0 is newer than the gcc 11 CANN 8.0.0 is documented with")
    assert new.fix.startswith("build torch_npu extensions and custom operators with gcc 7.3.0 - 11.x")
    gcc_11 = {"gcc --version": ran("gcc (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0\n")}  # vllm-ascend #592's host
    fits = only(check_gcc(ascend_host(files=dict(ascend_host().files, cann=cann_800), commands=gcc_11)), "gcc")
    assert (fits.status, fits.detail) == (Status.OK, "gcc 11.4.0 (CANN 8.0.0 is documented with gcc 7.3.0 - 11.x)")
    assert only(check_gcc(ascend_host(commands=gcc_12)), "gcc").status == Status.OK  # CANN 8.5.0: no ceiling
    assert load_table().gcc_for("8.0.RC2").gcc_max == "11" and load_table().gcc_for("9.1.0") is None


def test_npus_whose_memory_another_process_holds_warn_naming_the_free_ones():
    busy_smi = ran(fixture("npu_smi_info_910b3_x8_busy.txt"))  # vllm-ascend issue #592's host
    busy = ascend_host(commands={**ascend_host().commands, "npu-smi info": busy_smi})
    f = only(run_checks(busy), "NPU memory")
    assert f.status == Status.WARN
    assert f.detail == ("6 of 8 NPUs already hold memory: NPU2 56631/65536 MB in use (pid 1036531); NPU3 56631/65536 "
                        "MB in use (pid 1036533); NPU4 64750/65536 MB in use (pid 2729266); NPU5 64749/65536 MB in "
                        "use (pid 2729268); NPU6 64750/65536 MB in use (pid 2729275); NPU7 64751/65536 MB in use "
                        "(pid 2729282)")
    assert "serve on the others with ASCEND_RT_VISIBLE_DEVICES=0,1" in f.fix
    idle = only(run_checks(ascend_host()), "NPU memory")  # 3318 of 65536 MB: the idle reservation
    assert (idle.status, idle.detail) == (Status.OK, "8 NPU(s) free (no process holds them)")


def test_known_bad_versions_are_the_ones_serve_refuses():
    from tengyun.host.versions import known_bad_versions

    assert known_bad_versions(ascend_host()) == []
    other_torch = known_bad_versions(ascend_host(torch_probe=dict(ascend_host().torch_probe, torch="2.5.1")))
    assert [f.detail for f in other_torch] == ["torch_npu 2.6.0.post5 is built for torch 2.6.0 but torch 2.5.1 is "
                                               "installed"]
    old_driver = ascend_host(files=dict(ascend_host().files, driver=fixture("driver_version.info")))
    assert [f.check for f in known_bad_versions(old_driver)] == ["driver"]
    # torch_npu 2.6.0.post5 (CANN 8.5.0) on the older CANN 8.3.RC1 is refused; 2.6.0.post3 (8.3.RC1) on 8.5.0 warns only
    cann_83 = fixture("ascend_toolkit_install.info").replace("version=8.5.0", "version=8.3.RC1")
    older = ascend_host(files=dict(ascend_host().files, cann=cann_83,
                                   driver=fixture("driver_version.info").replace("24.1.rc1", "25.5.0")))
    assert [f.detail for f in known_bad_versions(older)] == [
        "torch_npu 2.6.0.post5 is documented with CANN 8.5.0, not CANN 8.3.RC1 (an older CANN)"]
    newer = ascend_host(torch_probe=dict(ascend_host().torch_probe, torch_npu="2.6.0.post3"))
    assert known_bad_versions(newer) == []


def test_old_python_and_hung_torch_import_fail():
    findings = run_checks(cpu_host(python_version="3.9.18"))
    assert only(findings, "python").status == Status.FAIL
    hung = run_checks(cpu_host(torch_probe={"error": "importing torch / torch_npu did not finish in 120 s",
                                            "timed_out": True}))
    assert only(hung, "torch").status == Status.FAIL and only(hung, "platform").status == Status.FAIL
    assert exit_code(hung) == 1


def test_compat_table_rows_cite_sources_and_order_versions():
    table = load_table()
    assert {r.source for r in table.torch_npu} | {r.source for r in table.cann_hdk} | \
        {r.source for r in table.cann_gcc} <= set(table.sources)
    assert all(r.torch_npu.startswith(r.torch) for r in table.torch_npu)
    assert [r.torch_npu for r in table.rows_for("8.0.0", "2.1.0+cpu")] == ["2.1.0.post10"]
    assert [r.torch_npu for r in table.rows_for("9.1.2", "2.9.0")] == ["2.9.0.post8"]  # 9.1.X
    assert table.hdk_for("8.2.RC1").driver == "25.0.rc1"
    assert version_key("8.0.RC2") < version_key("8.0.0") < version_key("8.1.RC1")
    assert version_key("24.1.rc2") < version_key("24.1.0") < version_key("25.0.rc1.1")
    assert version_key("2.10.0rc2") < version_key("2.10.0") < version_key("2.10.0.post4")


def test_doctor_command_runs_cleanly_on_this_machine():
    proc = subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "doctor", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["platform"] == "cpu" and report["ok"] is True
    checks = {f["check"]: f for f in report["findings"]}
    assert checks["platform"]["status"] == "OK" and checks["platform"]["detail"].startswith("CPU: ")
    assert {"python", "torch", "Ascend", "NUMA", "gcc"} <= set(checks)
