"""`tengyun doctor`: preflight checks, each OK / WARN / FAIL with what to do.

Every check is a pure function of HostFacts (probe.collect() on a live machine, recorded
outputs in tests). Ascend checks run when the host shows any sign of Ascend software
(torch_npu, CANN, npu-smi); CUDA checks when nvidia-smi or a CUDA device is there.
"""

from __future__ import annotations

import re
from typing import Callable

from tengyun.host import hccl
from tengyun.host.compat import base_version, load_table, version_key
from tengyun.host.findings import Finding, Status, fail, ok, warn
from tengyun.host.versions import (
    SET_ENV, command_stdout, cann_version, check_driver, check_torch_npu, npu_smi,
)
from tengyun.host.probe import NNAL_SET_ENV, HostFacts
from tengyun.host.smi import (
    Topology, parse_gcc_version, parse_hccn_ip, parse_hccn_link, parse_npu_processes,
    parse_nvidia_query, parse_topology, slowest_link,
)

MIN_PYTHON = "3.10"  # pyproject.toml requires-python
MIN_TORCH = "2.5"  # pyproject.toml dependencies
# Ascend/pytorch README (commit 19fb596): "we recommend to use gcc 10.2 for ARM and gcc 9.3.1 for X86"
MIN_GCC = {"aarch64": "10.2", "x86_64": "9.3.1"}


# ----- what the facts say -----------------------------------------------------------------------


def is_ascend_host(facts: HostFacts) -> bool:
    return bool(facts.packages.get("torch_npu") or facts.files.get("cann") or facts.files.get("driver")
                or facts.commands.get("npu-smi info") is not None)


def is_cuda_host(facts: HostFacts) -> bool:
    return facts.commands.get("nvidia-smi topo -m") is not None or any(
        d.get("type") == "cuda" for d in facts.torch_probe.get("devices", []))


# ----- checks -------------------------------------------------------------------------------------
def check_python(facts: HostFacts) -> list[Finding]:
    if version_key(facts.python_version) < version_key(MIN_PYTHON):
        return [fail("python", f"Python {facts.python_version}", f"use Python >= {MIN_PYTHON} (pyproject.toml)")]
    return [ok("python", f"Python {facts.python_version}")]


def check_torch(facts: HostFacts) -> list[Finding]:
    probe = facts.torch_probe
    if probe.get("timed_out"):
        return [fail("torch", probe.get("error", "importing torch hung"),
                     f"a hung NPU/GPU driver or runtime init: check `npu-smi info` / `nvidia-smi`, "
                     f"`source {SET_ENV}` again, then rerun")]
    if "torch" not in probe:
        return [fail("torch", f"torch does not import: {probe.get('torch_error') or probe.get('error')}",
                     f"pip install 'torch>={MIN_TORCH}' (the CPU wheel, or the build your NPU/GPU stack needs)")]
    version = probe["torch"]
    if version_key(base_version(version)) < version_key(MIN_TORCH):
        return [fail("torch", f"torch {version}", f"upgrade to torch >= {MIN_TORCH}")]
    return [ok("torch", f"torch {version}" + (f" (CUDA {probe['torch_cuda']})" if probe.get("torch_cuda") else ""))]


def check_platform(facts: HostFacts) -> list[Finding]:
    probe = facts.torch_probe
    platform = probe.get("platform")
    if platform is None:
        return [fail("platform", f"no platform found: {probe.get('platform_error') or probe.get('error')}",
                     "fix the torch finding first")]
    devices = [d for d in probe.get("devices", []) if d.get("type") == platform]
    if platform == "cpu":
        detail = f"CPU: {facts.cpu_count} cores, {facts.memory_bytes / 2**30:.1f} GiB RAM (no NPU or GPU found)"
        if facts.commands.get("npu-smi info") is not None and not facts.packages.get("torch_npu"):
            return [warn("platform", detail + "; npu-smi is installed but torch_npu is not",
                         "pip install the torch_npu matching your torch and CANN (see the torch_npu finding)")]
        return [ok("platform", detail)]
    listed = ", ".join(f"{d['index']}: {d['name']} {d['total_memory'] / 2**30:.1f} GiB" for d in devices)
    return [ok("platform", f"{platform}: {len(devices)} device(s) ({listed})")]


