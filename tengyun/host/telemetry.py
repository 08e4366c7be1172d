"""Device readings for the server's /metrics gauges and /health/detail, from what the smi tools,
NVML and /proc report. Pure functions over parsed outputs (smi.py) and plain numbers; the
platforms gather the inputs (tengyun/platforms/*.py `device_readings`), the server's sampler
thread calls them (tengyun/entrypoints/openai/device_metrics.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tengyun.host.smi import GpuTelemetry, NpuSmiInfo

MIB = 1 << 20


@dataclass(frozen=True)
class DeviceReading:
    """One device at one moment. None: the platform cannot read that value here."""

    device: str  # "npu:0", "cuda:1", "cpu"
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    utilization: float | None  # 0..1: AI Core busy (NPU), GPU busy (CUDA), process CPU use / allowed cores
    temperature_celsius: float | None = None
    power_watts: float | None = None
    healthy: bool | None = None  # npu-smi Health "OK"
    source: str = ""  # "npu-smi", "nvml", "nvidia-smi", "torch", "/proc"

    def as_json(self) -> dict:
        return asdict(self)


def visible_ids(visible: str | None) -> set[int] | None:
    """ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES -> the ids it keeps; None (all) when unset
    or not a plain id list ("GPU-<uuid>")."""
    ids = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if not ids or not all(v.isdigit() for v in ids):
        return None
    return {int(v) for v in ids}


def npu_readings(info: NpuSmiInfo, visible: str | None) -> list[DeviceReading]:
    """`npu-smi info` rows -> one reading per visible chip: HBM where the card has it (910B), else
    DDR (310P); AICore(%) as utilization; Health "OK" as healthy. A card with several chips
    labels them "npu:<id>.<chip>"."""
    keep = visible_ids(visible)
    chips_per_npu: dict[int, int] = {}
    for d in info.devices:
        chips_per_npu[d.npu_id] = chips_per_npu.get(d.npu_id, 0) + 1
    readings = []
    for d in info.devices:
        if keep is not None and d.npu_id not in keep:
            continue
        used, total = (d.hbm_used_mb, d.hbm_total_mb) if d.hbm_total_mb else (d.memory_used_mb, d.memory_total_mb)
        name = f"npu:{d.npu_id}" if chips_per_npu[d.npu_id] == 1 else f"npu:{d.npu_id}.{d.chip_id}"
        readings.append(DeviceReading(
            name, _bytes(used), _bytes(total), _ratio(d.aicore_percent), d.temperature_c, d.power_w,
            d.health == "OK", "npu-smi"))
    return readings


def nvidia_readings(rows: list[GpuTelemetry], visible: str | None) -> list[DeviceReading]:
    """`nvidia-smi --query-gpu` rows -> one reading per visible GPU (no health column there)."""
    keep = visible_ids(visible)
    return [DeviceReading(f"cuda:{g.index}", _bytes(g.memory_used_mib), _bytes(g.memory_total_mib),
                          _ratio(g.utilization_percent), g.temperature_c, g.power_w, None, "nvidia-smi")
            for g in rows if keep is None or g.index in keep]


def parse_meminfo(text: str) -> dict[str, int]:
    """meminfo text (probe.meminfo) -> {field: bytes}: 'MemTotal:  16318468 kB' -> {'MemTotal': 16710111232}."""
    out = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        words = rest.split()
        if sep and words and words[0].isdigit():
            out[key.strip()] = int(words[0]) * (1024 if words[1:2] == ["kB"] else 1)
    return out


@dataclass
class CpuUse:
    """Process CPU use between two readings: (CPU seconds now - then) / (wall seconds * cores)."""

    cpu_s: float | None = None
    wall_s: float | None = None

    def ratio(self, cpu_s: float, wall_s: float, cores: int) -> float | None:
        """None on the first call (no interval yet); clamped to [0, 1]."""
        last_cpu, last_wall = self.cpu_s, self.wall_s
        self.cpu_s, self.wall_s = cpu_s, wall_s
        if last_cpu is None or wall_s <= last_wall or cores < 1:
            return None
        return min(max((cpu_s - last_cpu) / ((wall_s - last_wall) * cores), 0.0), 1.0)


def cpu_reading(rss_bytes: int | None, meminfo: dict[str, int], utilization: float | None) -> DeviceReading:
    """The CPU "device": the engine's process tree's resident memory out of host RAM, its CPU use."""
    return DeviceReading("cpu", rss_bytes, meminfo.get("MemTotal"), utilization, source="/proc")


def _bytes(mib: float | None) -> int | None:
    return None if mib is None else int(mib * MIB)


def _ratio(percent: float | None) -> float | None:
    return None if percent is None else percent / 100.0
