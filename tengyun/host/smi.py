"""Parsers for what `npu-smi`, `nvidia-smi`, `gcc` and the Ascend version files print.

Pure functions over text; probe.py runs the commands. Every parser is tested on outputs
recorded from real machines (tests/fixtures/, sources in its README).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_BUS_ID = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]$")
_USED_TOTAL = re.compile(r"(\d+)\s*/\s*(\d+)")
_DEVICE_NAME = re.compile(r"^(NPU|GPU)\d+$")


@dataclass(frozen=True)
class NpuDevice:
    npu_id: int
    chip_id: int
    name: str  # "910B3", "310P3"
    health: str  # "OK", "Warning", "Alarm", "Critical"
    bus_id: str  # "0000:C1:00.0"
    memory_used_mb: int | None  # DDR ("Memory-Usage")
    memory_total_mb: int | None
    hbm_used_mb: int | None  # on-chip HBM, when the card has it
    hbm_total_mb: int | None
    power_w: float | None = None  # None where the tool prints NA
    temperature_c: float | None = None
    aicore_percent: float | None = None

    @property
    def device_memory_mb(self) -> int | None:
        """What the framework allocates from: HBM where present (910B), else DDR (310P)."""
        return self.hbm_total_mb if self.hbm_total_mb is not None else self.memory_total_mb


@dataclass(frozen=True)
class NpuSmiInfo:
    version: str | None  # the driver version npu-smi reports in its header
    devices: list[NpuDevice] = field(default_factory=list)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_npu_smi_info(text: str) -> NpuSmiInfo:
    """`npu-smi info`: the header's version and one NpuDevice per (NPU, chip) row pair.

    Each chip takes two table rows:
      | 0     910B3  | OK            | 101.8  43   0    / 0           |
      | 0            | 0000:C1:00.0  | 0      0    / 0  3318 / 65536 |
    The process table that may follow is ignored."""
    version = None
    match = re.search(r"npu-smi\s+\S+\s+Version:\s*(\S+)", text)
    if match:
        version = match.group(1)
    devices: list[NpuDevice] = []
    pending: tuple[int, str, str, list[str]] | None = None  # (npu_id, name, health, power/temp cell words)
    in_devices = False
    for line in text.splitlines():
        if not line.strip().startswith("|"):
            continue
        cells = _cells(line)
        if len(cells) < 3:
            continue
        if cells[0].startswith("NPU") and "Name" in cells[0]:
            in_devices = True
            continue
        if cells[0].startswith("NPU") and "Process" in cells[1]:
            in_devices = False
            continue
        if not in_devices or cells[0].startswith("Chip"):
            continue
        head = cells[0].split()
        if _BUS_ID.match(cells[1]) and pending is not None and head and head[0].isdigit():
            pairs = [(int(u), int(t)) for u, t in _USED_TOTAL.findall(cells[2])]
            memory = pairs[0] if pairs else (None, None)
            hbm = pairs[1] if len(pairs) > 1 else (None, None)
            npu_id, name, health, power_temp = pending
            devices.append(NpuDevice(npu_id, int(head[0]), name, health, cells[1].upper(),
                                     memory[0], memory[1], hbm[0], hbm[1], _number(power_temp, 0),
                                     _number(power_temp, 1), _number(cells[2].split(), 0)))
            pending = None
        elif len(head) >= 2 and head[0].isdigit():
            pending = (int(head[0]), " ".join(head[1:]), cells[1], cells[2].split())
    return NpuSmiInfo(version, devices)


def _number(words: list[str], i: int) -> float | None:
    """words[i] as a float; None when absent or not a number ("NA")."""
    try:
        return float(words[i])
    except (IndexError, ValueError):
        return None


def parse_colon_table(text: str) -> dict[str, str]:
    """`npu-smi info -t board -i 0` and friends: 'Key    : Value' lines -> {Key: Value}."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip():
            out.setdefault(key.strip(), value.strip())
    return out


