"""NUMA binding: the decision from sysfs contents, the no-op on this one-node machine, and that
a multi-node decision is applied (probe's OS calls replaced)."""

from __future__ import annotations

import logging
import os

import pytest

from tengyun.host import numa, probe, smi
from tengyun.host.numa import (
    bind_to_device_numa, decide_binding, format_cpulist, parse_cpulist, physical_device_index,
)

# Atlas 800T A2 style host: 8 NUMA nodes of 24 CPUs; NPUs in PCI bus order with their numa_node.
NODES = {n: f"{24 * n}-{24 * n + 23}" for n in range(8)}
NPUS = {"0000:01:00.0": 0, "0000:02:00.0": 0, "0000:41:00.0": 2, "0000:42:00.0": 2,
        "0000:81:00.0": 4, "0000:82:00.0": 4, "0000:C1:00.0": 6, "0000:C2:00.0": 6}
ALL_CPUS = set(range(192))


def test_cpulists_round_trip():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpulist([11, 10, 8, 3, 2, 1, 0]) == "0-3,8,10-11"
    assert format_cpulist(parse_cpulist("0-55,112-167")) == "0-55,112-167"


def test_visible_devices_map_logical_to_physical():
    assert physical_device_index(1, "4,5,6,7") == 5
    assert physical_device_index(3, None) == 3 and physical_device_index(3, "") == 3
    assert physical_device_index(4, "4,5,6,7") is None
    assert physical_device_index(0, "GPU-1b724e78-eef5-4163-d43c-e4da15d41176") is None


def test_npu_worker_binds_to_its_devices_node():
    d = decide_binding("auto", "npu", 6, NODES, NPUS, None, ALL_CPUS)
    assert (d.node, d.bus_id, d.cpus) == (6, "0000:C1:00.0", tuple(range(144, 168)))
    assert d.reason == ("NUMA binding: npu device 6 (0000:C1:00.0) is on node 6: worker pinned to CPUs 144-167, "
                        "memory preferred on node 6")
    # ASCEND_RT_VISIBLE_DEVICES=4,5,6,7: logical device 0 is physical NPU 4 (bus 81, node 4).
    assert decide_binding("auto", "npu", 0, NODES, NPUS, "4,5,6,7", ALL_CPUS).node == 4


def test_binding_keeps_to_the_cpus_this_process_may_use():
    d = decide_binding("auto", "npu", 0, NODES, NPUS, None, set(range(10, 30)))
    assert d.cpus == tuple(range(10, 24))
    none_left = decide_binding("auto", "npu", 0, NODES, NPUS, None, set(range(100, 120)))
    assert none_left.node is None and "none of node 0's CPUs" in none_left.reason


def test_when_binding_is_skipped():
    assert decide_binding("off", "npu", 0, NODES, NPUS, None, ALL_CPUS).reason == \
        "NUMA binding skipped: --numa-bind off"
    one = decide_binding("auto", "npu", 0, {0: "0-1"}, {"0000:01:00.0": 0}, None, {0, 1})
    assert one.node is None and one.reason == \
        "NUMA binding skipped: this host has 1 NUMA node, nothing to bind (no-op)"
    assert decide_binding("auto", "cpu", 0, NODES, {}, None, ALL_CPUS).node is None
    unknown = decide_binding("auto", "cuda", 0, NODES, {"0000:9D:00.0": -1}, None, ALL_CPUS)
    assert unknown.node is None and "numa_node -1" in unknown.reason
    assert decide_binding("auto", "npu", 8, NODES, NPUS, None, ALL_CPUS).node is None
    with pytest.raises(ValueError, match="--numa-bind must be one of auto, off"):
        decide_binding("on", "npu", 0, NODES, NPUS, None, ALL_CPUS)


def test_binding_is_a_logged_no_op_on_this_machine(caplog):
    if len(probe.read_numa_nodes()) > 1:
        pytest.skip("this host has more than one NUMA node")
    before = os.sched_getaffinity(0)
    with caplog.at_level(logging.INFO, logger="tengyun.host.numa"):
        decision = bind_to_device_numa(0, "auto", "npu")
    assert decision.node is None
    assert os.sched_getaffinity(0) == before
    assert "NUMA binding skipped: this host has 1 NUMA node" in caplog.text


