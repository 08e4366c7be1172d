"""`tengyun launch`: K instances on disjoint devices (or CPU cores) and consecutive ports.

plan_instances is pure: the CLI passes the visible device ids and the usable CPU cores.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class InstancePlan:
    index: int
    port: int
    devices: tuple[int, ...]  # device ids, empty on CPU
    cpus: tuple[int, ...]  # CPU cores the instance may run on
    env: dict[str, str] = field(default_factory=dict)  # visible-devices variable, OMP_NUM_THREADS

    @property
    def upstream(self) -> str:
        return f"127.0.0.1:{self.port}"


def plan_instances(instances: int, devices_per_instance: int, base_port: int, device_ids: list[int],
                   cpus: list[int], visible_devices_env: str = "") -> list[InstancePlan]:
    """Split devices and cores into ``instances`` disjoint, contiguous sets.

    NPU/CUDA (visible_devices_env set): instance i gets devices [i*D, (i+1)*D) of device_ids and
    an equal share of the cores. CPU (no devices): instance i gets an equal share of the cores
    and OMP_NUM_THREADS of that size.
    plan_instances(2, 2, 8001, [0..7], cpus 0..7, "ASCEND_RT_VISIBLE_DEVICES")
      -> ports 8001, 8002; devices (0, 1), (2, 3); cpus (0..3), (4..7)."""
    if instances < 1:
        raise ValueError(f"--instances {instances}: must be at least 1.")
    if visible_devices_env:
        if devices_per_instance < 1:
            raise ValueError(f"--devices-per-instance {devices_per_instance}: must be at least 1.")
        needed = instances * devices_per_instance
        if needed > len(device_ids):
            raise ValueError(
                f"--instances {instances} x --devices-per-instance {devices_per_instance} needs {needed} devices "
                f"but {len(device_ids)} are visible ({visible_devices_env}): lower --instances to "
                f"{max(1, len(device_ids) // devices_per_instance)}.")
    if len(cpus) < instances:
        raise ValueError(f"--instances {instances} needs at least one CPU core each but {len(cpus)} are usable: "
                         f"lower --instances to {len(cpus)}.")
    if not 0 < base_port or base_port + instances - 1 > 65535:
        raise ValueError(f"--base-port {base_port}: ports {base_port}..{base_port + instances - 1} are not valid.")
    share = len(cpus) // instances
    plans = []
    for i in range(instances):
        devices = tuple(device_ids[i * devices_per_instance:(i + 1) * devices_per_instance]) \
            if visible_devices_env else ()
        cores = tuple(cpus[i * share:(i + 1) * share])
        env = {"OMP_NUM_THREADS": str(len(cores))}
        if visible_devices_env:
            env[visible_devices_env] = ",".join(str(d) for d in devices)
        plans.append(InstancePlan(i, base_port + i, devices, cores, env))
    return plans