def check_cann(facts: HostFacts) -> list[Finding]:
    cann = cann_version(facts)
    if cann is None:
        return [fail("CANN", "no CANN toolkit found (ascend_toolkit_install.info under "
                             "/usr/local/Ascend/ascend-toolkit/latest/<arch>-linux/)",
                     "install the CANN toolkit (and kernels package) that your torch_npu is listed with, "
                     f"then `source {SET_ENV}`")]
    return [ok("CANN", f"CANN toolkit {cann}")]


def check_set_env(facts: HostFacts) -> list[Finding]:
    env = facts.env
    home = env.get("ASCEND_TOOLKIT_HOME") or env.get("ASCEND_HOME_PATH")
    missing = [k for k in ("ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH") if k not in env]
    lib_ok = "ascend" in env.get("LD_LIBRARY_PATH", "").lower()
    if home and not missing and lib_ok:
        return [ok("set_env.sh", f"Ascend environment set (ASCEND_TOOLKIT_HOME={home})")]
    what = ", ".join(missing + ([] if lib_ok else ["LD_LIBRARY_PATH without Ascend libraries"]))
    return [fail("set_env.sh", f"the CANN environment is not sourced: {what}",
                 f"run `source {SET_ENV}` (add it to ~/.bashrc or the service's environment)")]


def check_npu_devices(facts: HostFacts) -> list[Finding]:
    info = npu_smi(facts)
    if info is None:
        out = facts.commands.get("npu-smi info")
        why = "npu-smi is not installed" if out is None else f"npu-smi info failed: {out.stderr.strip()[:200]}"
        return [fail("NPUs", why, "install the Ascend HDK driver (it ships npu-smi); in a container mount "
                                  "/usr/local/bin/npu-smi, /usr/local/Ascend/driver and the /dev/davinci* devices")]
    if not info.devices:
        return [fail("NPUs", "npu-smi lists no NPU", "check the driver (dmesg | grep -i davinci) and the devices")]
    listed = ", ".join(f"NPU{d.npu_id} {d.name} {d.device_memory_mb or 0} MB" for d in info.devices)
    sick = [d for d in info.devices if d.health.upper() != "OK"]
    if sick:
        return [fail("NPUs", f"{len(sick)} of {len(info.devices)} NPUs not healthy: "
                     + ", ".join(f"NPU{d.npu_id} {d.health}" for d in sick),
                     "npu-smi info -t health -i <id> shows the error code; fix or exclude them with "
                     "ASCEND_RT_VISIBLE_DEVICES")]
    out = [ok("NPUs", f"{len(info.devices)} NPU(s) healthy: {listed}")]
    torch_count = sum(d.get("type") == "npu" for d in facts.torch_probe.get("devices", []))
    visible = facts.env.get("ASCEND_RT_VISIBLE_DEVICES")
    if facts.torch_probe.get("npu_available") and torch_count != len(info.devices) and not visible:
        out.append(warn("NPUs", f"torch_npu sees {torch_count} NPUs, npu-smi lists {len(info.devices)}",
                        "a container may lack /dev/davinci* devices: pass every device you want to use"))
    return out


def check_topology(facts: HostFacts, tp_size: int | None) -> list[Finding]:
    """Each TP group (consecutive devices) should sit on HCCS / NVLink: an all-reduce runs at
    the pace of its slowest link."""
    text = command_stdout(facts, "npu-smi info -t topo") or command_stdout(facts, "nvidia-smi topo -m")
    if text is None:
        return []
    topo = parse_topology(text)
    if len(topo.devices) < 2:
        return [ok("topology", f"{len(topo.devices)} device: no inter-card links to check")]
    tp = tp_size or len(topo.devices)
    problems = []
    for first in range(0, len(topo.devices) - tp + 1, tp):
        group = topo.devices[first:first + tp]
        pairs = [(a, b) for i, a in enumerate(group) for b in group[i + 1:]]
        worst = slowest_link([topo.link(a, b) for a, b in pairs])
        if worst:
            a, b = next((a, b) for a, b in pairs if topo.link(a, b) == worst)
            problems.append(f"TP group {group[0]}-{group[-1]} crosses {worst} ({a}-{b})")
    links = sorted({v for v in topo.links.values()})
    if problems:
        return [warn("topology", "; ".join(problems) + f" (links seen: {', '.join(links)})",
                     "keep each tensor-parallel group on HCCS / NVLink-connected cards: a smaller "
                     "--tensor-parallel-size (with --pipeline-parallel-size across the slow link), or pick "
                     "cards with ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES")]
    return [ok("topology", f"TP {tp} groups of {', '.join(topo.devices)} use {', '.join(links)} links only")]