def test_multi_node_decision_pins_threads_and_memory(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(probe, "read_numa_nodes", lambda: dict(NODES))
    monkeypatch.setattr(probe, "accelerator_pci_numa", lambda kind: dict(NPUS))
    monkeypatch.setattr(probe, "allowed_cpus", lambda: set(ALL_CPUS))
    monkeypatch.setattr(probe, "pin_process_cpus", lambda cpus: calls.append(("cpus", sorted(cpus))))
    monkeypatch.setattr(probe, "prefer_memory_node", lambda node: calls.append(("mem", node)) or False)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "2,3")
    with caplog.at_level(logging.INFO, logger="tengyun.host.numa"):
        decision = numa.bind_to_device_numa(1, "auto", "npu")  # physical NPU 3: bus 42, node 2
    assert calls == [("cpus", list(range(48, 72))), ("mem", 2)]
    assert decision.reason.endswith("(libnuma not found: CPUs only; install libnuma1)")
    assert "npu device 1 (0000:42:00.0) is on node 2" in caplog.text


# ----- each worker on its own device's node, from recorded npu-smi output ------------------------
FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "ops")
# What the recorded Atlas 800T A2 says: NPU0/1 at C1/C2 (node 6), NPU2/3 at 81/82 (node 4), NPU4/5 at
# 01/02 (node 0), NPU6/7 at 41/42 (node 2): npu-smi's NPU ids are not in PCI bus order.
RECORDED = {0: 6, 1: 6, 2: 4, 3: 4, 4: 0, 5: 0, 6: 2, 7: 2}


def recorded(name: str) -> str:
    with open(os.path.join(FIXTURES, name)) as f:
        return f.read()


def lscpu_nodes(text: str) -> dict[int, str]:
    """lscpu's 'NUMA nodeN CPU(s):   0-23' lines -> {N: '0-23'} (what sysfs's node*/cpulist hold)."""
    return {int(line.split()[1][4:]): line.split()[-1] for line in text.splitlines() if line.startswith("NUMA node")
            and "CPU(s):" in line}


def test_device_nodes_from_sysfs_follow_npu_smis_numbering_not_bus_order():
    buses = {d.npu_id: d.bus_id for d in smi.parse_npu_smi_info(recorded("npu_smi_info_910b3_x8.txt")).devices}
    assert numa.device_numa_nodes(NODES, NPUS, buses, None) == RECORDED
    assert numa.device_numa_nodes(NODES, NPUS, None, None)[0] == 0  # bus order: what CUDA's PCI_BUS_ID gives
    d = decide_binding("auto", "npu", 0, NODES, NPUS, None, ALL_CPUS, device_buses=buses)
    assert (d.node, d.bus_id) == (6, "0000:C1:00.0")


def test_device_nodes_without_sysfs_come_from_the_topology_cpu_affinity():
    nodes = lscpu_nodes(recorded("lscpu_numa_kunpeng920_x4.txt"))
    topo = smi.parse_topology(recorded("npu_smi_topo_910b3_x8.txt"))
    assert nodes == NODES
    assert numa.device_numa_nodes(nodes, {}, None, topo) == RECORDED
    assert numa.node_holding("144-167", nodes) == 6 and numa.node_holding("500-501", nodes) is None


def test_each_worker_is_planned_on_its_own_devices_node():
    plan = numa.plan_worker_nodes("npu", 8, None, NODES, RECORDED)
    assert plan.nodes == [6, 6, 4, 4, 0, 0, 2, 2]
    assert plan.lines[2] == "worker 2: npu 2 -> node 4 (CPUs 96-119)"
    assert numa.plan_worker_nodes("npu", 2, "4,6", NODES, RECORDED).nodes == [0, 2]
    assert numa.plan_worker_nodes("npu", 2, None, {0: "0-1"}, {0: 0, 1: 0}) is None  # one node: nothing to do
    assert numa.plan_worker_nodes("npu", 2, None, NODES, {0: 6}) is None  # NPU1's node unknown: the worker decides


def test_worker_binds_by_the_nodes_the_unit_pins(monkeypatch):
    monkeypatch.setattr(probe, "read_numa_nodes", lambda: dict(NODES))
    monkeypatch.setattr(probe, "allowed_cpus", lambda: set(ALL_CPUS))
    monkeypatch.setattr(probe, "pin_process_cpus", lambda cpus: None)
    monkeypatch.setattr(probe, "prefer_memory_node", lambda node: True)
    monkeypatch.setenv("TENGYUN_NUMA_NODES", "6,6,4,4")
    decision = numa.bind_to_device_numa(2, "auto", "npu")
    assert decision.node == 4 and decision.cpus == tuple(range(96, 120))
    assert decision.reason.startswith("NUMA binding: npu device 2 is on node 4 ($TENGYUN_NUMA_NODES)")
    monkeypatch.setenv("TENGYUN_NUMA_NODES", "6,x")
    with pytest.raises(ValueError, match=r"\$TENGYUN_NUMA_NODES must list one NUMA node per device"):
        numa.bind_to_device_numa(0, "auto", "npu")