def parse_key_value_file(text: str) -> dict[str, str]:
    """Ascend version files (`Version=24.1.rc1`, `version=8.5.0`) -> {lowercased key: value}."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip():
            out.setdefault(key.strip().lower(), value.strip())
    return out


@dataclass(frozen=True)
class Topology:
    """`npu-smi info -t topo` or `nvidia-smi topo -m`: link type between every device pair."""

    devices: list[str]  # ["NPU0", ...] or ["GPU0", ...], in table order
    links: dict[tuple[str, str], str]  # ("NPU0", "NPU1") -> "HCCS"; both orders present
    cpu_affinity: dict[str, str]  # "NPU0" -> "144-167" (absent when the tool prints none)
    numa_affinity: dict[str, int]  # "GPU0" -> 0 (nvidia-smi only; absent when N/A)

    def link(self, a: str, b: str) -> str:
        return self.links.get((a, b), "NA")


def parse_topology(text: str) -> Topology:
    """The matrix both tools print. Rows are tab- or space-separated; link columns are the
    header's NPUn/GPUn names (NIC columns are read and dropped); after them come the CPU
    Affinity and (nvidia-smi) NUMA Affinity cells, either of which may be empty."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    header_at = next((i for i, ln in enumerate(lines) if any(_DEVICE_NAME.match(t) for t in ln.split())), None)
    if header_at is None:
        return Topology([], {}, {}, {})
    header = lines[header_at].split()
    columns: list[str] = []
    for token in header:
        if _DEVICE_NAME.match(token) or re.match(r"^(NIC|mlx)\S*\d+$", token):
            columns.append(token)
        else:
            break
    devices = [c for c in columns if _DEVICE_NAME.match(c)]
    links: dict[tuple[str, str], str] = {}
    cpu_affinity: dict[str, str] = {}
    numa_affinity: dict[str, int] = {}
    for line in lines[header_at + 1:]:
        if line.strip().startswith("Legend"):
            break
        cells = [c.strip() for c in line.split("\t")] if "\t" in line else line.split()
        if cells and cells[0] == "":
            cells = cells[1:]
        if not cells or not _DEVICE_NAME.match(cells[0]):
            continue
        row, values = cells[0], cells[1:]
        for col, value in zip(columns, values):
            if col in devices and col != row:
                links[(row, col)] = value
        rest = values[len(columns):]
        if rest and re.match(r"^[\d,\-]+$", rest[0]):
            cpu_affinity[row] = rest[0]
        if len(rest) > 1 and rest[1].isdigit():
            numa_affinity[row] = int(rest[1])
    return Topology(devices, links, cpu_affinity, numa_affinity)


FAST_LINKS = ("HCCS", "HCCS_SW", "SIO")  # plus NV<n> (NVLink bonds)
# Slow links from worst to best; a TP group's all-reduce runs at the pace of its slowest link.
SLOW_LINKS = ("SYS", "NODE", "PHB", "PXB", "PIX", "NA")


def is_fast_link(link: str) -> bool:
    return link in FAST_LINKS or re.match(r"^NV\d+$", link) is not None


def slowest_link(links: list[str]) -> str | None:
    """The worst slow link among ``links``, or None when all are fast (HCCS / NVLink)."""
    slow = [link for link in links if not is_fast_link(link)]
    if not slow:
        return None
    return min(slow, key=lambda link: SLOW_LINKS.index(link) if link in SLOW_LINKS else 0)


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_total_mib: int
    bus_id: str


def parse_nvidia_query(text: str) -> list[GpuInfo]:
    """`nvidia-smi --query-gpu=index,name,memory.total,pci.bus_id --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and parts[0].isdigit():
            bus = parts[3]
            if re.match(r"^[0-9A-Fa-f]{8}:", bus):  # 00000000:9D:00.0 -> 0000:9D:00.0
                bus = bus[4:]
            gpus.append(GpuInfo(int(parts[0]), parts[1], int(float(parts[2])), bus.upper()))
    return gpus


def parse_gcc_version(text: str) -> str | None:
    """'gcc (Debian 12.2.0-14+deb12u1) 12.2.0' -> '12.2.0'; None if it is not gcc's banner."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    if "gcc" not in first.lower() and "g++" not in first.lower():
        return None
    versions = re.findall(r"\b(\d+\.\d+(?:\.\d+)?)\b", first)
    return versions[-1] if versions else None


