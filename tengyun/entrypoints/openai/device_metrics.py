"""Device gauges in /metrics and the device part of /health/detail.

A daemon thread (DeviceSampler) asks the platform for its devices' readings every
--device-metrics-interval seconds: npu-smi, NVML / nvidia-smi, /proc (milliseconds to a second
or two), never on the event loop or in an engine step. It keeps only the latest sample;
DeviceCollector turns that sample into gauges when Prometheus scrapes, touching no device.

    tengyun:device_memory_used_bytes{device,node}     HBM / GPU memory in use (CPU: the engine's RSS)
    tengyun:device_memory_total_bytes{device,node}    its capacity (CPU: host RAM)
    tengyun:device_utilization_ratio{device,node}     0..1: AI Core / GPU busy, CPU: process use / cores
    tengyun:device_temperature_celsius{device,node}   where readable (npu-smi, NVML, nvidia-smi)
    tengyun:device_power_watts{device,node}           where readable
    tengyun:device_health{device,node}                1 healthy, 0 not (npu-smi Health)
    tengyun:device_link_up{device,node}               1 UP, 0 DOWN (hccn_tool, NPU)
    tengyun:host_memory_total_bytes{node}, tengyun:host_memory_available_bytes{node}
    tengyun:device_sample_timestamp_seconds{node}     when the sample was taken (stale: sampler stuck)
A value the platform cannot read is left out, not written as 0.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily

from tengyun.host import probe
from tengyun.host.telemetry import DeviceReading, parse_meminfo

logger = logging.getLogger("tengyun.server")

PREFIX = "tengyun:"
# (gauge name, DeviceReading field, help)
DEVICE_GAUGES = (
    ("device_memory_used_bytes", "memory_used_bytes",
     "Device memory in use: HBM (NPU), GPU memory (CUDA), the engine's resident memory (CPU)."),
    ("device_memory_total_bytes", "memory_total_bytes", "Device memory capacity (CPU: host RAM)."),
    ("device_utilization_ratio", "utilization",
     "Busy fraction 0..1: AI Core (NPU), GPU (CUDA), engine CPU use over its allowed cores (CPU)."),
    ("device_temperature_celsius", "temperature_celsius", "Device temperature."),
    ("device_power_watts", "power_watts", "Device power draw."),
    ("device_health", "healthy", "1 when the device reports itself healthy (npu-smi Health OK), else 0."),
)
# Families with no vLLM twin (the vllm: aliases leave them out).
TENGYUN_ONLY_FAMILIES = tuple(PREFIX + name for name, _, _ in DEVICE_GAUGES) + tuple(PREFIX + name for name in (
    "device_link_up", "host_memory_total_bytes", "host_memory_available_bytes", "device_sample_timestamp_seconds",
    "server_ready", "http_responses"))


@dataclass(frozen=True)
class DeviceSample:
    readings: list[DeviceReading]
    links: dict[str, str] | None  # {"npu:0": "UP"}; None where the platform has no link tool
    host_memory: dict[str, int] = field(default_factory=dict)  # /proc/meminfo MemTotal, MemAvailable (bytes)
    taken_at: float = 0.0  # time.time()

    def as_json(self) -> dict:
        return {"devices": [r.as_json() for r in self.readings], "links": self.links,
                "host_memory_total_bytes": self.host_memory.get("MemTotal"),
                "host_memory_available_bytes": self.host_memory.get("MemAvailable"),
                "sampled_at": self.taken_at}


class DeviceSampler:
    """Samples ``platform`` (a tengyun.platforms Platform) every ``interval_s`` seconds in a daemon
    thread, the first sample at start(); ``latest`` is the newest sample (None before it)."""

    def __init__(self, platform, interval_s: float, node: str | None = None):
        self.platform = platform
        self.interval_s = interval_s
        self.node = node or socket.gethostname()
        self.latest: DeviceSample | None = None  # replaced whole: readers never see a half-written sample
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="tengyun-device-sampler")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.latest = self.sample_once()
                self._failing = False
            except Exception as e:  # a tool that misbehaves must not end the sampling
                if not self._failing:
                    logger.warning("Reading the devices failed (%s); retrying every %.0f s", e, self.interval_s)
                self._failing = True
            self._stop.wait(self.interval_s)

    def sample_once(self) -> DeviceSample:
        meminfo = parse_meminfo(probe.meminfo())
        host = {k: meminfo[k] for k in ("MemTotal", "MemAvailable") if k in meminfo}
        return DeviceSample(self.platform.device_readings(), self.platform.link_status(), host, time.time())


class DeviceCollector:
    """Gauges from the sampler's latest sample, built at scrape time; register it in the metrics
    registry. Nothing before the first sample."""

    def __init__(self, sampler: DeviceSampler):
        self.sampler = sampler

    def describe(self):
        return []  # registration must not collect: the first sample may not exist yet

    def collect(self):
        sample, node = self.sampler.latest, self.sampler.node
        if sample is None:
            return
        for name, attribute, documentation in DEVICE_GAUGES:
            family = GaugeMetricFamily(PREFIX + name, documentation, labels=["device", "node"])
            for reading in sample.readings:
                value = getattr(reading, attribute)
                if value is not None:
                    family.add_metric([reading.device, node], float(value))
            if family.samples:
                yield family
        if sample.links is not None:
            links = GaugeMetricFamily(PREFIX + "device_link_up", "1 when the device's HCCL link is UP "
                                      "(hccn_tool -link -g), 0 when DOWN.", labels=["device", "node"])
            for device, status in sample.links.items():
                if status in ("UP", "DOWN"):
                    links.add_metric([device, node], float(status == "UP"))
            yield links
        for key, name in (("MemTotal", "host_memory_total_bytes"), ("MemAvailable", "host_memory_available_bytes")):
            if key in sample.host_memory:
                yield _node_gauge(PREFIX + name, f"Host RAM ({key} of /proc/meminfo).", node, sample.host_memory[key])
        yield _node_gauge(PREFIX + "device_sample_timestamp_seconds", "Unix time of the device sample shown.",
                          node, sample.taken_at)


def _node_gauge(name: str, documentation: str, node: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=["node"])
    family.add_metric([node], float(value))
    return family
