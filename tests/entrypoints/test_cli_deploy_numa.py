"""`tengyun deploy systemd` on a multi-socket NPU host binds each TP worker to its own device's
NUMA node (TENGYUN_NUMA_NODES in the unit) instead of pinning the whole service to one node. The
host is the recorded Atlas 800T A2 (tests/fixtures/ops): npu-smi info / topo, lscpu's NUMA nodes,
and no sysfs PCI view (as in a container), so the nodes come from npu-smi's CPU Affinity."""

from __future__ import annotations

from pathlib import Path

import pytest

from tengyun.entrypoints.cli.main import main
from tengyun.host import probe
from tengyun.host.probe import CommandOutput

FIXTURES = Path(__file__).parents[1] / "fixtures" / "ops"
RECORDED_OUTPUTS = {("npu-smi", "info"): "npu_smi_info_910b3_x8.txt",
                    ("npu-smi", "info", "-t", "topo"): "npu_smi_topo_910b3_x8.txt"}


@pytest.fixture
def atlas_800t_a2(monkeypatch):
    lscpu = (FIXTURES / "lscpu_numa_kunpeng920_x4.txt").read_text().splitlines()
    nodes = {int(line.split()[1][4:]): line.split()[-1] for line in lscpu if line.startswith("NUMA node") and
             "CPU(s):" in line}

    def run_command(argv, timeout=30):
        name = RECORDED_OUTPUTS.get(tuple(argv))
        return CommandOutput(0, (FIXTURES / name).read_text(), "") if name else None

    monkeypatch.setattr(probe, "read_numa_nodes", lambda: dict(nodes))
    monkeypatch.setattr(probe, "accelerator_pci_numa", lambda kind: {})
    monkeypatch.setattr(probe, "run_command", run_command)
    for name in ("TENGYUN_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)


def deploy(capsys, *flags: str, serve: tuple[str, ...] = (), env: tuple[str, ...] = ()) -> tuple[int, str, str]:
    code = main(["deploy", "systemd", "--no-capture-env", *env, *flags, "--", "serve", "/models/m", "--device", "npu",
                 *serve])
    out, err = capsys.readouterr()
    return code, out, err


def test_tp8_unit_binds_each_worker_to_its_npus_node(atlas_800t_a2, capsys):
    code, unit, _ = deploy(capsys, serve=("-tp", "8"))
    assert code == 0
    assert "Environment=TENGYUN_NUMA_NODES=6,6,4,4,0,0,2,2" in unit.splitlines()
    assert "#   worker 0: npu 0 -> node 6 (CPUs 144-167)" in unit
    assert "#   worker 7: npu 7 -> node 2 (CPUs 48-71)" in unit
    assert "numactl" not in unit


def test_visible_devices_in_the_unit_choose_which_nodes(atlas_800t_a2, capsys):
    code, unit, _ = deploy(capsys, env=("--env", "ASCEND_RT_VISIBLE_DEVICES=4,5,6,7"), serve=("-tp", "4"))
    assert code == 0 and "Environment=TENGYUN_NUMA_NODES=0,0,2,2" in unit.splitlines()


def test_numa_node_that_would_pin_workers_away_from_their_devices_is_refused(atlas_800t_a2, capsys):
    code, unit, err = deploy(capsys, "--numa-node", "6", serve=("-tp", "4"))
    assert code == 2 and unit == ""
    assert "error: --numa-node 6 would pin all 4 workers to node 6, but their devices sit on nodes 6,6,4,4: drop " \
           "--numa-node" in err
    code, unit, _ = deploy(capsys, "--numa-node", "6", serve=("-tp", "2"))  # NPU0 and NPU1 are both on node 6
    assert code == 0 and "ExecStart=/usr/bin/numactl --cpunodebind=6 --membind=6 " in unit
    assert "TENGYUN_NUMA_NODES" not in unit


def test_the_rank_table_variable_is_carried_into_the_unit():
    from tengyun.entrypoints.cli.deploy import captured_env

    assert captured_env({"RANK_TABLE_FILE": "/etc/hccl.json", "HOME": "/root"}) == {"RANK_TABLE_FILE": "/etc/hccl.json"}