def check_numa(facts: HostFacts, topo: Topology | None = None) -> list[Finding]:
    nodes = facts.numa_nodes
    if len(nodes) <= 1:
        return [ok("NUMA", f"{len(nodes) or 1} NUMA node: binding is a no-op here")]
    described = "; ".join(f"node {n}: CPUs {c}" for n, c in sorted(nodes.items()))
    placed = {bus: node for bus, node in facts.pci_numa.items()}
    if not placed and topo is not None:
        placed = {dev: node for dev, node in topo.numa_affinity.items()}
    if not placed:
        return [warn("NUMA", f"{len(nodes)} NUMA nodes ({described}) but no accelerator found in sysfs",
                     "NUMA binding will be skipped; check that the NPUs/GPUs are visible in this container")]
    info = npu_smi(facts)
    names = {d.bus_id: f"NPU{d.npu_id} " for d in info.devices} if info else {}
    unknown = [bus for bus, node in placed.items() if node < 0]
    mapping = ", ".join(f"{names.get(bus, '')}{bus} -> node {node}" for bus, node in placed.items())
    if unknown:
        return [warn("NUMA", f"{len(nodes)} NUMA nodes; devices: {mapping}",
                     "the firmware reports no NUMA node (-1) for " + ", ".join(unknown)
                     + ": enable NUMA / ACPI SRAT in the BIOS, or bind by hand with numactl")]
    return [ok("NUMA", f"{len(nodes)} NUMA nodes ({described}); devices: {mapping}; each worker binds to "
                       f"its device's node (--numa-bind auto)")]


def check_cuda_kernels(facts: HostFacts) -> list[Finding]:
    """flash-attn (paged attention, decode graphs) and fla (Qwen3.5 / Qwen3-Next's Gated DeltaNet):
    optional, picked by the CUDA platform when they import (docs/parallelism.md)."""
    flash, fla = facts.packages.get("flash_attn"), facts.packages.get("fla_core")
    if flash:
        found = [ok("flash-attn", f"flash-attn {flash}: paged attention over 256-token blocks (the CUDA "
                                  f"default with it), decode graphs on unless --enforce-eager")]
    else:
        found = [warn("flash-attn", "flash-attn not installed: attention runs torch_sdpa (gathers the context) "
                                    "and decode graphs stay off",
                      "pip install flash-attn (a wheel matching your torch and CUDA)")]
    if fla:
        found.append(ok("fla", f"fla-core {fla}: Gated DeltaNet (Qwen3.5, Qwen3-Next) on its Triton kernels"))
    else:
        found.append(warn("fla", "fla-core not installed: Qwen3.5 / Qwen3-Next's Gated DeltaNet runs the "
                                 "plain-PyTorch delta rule (slow); other models are unaffected",
                          "pip install fla-core"))
    return found


def check_gcc(facts: HostFacts) -> list[Finding]:
    out = facts.commands.get("gcc --version")
    minimum = MIN_GCC.get(facts.machine, "9.3.1")
    if out is None or out.returncode != 0:
        return [warn("gcc", "gcc not found", f"install gcc >= {minimum}: torch.compile and custom kernel builds "
                                             f"(torch_npu recommends gcc {minimum} on {facts.machine}) need it")]
    version = parse_gcc_version(out.stdout)
    if version is None or version_key(version) < version_key(minimum):
        return [warn("gcc", f"gcc {version}", f"install gcc >= {minimum} for kernel builds")]
    # CANN's install guide ("依赖列表", e.g. hiascend.com .../canncommercial/800/softwareinst/instg/instg_0045.html)
    # asks for gcc >= 7.3.0 and names no ceiling; the ceiling per release is the gcc of the newest OS its
    # dependency steps cover (compat_table.json "cann_gcc", source "cann_install_deps" says which pages).
    cann = cann_version(facts) if is_ascend_host(facts) else None
    row = load_table().gcc_for(cann) if cann else None
    if row and row.gcc_max and version_key(version) >= version_key(str(int(row.gcc_max) + 1)):
        return [warn("gcc", f"gcc {version} is newer than the gcc {row.gcc_max} CANN {cann} is documented with "
                            f"(compat_table.json cann_gcc: the compilers of the OSes its install guide covers)",
                     f"build torch_npu extensions and custom operators with gcc {row.gcc_min} - {row.gcc_max}.x "
                     f"(e.g. install gcc-{row.gcc_max} and point CC/CXX at it), or move to a CANN release that "
                     f"documents this OS")]
    return [ok("gcc", f"gcc {version}" + (f" (CANN {cann} is documented with gcc {row.gcc_min} - {row.gcc_max}.x)"
                                          if row and row.gcc_max else ""))]


