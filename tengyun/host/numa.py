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

from tengyun.host import probe, smi

logger = logging.getLogger(__name__)

NUMA_BIND_MODES = ("auto", "off")
VISIBLE_DEVICES_ENV = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}
NUMA_NODES_ENV = "TENGYUN_NUMA_NODES"  # "6,6,4,4": the node of each logical device (tengyun deploy systemd)


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
                   accelerators: dict[str, int], visible: str | None, allowed: set[int],
                   device_buses: dict[int, str] | None = None, pinned: list[int] | None = None) -> NumaDecision:
    """Whether and where to bind the worker of ``device_type`` device ``device_index``.

    ``numa_nodes``: {node: cpulist} as sysfs lists them; ``accelerators``: {PCI bus id: numa_node}
    of this kind of device, in bus order; ``device_buses``: {physical device id: bus id} as npu-smi
    lists them (an Atlas 800T A2 numbers NPU0 at C1:00.0, not in bus order); without it, bus order
    (CUDA's PCI_BUS_ID order); ``visible``: the *_VISIBLE_DEVICES value; ``allowed``: CPUs this
    process may use; ``pinned``: $TENGYUN_NUMA_NODES, the node of each logical device, as
    `tengyun deploy systemd` writes it (it wins over sysfs)."""
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
    if pinned is not None and device_index < len(pinned):
        return _bind(pinned[device_index], None, numa_nodes, allowed,
                     f"{device_type} device {device_index} is on node {pinned[device_index]} (${NUMA_NODES_ENV})")
    physical = physical_device_index(device_index, visible)
    buses = device_buses if device_buses is not None else dict(enumerate(accelerators))
    if physical is None or physical not in buses:
        return skip(f"{device_type} device {device_index} (physical {physical}) not found among the "
                    f"{len(buses)} devices listed; check {VISIBLE_DEVICES_ENV[device_type]}")
    bus = buses[physical]
    node = accelerators.get(bus, -1)
    if node not in numa_nodes:
        return skip(f"{bus} reports numa_node {node} (the firmware does not say); "
                    f"bind by hand with numactl if needed")
    return _bind(node, bus, numa_nodes, allowed, f"{device_type} device {device_index} ({bus}) is on node {node}")


def _bind(node: int, bus: str | None, numa_nodes: dict[int, str], allowed: set[int], where: str) -> NumaDecision:
    if node not in numa_nodes:
        return NumaDecision(None, (), None, f"NUMA binding skipped: {where}, which this host does not have")
    cpus = sorted(set(parse_cpulist(numa_nodes[node])) & allowed)
    if not cpus:
        return NumaDecision(None, (), None, f"NUMA binding skipped: none of node {node}'s CPUs "
                                            f"({numa_nodes[node]}) are allowed for this process")
    return NumaDecision(node, tuple(cpus), bus, f"NUMA binding: {where}: worker pinned to CPUs "
                                                f"{format_cpulist(cpus)}, memory preferred on node {node}")


def bind_to_device_numa(device_index: int, mode: str = "auto", device_type: str | None = None) -> NumaDecision:
    """Pin this process's threads to the NUMA node of accelerator ``device_index`` (logical,
    as torch numbers it) and prefer that node's memory. ``mode``: --numa-bind (auto binds when
    the host has more than one node; off never). ``device_type``: "npu", "cuda", or "cpu"/None
    (nothing to bind). Logs one line either way and returns the decision."""
    nodes = probe.read_numa_nodes() if mode != "off" else {}
    accelerators, buses = {}, None
    pinned = parse_numa_nodes_env(os.environ.get(NUMA_NODES_ENV))
    if device_type in VISIBLE_DEVICES_ENV and len(nodes) > 1 and pinned is None:
        accelerators = probe.accelerator_pci_numa(device_type)
        buses = smi_device_buses(device_type)
    visible = os.environ.get(VISIBLE_DEVICES_ENV.get(device_type or "", ""))
    decision = decide_binding(mode, device_type, device_index, nodes, accelerators, visible,
                              probe.allowed_cpus(), buses, pinned)
    if decision.node is not None:
        probe.pin_process_cpus(set(decision.cpus))
        if not probe.prefer_memory_node(decision.node):
            decision = NumaDecision(decision.node, decision.cpus, decision.bus_id,
                                    decision.reason + " (libnuma not found: CPUs only; install libnuma1)")
    logger.info(decision.reason)
    return decision