def parse_nvidia_memory(text: str) -> dict[int, tuple[int, int]]:
    """`nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits`
    -> {index: (used MiB, total MiB)}; '0, 1234, 81559' -> {0: (1234, 81559)}."""
    out = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            try:
                out[int(parts[0])] = (int(float(parts[1])), int(float(parts[2])))
            except ValueError:
                continue
    return out


@dataclass(frozen=True)
class GpuTelemetry:
    """One row of `nvidia-smi --query-gpu=... --format=csv` (probe.NVIDIA_TELEMETRY_QUERY)."""

    index: int
    memory_used_mib: float | None  # None where the driver prints [N/A] / [Not Supported]
    memory_total_mib: float | None
    utilization_percent: float | None
    temperature_c: float | None
    power_w: float | None


def parse_nvidia_csv(text: str) -> list[GpuTelemetry]:
    """`nvidia-smi --query-gpu=FIELDS --format=csv` (header line, units in the cells), read by
    the header's field names so any field order works; a missing index column numbers rows in
    order. 'memory.used [MiB]' + '2856 MiB' -> memory_used_mib 2856.0; '[N/A]' -> None."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return []
    names = [re.sub(r"\s*\[.*\]$", "", h.strip()) for h in lines[0].split(",")]
    rows = []
    for order, line in enumerate(lines[1:]):
        row = dict(zip(names, (cell.strip() for cell in line.split(","))))
        value = {name: _leading_number(cell) for name, cell in row.items()}
        index = value.get("index")
        rows.append(GpuTelemetry(int(index) if index is not None else order, value.get("memory.used"),
                                 value.get("memory.total"), value.get("utilization.gpu"),
                                 value.get("temperature.gpu"), value.get("power.draw")))
    return rows


def _leading_number(cell: str) -> float | None:
    """'106.56 W' -> 106.56, '36 %' -> 36.0, '[N/A]' -> None."""
    match = re.match(r"^(-?\d+(?:\.\d+)?)", cell)
    return float(match.group(1)) if match else None


def parse_hccn_link(text: str) -> str | None:
    """`hccn_tool -i N -link -g`: 'link status: UP' -> 'UP' ('DOWN' when down); None otherwise."""
    match = re.search(r"link status\s*:\s*(\w+)", text, re.IGNORECASE)
    return match.group(1).upper() if match else None


def parse_hccn_ip(text: str) -> tuple[str, str | None] | None:
    """`hccn_tool -i N -ip -g`: 'ipaddr:192.168.100.101\\nnetmask:255.255.255.0' ->
    ('192.168.100.101', '255.255.255.0'); None when no address is configured."""
    address = re.search(r"ipaddr\s*:\s*(\d+\.\d+\.\d+\.\d+)", text, re.IGNORECASE)
    netmask = re.search(r"netmask\s*:\s*(\d+\.\d+\.\d+\.\d+)", text, re.IGNORECASE)
    return (address.group(1), netmask.group(1) if netmask else None) if address else None


@dataclass(frozen=True)
class NpuProcess:
    npu_id: int
    chip_id: int
    pid: int
    name: str  # may be empty (npu-smi shows none for processes of other containers)
    memory_mb: int


def parse_npu_processes(text: str) -> list[NpuProcess]:
    """The process table `npu-smi info` prints after the devices:
      | NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
      | 2       0                 | 1036531       |                          | 53312                   |
    ('No running processes found in NPU 0' rows hold none)."""
    found, in_table = [], False
    for line in text.splitlines():
        if not line.strip().startswith("|"):
            continue
        cells = _cells(line)
        if len(cells) >= 2 and cells[0].startswith("NPU") and "Process" in cells[1]:
            in_table = True
            continue
        head = cells[0].split()
        if in_table and len(cells) >= 4 and len(head) == 2 and all(h.isdigit() for h in head) \
                and cells[1].isdigit() and cells[3].isdigit():
            found.append(NpuProcess(int(head[0]), int(head[1]), int(cells[1]), cells[2], int(cells[3])))
    return found
