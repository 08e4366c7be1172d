"""NUMA binding: the decision from sysfs contents, the no-op on this one-node machine, and that
a multi-node decision is applied (probe's OS calls replaced)."""

from __future__ import annotations

import logging
import os

import pytest

from tengyun.ops import numa, probe
from tengyun.ops.numa import (
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
    with caplog.at_level(logging.INFO, logger="tengyun.ops.numa"):
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
    with caplog.at_level(logging.INFO, logger="tengyun.ops.numa"):
        decision = numa.bind_to_device_numa(1, "auto", "npu")  # physical NPU 3: bus 42, node 2
    assert calls == [("cpus", list(range(48, 72))), ("mem", 2)]
    assert decision.reason.endswith("(libnuma not found: CPUs only; install libnuma1)")
    assert "npu device 1 (0000:42:00.0) is on node 2" in caplog.text
