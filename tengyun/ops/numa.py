"""NUMA binding: pin a worker to the CPUs and memory of its accelerator's NUMA node.

On a multi-socket host (an Atlas 800T A2 has 4 Kunpeng sockets, 8 NUMA nodes) a worker whose
threads and host buffers sit on another node than its NPU pays a cross-node hop on every
host<->device copy. ``bind_to_device_numa`` is called once where a worker starts
(Worker.__init__, and each process of the multi-process executor). The decision is a pure
function of recorded sysfs contents (``decide_binding``); probe.py reads sysfs and applies it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from tengyun.ops import probe

logger = logging.getLogger(__name__)

NUMA_BIND_MODES = ("auto", "off")
VISIBLE_DEVICES_ENV = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the sysfs cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpulist(cpus: list[int] | set[int]) -> str:
    """[0, 1, 2, 3, 8, 10, 11] -> '0-3,8,10-11'."""
    ordered = sorted(cpus)
    parts, start = [], None
    for i, cpu in enumerate(ordered):
        if start is None:
            start = cpu
        if i + 1 == len(ordered) or ordered[i + 1] != cpu + 1:
            parts.append(f"{start}-{cpu}" if cpu != start else str(cpu))
            start = None
    return ",".join(parts)


def physical_device_index(logical: int, visible: str | None) -> int | None:
    """Logical device ``logical`` under ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES
    ``visible`` -> physical index. '4,5,6,7' and 1 -> 5; None or '' -> ``logical``;
    None when the list names devices by UUID or has no entry ``logical``."""
    if not visible:
        return logical
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if logical >= len(entries) or not entries[logical].isdigit():
        return None
    return int(entries[logical])


@dataclass(frozen=True)
class NumaDecision:
    node: int | None  # None: do not bind
    cpus: tuple[int, ...]
    bus_id: str | None
    reason: str  # the start-up log line


def decide_binding(mode: str, device_type: str | None, device_index: int, numa_nodes: dict[int, str],
                   accelerators: dict[str, int], visible: str | None, allowed: set[int]) -> NumaDecision:
    """Whether and where to bind the worker of ``device_type`` device ``device_index``.

    ``numa_nodes``: {node: cpulist} as sysfs lists them; ``accelerators``: {PCI bus id: numa_node}
    of this kind of device, in bus order (the order npu-smi and CUDA's PCI_BUS_ID order number
    them); ``visible``: the *_VISIBLE_DEVICES value; ``allowed``: CPUs this process may use."""
    def skip(reason: str) -> NumaDecision:
        return NumaDecision(None, (), None, f"NUMA binding skipped: {reason}")

    if mode not in NUMA_BIND_MODES:
        raise ValueError(f"--numa-bind must be one of {', '.join(NUMA_BIND_MODES)}; got {mode!r}.")
    if mode == "off":
        return skip("--numa-bind off")
    if len(numa_nodes) <= 1:
        return skip(f"this host has {len(numa_nodes) or 1} NUMA node, nothing to bind (no-op)")
    if device_type not in VISIBLE_DEVICES_ENV:
        return skip(f"a {device_type or 'cpu'} worker has no accelerator to be near")
    physical = physical_device_index(device_index, visible)
    buses = list(accelerators)
    if physical is None or physical >= len(buses):
        return skip(f"{device_type} device {device_index} (physical {physical}) not found among the "
                    f"{len(buses)} PCI devices in sysfs; check {VISIBLE_DEVICES_ENV[device_type]}")
    bus = buses[physical]
    node = accelerators[bus]
    if node not in numa_nodes:
        return skip(f"{bus} reports numa_node {node} (the firmware does not say); "
                    f"bind by hand with numactl if needed")
    cpus = sorted(set(parse_cpulist(numa_nodes[node])) & allowed)
    if not cpus:
        return skip(f"none of node {node}'s CPUs ({numa_nodes[node]}) are allowed for this process")
    return NumaDecision(node, tuple(cpus), bus,
                        f"NUMA binding: {device_type} device {device_index} ({bus}) is on node {node}: "
                        f"worker pinned to CPUs {format_cpulist(cpus)}, memory preferred on node {node}")


def bind_to_device_numa(device_index: int, mode: str = "auto", device_type: str | None = None) -> NumaDecision:
    """Pin this process's threads to the NUMA node of accelerator ``device_index`` (logical,
    as torch numbers it) and prefer that node's memory. ``mode``: --numa-bind (auto binds when
    the host has more than one node; off never). ``device_type``: "npu", "cuda", or "cpu"/None
    (nothing to bind). Logs one line either way and returns the decision."""
    nodes = probe.read_numa_nodes() if mode != "off" else {}
    accelerators = {}
    if device_type in VISIBLE_DEVICES_ENV and len(nodes) > 1:
        accelerators = probe.accelerator_pci_numa(device_type)
    visible = os.environ.get(VISIBLE_DEVICES_ENV.get(device_type or "", ""))
    decision = decide_binding(mode, device_type, device_index, nodes, accelerators, visible,
                              probe.allowed_cpus())
    if decision.node is not None:
        probe.pin_process_cpus(set(decision.cpus))
        if not probe.prefer_memory_node(decision.node):
            decision = NumaDecision(decision.node, decision.cpus, decision.bus_id,
                                    decision.reason + " (libnuma not found: CPUs only; install libnuma1)")
    logger.info(decision.reason)
    return decision