# An idle 910B shows about 3.3 of its 64 GB HBM used (firmware and runtime reservations, 5%:
# tests/fixtures/ops/npu_smi_info_910b3_x8.txt); more than this fraction means someone holds the card.
OCCUPIED_MEMORY_FRACTION = 0.2


def check_npu_memory(facts: HostFacts) -> list[Finding]:
    """Cards whose HBM (DDR on 310P) another process already holds: the engine sizes its KV cache
    from what is left, or fails to start on them."""
    text, info = command_stdout(facts, "npu-smi info"), npu_smi(facts)
    if not text or info is None or not info.devices:
        return []
    holders: dict[int, list[str]] = {}
    for p in parse_npu_processes(text):
        holders.setdefault(p.npu_id, []).append(f"pid {p.pid}" + (f" {p.name}" if p.name else ""))
    busy, free = [], []
    for d in info.devices:
        used, total = (d.hbm_used_mb, d.hbm_total_mb) if d.hbm_total_mb else (d.memory_used_mb, d.memory_total_mb)
        if d.npu_id in holders or (total and (used or 0) > OCCUPIED_MEMORY_FRACTION * total):
            busy.append(f"NPU{d.npu_id} {used}/{total} MB in use"
                        + (f" ({', '.join(holders[d.npu_id])})" if d.npu_id in holders else ""))
        else:
            free.append(d.npu_id)
    if not busy:
        return [ok("NPU memory", f"{len(free)} NPU(s) free (no process holds them)")]
    keep = f"ASCEND_RT_VISIBLE_DEVICES={','.join(map(str, free))}" if free else "free cards"
    return [warn("NPU memory", f"{len(busy)} of {len(info.devices)} NPUs already hold memory: " + "; ".join(busy),
                 f"stop those processes (`npu-smi info` lists them), or serve on the others with {keep}: "
                 f"--gpu-memory-utilization is a fraction of the whole card")]


def check_nnal(facts: HostFacts) -> list[Finding]:
    """NNAL's ATB library (libatb.so), which torch_npu loads for its ATB ops on first call: the
    KV-cache write needs it (_npu_reshape_and_cache) where torch_npu has no npu_scatter_pa_kv_cache."""
    probe = facts.torch_probe
    if "torch_npu" not in probe or ("atb" not in probe and "atb_error" not in probe):
        return []  # torch_npu does not import (its finding says why), or a probe without the fact
    if "atb_error" not in probe:
        return [ok("NNAL", "the ATB library (libatb.so) loads")]
    what = f"NNAL's ATB library does not load ({probe['atb_error'].strip()})"
    fix = f"install the NNAL package matching your CANN, then `source {NNAL_SET_ENV}` (after the CANN set_env.sh)"
    if probe.get("npu_scatter_pa_kv_cache"):
        return [warn("NNAL", f"{what}; the KV-cache write uses npu_scatter_pa_kv_cache, which does not need it", fix)]
    return [fail("NNAL", f"{what}, and this torch_npu has no npu_scatter_pa_kv_cache: the KV-cache write needs "
                         f"ATB's _npu_reshape_and_cache", fix)]


