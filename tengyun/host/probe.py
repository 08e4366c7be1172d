"""The one module of ops/ that touches the machine: runs npu-smi / nvidia-smi / gcc, reads
sysfs and the Ascend version files, and applies CPU / memory binding. Everything it returns is
raw text or plain numbers; doctor.py, numa.py and smi.py interpret them and are tested on
recorded outputs."""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

SYSFS_NODES = Path("/sys/devices/system/node")
SYSFS_PCI = Path("/sys/bus/pci/devices")
ASCEND_ROOT = Path("/usr/local/Ascend")
# NNAL's set_env.sh: puts the ATB library (libatb.so, torch_npu's _npu_* ATB ops) on LD_LIBRARY_PATH
NNAL_SET_ENV = str(ASCEND_ROOT / "nnal" / "atb" / "set_env.sh")
# PCI vendor id and class-code prefix of each accelerator kind.
PCI_ACCELERATORS = {"npu": ("0x19e5", "0x12"), "cuda": ("0x10de", "0x03")}
ENV_KEYS = ("LD_LIBRARY_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "ASCEND_OPP_PATH",
            "ASCEND_AICPU_PATH", "ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
PACKAGES = ("torch", "torch_npu", "transformers", "tengyun", "flash_attn", "fla_core")
COMMANDS = {
    "npu-smi info": ["npu-smi", "info"],
    "npu-smi info -t topo": ["npu-smi", "info", "-t", "topo"],
    "npu-smi info -t board -i 0": ["npu-smi", "info", "-t", "board", "-i", "0"],
    "nvidia-smi query": ["nvidia-smi", "--query-gpu=index,name,memory.total,pci.bus_id",
                         "--format=csv,noheader,nounits"],
    "nvidia-smi topo -m": ["nvidia-smi", "topo", "-m"],
    "gcc --version": ["gcc", "--version"],
}
TORCH_PROBE_TIMEOUT_S = 120

# Runs in a child process so that a hanging driver or ACL init cannot hang `tengyun doctor`.
_TORCH_PROBE = r"""
import importlib.util, json
out = {}
try:
    import torch
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
except Exception as e:
    out["torch_error"] = repr(e)
    print(json.dumps(out)); raise SystemExit(0)
devices = []
if importlib.util.find_spec("torch_npu") is not None:
    try:
        import torch_npu
        out["torch_npu"] = torch_npu.__version__
        out["npu_scatter_pa_kv_cache"] = hasattr(torch_npu, "npu_scatter_pa_kv_cache")
        out["npu_available"] = bool(torch.npu.is_available())
        for i in range(torch.npu.device_count() if out["npu_available"] else 0):
            p = torch.npu.get_device_properties(i)
            devices.append({"type": "npu", "index": i, "name": p.name, "total_memory": int(p.total_memory)})
    except Exception as e:
        out["torch_npu_error"] = repr(e)
if importlib.util.find_spec("torch_npu") is not None:  # NNAL's ATB library, as torch_npu loads it
    import ctypes
    try:
        ctypes.CDLL("libatb.so")
        out["atb"] = "loaded"
    except OSError as e:
        out["atb_error"] = str(e)
try:
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devices.append({"type": "cuda", "index": i, "name": p.name, "total_memory": int(p.total_memory)})
except Exception as e:
    out["cuda_error"] = repr(e)
out["devices"] = devices
try:
    from tengyun.platforms import current_platform_type
    out["platform"] = current_platform_type()
except Exception as e:
    out["platform_error"] = repr(e)
print(json.dumps(out))
"""


@dataclass(frozen=True)
class CommandOutput:
    returncode: int
    stdout: str
    stderr: str


@dataclass
class HostFacts:
    """Everything `tengyun doctor` looks at, as read from the machine (or from fixtures)."""

    python_version: str = ""
    machine: str = ""  # "x86_64", "aarch64"
    cpu_count: int = 0
    memory_bytes: int = 0
    packages: dict[str, str | None] = field(default_factory=dict)  # distribution -> version, None = absent
    torch_probe: dict = field(default_factory=dict)  # _TORCH_PROBE's JSON, or {"error": ..., "timed_out": bool}
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str | None] = field(default_factory=dict)  # "cann" / "driver" / "firmware" -> text
    commands: dict[str, CommandOutput | None] = field(default_factory=dict)  # None = not installed
    numa_nodes: dict[int, str] = field(default_factory=dict)  # node -> cpulist ("0-23")
    pci_numa: dict[str, int] = field(default_factory=dict)  # accelerator bus id -> numa_node (-1 unknown)


def run_command(argv: list[str], timeout: float = 30) -> CommandOutput | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return CommandOutput(124, "", f"{' '.join(argv)} did not finish in {timeout:.0f} s")
    except OSError as e:
        return CommandOutput(127, "", str(e))
    return CommandOutput(proc.returncode, proc.stdout, proc.stderr)