def parse_numa_nodes_env(text: str | None) -> list[int] | None:
    """$TENGYUN_NUMA_NODES '6,6,4,4' -> [6, 6, 4, 4]; None when unset or empty."""
    if not text or not text.strip():
        return None
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise ValueError(f"${NUMA_NODES_ENV} must list one NUMA node per device, e.g. 6,6,4,4; got {text!r}.") \
            from None


def smi_device_buses(device_type: str) -> dict[int, str] | None:
    """{NPU id: bus id} from `npu-smi info` (None for other devices, or when it cannot be read)."""
    if device_type != "npu":
        return None
    out = probe.npu_smi_info()
    if out is None or out.returncode != 0:
        return None
    return {d.npu_id: d.bus_id for d in smi.parse_npu_smi_info(out.stdout).devices} or None


# ----- `tengyun deploy systemd`: each worker's node, decided when the unit is written ---------------
def node_holding(cpulist: str, numa_nodes: dict[int, str]) -> int | None:
    """The node whose CPUs hold most of ``cpulist`` ('144-167' -> 6 on a 24-CPUs-per-node host)."""
    cpus = set(parse_cpulist(cpulist))
    overlap = {node: len(cpus & set(parse_cpulist(text))) for node, text in numa_nodes.items()}
    best = max(overlap, key=overlap.get, default=None)
    return best if best is not None and overlap[best] else None


def device_numa_nodes(numa_nodes: dict[int, str], pci_numa: dict[str, int], device_buses: dict[int, str] | None,
                      topo: smi.Topology | None) -> dict[int, int]:
    """{physical device id: NUMA node}: sysfs's numa_node of the device's PCI function (devices
    named by ``device_buses``, else numbered in bus order); where sysfs says -1 or is not mounted
    (a container), the topology table's NUMA Affinity (nvidia-smi) or the node holding its CPU
    Affinity (npu-smi / nvidia-smi topo)."""
    buses = device_buses if device_buses is not None else dict(enumerate(pci_numa))
    found = {dev: pci_numa[bus] for dev, bus in buses.items() if pci_numa.get(bus, -1) in numa_nodes}
    for name in topo.devices if topo else []:
        dev = int(name[3:])
        if dev in found:
            continue
        if topo.numa_affinity.get(name) in numa_nodes:
            found[dev] = topo.numa_affinity[name]
        elif name in topo.cpu_affinity and node_holding(topo.cpu_affinity[name], numa_nodes) is not None:
            found[dev] = node_holding(topo.cpu_affinity[name], numa_nodes)
    return dict(sorted(found.items()))


@dataclass(frozen=True)
class WorkerPlacement:
    nodes: list[int]  # NUMA node of local worker i's device, i = 0 .. workers - 1
    lines: list[str]  # "worker 0: npu 0 -> node 6 (CPUs 144-167)"


def plan_worker_nodes(device_type: str, workers: int, visible: str | None, numa_nodes: dict[int, str],
                      device_nodes: dict[int, int]) -> WorkerPlacement | None:
    """Each of this node's ``workers`` (local rank i uses logical device i) on its device's node;
    None on a one-node host or when a device's node is unknown (the worker then decides itself)."""
    if len(numa_nodes) <= 1:
        return None
    nodes, lines = [], []
    for worker in range(workers):
        physical = physical_device_index(worker, visible)
        if physical not in device_nodes:
            return None
        node = device_nodes[physical]
        nodes.append(node)
        lines.append(f"worker {worker}: {device_type} {physical} -> node {node} (CPUs {numa_nodes[node]})")
    return WorkerPlacement(nodes, lines)


def accelerator_kind(requested: str) -> str | None:
    """The accelerator a `--device requested` server uses on this host: npu / cuda as asked, for
    auto the kind whose PCI devices sysfs lists; None for cpu or none found."""
    if requested in VISIBLE_DEVICES_ENV:
        return requested
    if requested != "auto":
        return None
    return next((kind for kind in VISIBLE_DEVICES_ENV if probe.accelerator_pci_numa(kind)), None)


def host_device_nodes(device_type: str) -> tuple[dict[int, str], dict[int, int]]:
    """This host's ({node: cpulist}, {physical device id: node}) from sysfs, npu-smi / nvidia-smi."""
    nodes = probe.read_numa_nodes()
    if len(nodes) <= 1:
        return nodes, {}
    topo_command = "npu-smi info -t topo" if device_type == "npu" else "nvidia-smi topo -m"
    out = probe.run_command(probe.COMMANDS[topo_command], timeout=10)
    topo = smi.parse_topology(out.stdout) if out is not None and out.returncode == 0 else None
    return nodes, device_numa_nodes(nodes, probe.accelerator_pci_numa(device_type), smi_device_buses(device_type),
                                    topo)