def check_hccl_env(facts: HostFacts) -> list[Finding]:
    """The HCCL variables Tengyun relies on (host/hccl.py): values outside CANN's documented range
    fail; unset ones are reported with the default each rank will set."""
    problems = [p for name, value in facts.env.items() if (p := hccl.value_problem(name, value))]
    if problems:
        return [fail("HCCL env", "; ".join(problems), "fix or unset them (unset: Tengyun sets " + ", ".join(
            f"{d.name}={d.value}" for d in hccl.HCCL_DEFAULTS) + ")")]
    described = ", ".join(f"{name}={value} ({source})" for name, value, source in hccl.describe(facts.env))
    return [ok("HCCL env", described)]


def check_roce(facts: HostFacts) -> list[Finding]:
    """Each card's RoCE port (`hccn_tool -i N -link -g`, `-ip -g`): multi-node HCCL traffic goes
    over it, so a port DOWN, without an address, or sharing one with another card, fails."""
    commands = facts.commands
    if "hccn_tool" in commands:
        return [warn("RoCE", "hccn_tool not found (PATH, /usr/local/Ascend/driver/tools): the cards' RoCE links "
                             "and addresses are unchecked",
                     "install the Ascend driver's tools (or mount /usr/local/Ascend/driver in the container) "
                     "before a multi-node launch; a single node does not use RoCE")]
    ports = sorted({int(m.group(1)) for key in commands if (m := re.match(r"hccn_tool -i (\d+) -link -g$", key))})
    if not ports:
        return []
    down, no_ip, seen, listed = [], [], {}, []
    for n in ports:
        link_out, ip_out = commands.get(f"hccn_tool -i {n} -link -g"), commands.get(f"hccn_tool -i {n} -ip -g")
        link = parse_hccn_link(link_out.stdout) if link_out and link_out.returncode == 0 else None
        address = parse_hccn_ip(ip_out.stdout) if ip_out and ip_out.returncode == 0 else None
        if link != "UP":
            down.append(f"NPU{n} link {link or 'unknown'}")
        if address is None:
            no_ip.append(f"NPU{n}")
        else:
            seen.setdefault(address[0], []).append(n)
            listed.append(f"NPU{n} {address[0]}" + (f"/{address[1]}" if address[1] else ""))
    shared = [f"{ip} on NPU{', NPU'.join(map(str, cards))}" for ip, cards in seen.items() if len(cards) > 1]
    problems = down + [f"{', '.join(no_ip)} without an IP address"] * bool(no_ip) + \
        [f"the same address {s}" for s in shared]
    if problems:
        return [fail("RoCE", "; ".join(problems) + (f" (addresses: {', '.join(listed)})" if listed else ""),
                     "multi-node HCCL over these ports fails or hangs: check the optical module, cable and switch "
                     "port (`hccn_tool -i N -link -g`, `-optical -g`), and give each card its own address on the "
                     "RoCE network (`hccn_tool -i N -ip -s address A netmask M`, or /etc/hccn.conf)")]
    return [ok("RoCE", f"{len(ports)} RoCE port(s) UP: {', '.join(listed)}")]


def run_checks(facts: HostFacts, tp_size: int | None = None) -> list[Finding]:
    findings: list[Finding] = []
    checks: list[Callable[[HostFacts], list[Finding]]] = [check_python, check_torch, check_platform]
    if is_ascend_host(facts):
        checks += [check_cann, check_set_env, check_nnal, check_torch_npu, check_driver, check_npu_devices,
                   check_npu_memory, check_hccl_env, check_roce]
    for check in checks:
        findings += check(facts)
    if not is_ascend_host(facts):
        findings.append(ok("Ascend", "no Ascend software (torch_npu, CANN, npu-smi): Ascend checks skipped"))
    if is_cuda_host(facts):
        query = command_stdout(facts, "nvidia-smi query")
        gpus = parse_nvidia_query(query) if query else []
        if gpus:
            findings.append(ok("GPUs", ", ".join(f"GPU{g.index} {g.name} {g.memory_total_mib} MiB" for g in gpus)))
        findings += check_cuda_kernels(facts)
    findings += check_topology(facts, tp_size)
    topo_text = command_stdout(facts, "nvidia-smi topo -m")
    findings += check_numa(facts, parse_topology(topo_text) if topo_text else None)
    findings += check_gcc(facts)
    return findings


def exit_code(findings: list[Finding]) -> int:
    return 1 if any(f.status == Status.FAIL for f in findings) else 0