def probe_torch(timeout: float = TORCH_PROBE_TIMEOUT_S) -> dict:
    try:
        proc = subprocess.run([sys.executable, "-c", _TORCH_PROBE], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"importing torch / torch_npu did not finish in {timeout:.0f} s", "timed_out": True}
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1], "timed_out": False}


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def ascend_files(env: dict[str, str], machine: str) -> dict[str, str | None]:
    """The CANN toolkit, NPU driver and firmware version files, where they usually live."""
    homes = [env.get("ASCEND_TOOLKIT_HOME"), env.get("ASCEND_HOME_PATH"),
             str(ASCEND_ROOT / "ascend-toolkit" / "latest"), str(ASCEND_ROOT / "cann")]
    cann = None
    for home in filter(None, homes):
        cann = _read(Path(home) / f"{machine}-linux" / "ascend_toolkit_install.info")
        if cann is not None:
            break
    return {"cann": cann, "driver": _read(ASCEND_ROOT / "driver" / "version.info"),
            "firmware": _read(ASCEND_ROOT / "firmware" / "version.info")}


def read_numa_nodes(root: Path = SYSFS_NODES) -> dict[int, str]:
    """{node: cpulist} from /sys/devices/system/node/node*/cpulist ({} when sysfs has no nodes)."""
    nodes: dict[int, str] = {}
    for path in sorted(root.glob("node[0-9]*")):
        cpulist = _read(path / "cpulist")
        if cpulist is not None:
            nodes[int(path.name[4:])] = cpulist.strip()
    return nodes


def accelerator_pci_numa(kind: str, root: Path = SYSFS_PCI) -> dict[str, int]:
    """{bus id: numa_node} of the ``kind`` ("npu" / "cuda") PCI functions, sorted by bus id."""
    vendor, class_prefix = PCI_ACCELERATORS[kind]
    out: dict[str, int] = {}
    for path in sorted(root.glob("*")):
        if (_read(path / "vendor") or "").strip().lower() != vendor:
            continue
        if not (_read(path / "class") or "").strip().lower().startswith(class_prefix):
            continue
        node = (_read(path / "numa_node") or "-1").strip()
        out[path.name.upper()] = int(node) if node.lstrip("-").isdigit() else -1
    return out


def memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def collect(torch_timeout: float = TORCH_PROBE_TIMEOUT_S) -> HostFacts:
    env = {k: v for k, v in os.environ.items() if k in ENV_KEYS or k.startswith("HCCL_")}
    machine = platform.machine()
    pci: dict[str, int] = {}
    for kind in PCI_ACCELERATORS:
        pci.update(accelerator_pci_numa(kind))
    commands = {name: run_command(argv) for name, argv in COMMANDS.items()}
    npus = commands["npu-smi info"]
    if npus is not None and npus.returncode == 0:  # each card's RoCE port, for multi-node HCCL
        from tengyun.host.smi import parse_npu_smi_info

        commands.update(hccn_commands(sorted({d.npu_id for d in parse_npu_smi_info(npus.stdout).devices})))
    return HostFacts(
        python_version=platform.python_version(), machine=machine, cpu_count=os.cpu_count() or 0,
        memory_bytes=memory_bytes(), packages=package_versions(), torch_probe=probe_torch(torch_timeout),
        env=env, files=ascend_files(env, machine), commands=commands,
        numa_nodes=read_numa_nodes(), pci_numa=pci,
    )


def collect_versions() -> HostFacts:
    """The cheap part of collect() that version checks read: package versions, the Ascend version
    files and the environment; no child process, no smi command (`tengyun serve`'s start-up check)."""
    env = {k: os.environ[k] for k in ENV_KEYS if k in os.environ}
    machine = platform.machine()
    return HostFacts(python_version=platform.python_version(), machine=machine, packages=package_versions(),
                     env=env, files=ascend_files(env, machine))


def ip_addresses() -> str:
    """`ip -o addr show` ("" without iproute2), for finding this host in a rank table."""
    out = run_command(["ip", "-o", "addr", "show"], timeout=5)
    return out.stdout if out is not None and out.returncode == 0 else ""


# ----- applying a NUMA binding --------------------------------------------------------------
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's feature flags ("avx512_bf16", "amx_bf16", ...); empty when unreadable
    (not Linux)."""
    text = _read(Path(cpuinfo)) or ""
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def allowed_cpus() -> set[int]:
    return set(os.sched_getaffinity(0))


def pin_process_cpus(cpus: set[int]) -> None:
    """sched_setaffinity on every thread of this process (pid 0 would pin the caller only)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass


def prefer_memory_node(node: int) -> bool:
    """libnuma numa_set_preferred(node) for this thread and the threads it starts later;
    False when libnuma is not installed or the kernel has no NUMA support."""
    name = ctypes.util.find_library("numa")
    if name is None:
        return False
    try:
        libnuma = ctypes.CDLL(name)
        if libnuma.numa_available() < 0:
            return False
        libnuma.numa_set_preferred(ctypes.c_int(node))
    except (OSError, AttributeError):
        return False
    return True


# ----- memory of a running server (`tengyun supervise`) ---------------------------------------
def nvidia_smi_memory() -> CommandOutput | None:
    return run_command(["nvidia-smi", "--query-gpu=index,memory.used,memory.total",
                        "--format=csv,noheader,nounits"], timeout=10)


def npu_smi_info() -> CommandOutput | None:
    return run_command(COMMANDS["npu-smi info"], timeout=10)


# ----- device telemetry of a running server (/metrics device gauges, /health/detail) -----------
NVIDIA_TELEMETRY_QUERY = "index,memory.used,memory.total,utilization.gpu,temperature.gpu,power.draw"
HCCN_TOOL = ASCEND_ROOT / "driver" / "tools" / "hccn_tool"  # where the driver installs it, often off PATH


def nvidia_smi_telemetry() -> CommandOutput | None:
    """Header + one row per GPU, units in the cells (smi.parse_nvidia_csv reads it)."""
    return run_command(["nvidia-smi", f"--query-gpu={NVIDIA_TELEMETRY_QUERY}", "--format=csv"], timeout=10)


def hccn_tool() -> str | None:
    """The hccn_tool executable (PATH first, then the driver's folder); None when not installed."""
    return shutil.which("hccn_tool") or (str(HCCN_TOOL) if os.access(HCCN_TOOL, os.X_OK) else None)


def hccn_link(device: int) -> CommandOutput | None:
    """`hccn_tool -i DEVICE -link -g` ('link status: UP'); None when hccn_tool is not installed."""
    tool = hccn_tool()
    return run_command([tool, "-i", str(device), "-link", "-g"], timeout=10) if tool else None


def hccn_commands(devices: list[int]) -> dict[str, CommandOutput | None]:
    """`hccn_tool -i N -link -g` and `-ip -g` for each device, keyed as `tengyun doctor` reads them
    ("hccn_tool -i 0 -link -g"); {"hccn_tool": None} when hccn_tool is not installed."""
    tool = hccn_tool()
    if tool is None:
        return {"hccn_tool": None}
    return {f"hccn_tool -i {d} -{what} -g": run_command([tool, "-i", str(d), f"-{what}", "-g"], timeout=10)
            for d in devices for what in ("link", "ip")}


def meminfo(path: str = "/proc/meminfo") -> str:
    return _read(Path(path)) or ""


# ----- CPU time of a starting server (`tengyun supervise --start-stall-timeout`) ----------------
def stat_cpu_ticks(stat: str) -> int:
    """utime + stime + cutime + cstime (fields 14-17) of one /proc/PID/stat line, in clock ticks.
    Field 2, the command name in parentheses, may hold spaces and ')', so fields are counted from
    the last ')': '7 (a) b) S 1 1 1 0 -1 0 0 0 0 0 30 5 2 1 ...' -> 30 + 5 + 2 + 1 = 38."""
    fields = stat[stat.rindex(")") + 2:].split()  # fields[0] is field 3, the state
    return sum(int(f) for f in fields[11:15])


def process_tree(pid: int, proc: str = "/proc") -> list[int] | None:
    """``pid`` and its live descendants (each thread's children list), None when pid is gone."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in found:
            continue
        try:
            tasks = os.listdir(f"{proc}/{p}/task")
        except OSError:
            if p == pid:
                return None
            continue
        found.append(p)
        for task in tasks:
            try:
                with open(f"{proc}/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
            except OSError:
                pass
    return found


def _sum_over_process_tree(pid: int, proc: str, name: str, read) -> int | None:
    """sum(read(text of /proc/<p>/<name>)) over ``pid`` and its descendants; None when pid is gone.
    A process that exits while it is read counts 0."""
    pids = process_tree(pid, proc)
    if pids is None:
        return None
    total = 0
    for p in pids:
        try:
            with open(f"{proc}/{p}/{name}") as f:
                total += read(f.read())
        except (OSError, ValueError):  # exited since it was listed
            pass
    return total


def process_tree_cpu_s(pid: int, proc: str = "/proc") -> float | None:
    """CPU seconds used so far by ``pid`` and its descendants (live ones, and through cutime /
    cstime the reaped ones), None when pid is gone."""
    ticks = _sum_over_process_tree(pid, proc, "stat", stat_cpu_ticks)
    return None if ticks is None else ticks / os.sysconf("SC_CLK_TCK")


def process_tree_rss(pid: int, proc: str = "/proc") -> int | None:
    """Resident bytes of ``pid`` and all its descendants (VmRSS of each), None when pid is gone."""
    return _sum_over_process_tree(pid, proc, "status", _vm_rss_bytes)


def _vm_rss_bytes(status: str) -> int:
    """/proc/<pid>/status -> VmRSS in bytes ("VmRSS:   123456 kB"); 0 for a kernel thread without one."""
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def own_resident_bytes(proc: str = "/proc") -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes: resident now, and the most resident since start
    or since reset_own_resident_peak()."""
    with open(f"{proc}/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS:", "VmHWM:")))
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def reset_own_resident_peak(proc: str = "/proc") -> bool:
    """VmHWM back to VmRSS (Linux's clear_refs "5"); False where the kernel or sandbox refuses."""
    try:
        with open(f"{proc}/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True
