"""HCCL rank tables (hccl.json): generate them, and find what makes HCCL hang or crawl.

Shapes (as Ascend's hccl_tools.py and vllm-ascend write them):
  1.0  {"version": "1.0", "server_count": "2", "status": "completed",
        "server_list": [{"server_id": "10.0.0.10", "host_nic_ip": "reserve",
                         "device": [{"device_id": "0", "device_ip": "192.168.100.101", "rank_id": "0"}, ...]}]}
  1.2  the same, each device with a "super_device_id", plus (Atlas A3 super pods)
       "super_pod_list": [{"super_pod_id": "0", "server_list": [{"server_id": "10.0.0.10"}]}]
server_id is the server's management IP; device_ip is the NPU's RoCE port address (set with
hccn_tool, listed in /etc/hccn.conf), on the parameter-plane network. A device_ip on the
management network sends HCCL's traffic over the 1 Gbps management port.
"""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VERSIONS = ("1.0", "1.2")
MAX_DEVICE_ID = 15


@dataclass(frozen=True)
class ServerSpec:
    server_id: str  # management IP
    device_ips: list[str]  # RoCE IP of device 0, 1, ...
    super_device_ids: list[str] | None = None  # 1.2 only


def parse_hccn_conf(text: str) -> list[str]:
    """/etc/hccn.conf ('address_0=192.168.100.101' lines) -> device IPs by device id."""
    found: dict[int, str] = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key.startswith("address_") and key[len("address_"):].isdigit():
            found[int(key[len("address_"):])] = value.strip()
    return [found[i] for i in sorted(found)]


def parse_server_arg(text: str, read_file=None) -> ServerSpec:
    """'10.0.0.10=192.168.100.101,192.168.100.102' or '10.0.0.10=@/etc/hccn.conf';
    for version 1.2 each device may be 'IP/SUPER_DEVICE_ID'."""
    server, sep, devices = text.partition("=")
    if not sep or not server or not devices:
        raise ValueError(f"--server {text!r}: expected MGMT_IP=DEVICE_IP[,DEVICE_IP...] or MGMT_IP=@hccn.conf.")
    if devices.startswith("@"):
        if read_file is None:
            raise ValueError(f"--server {text!r}: @file needs a file reader.")
        ips = parse_hccn_conf(read_file(devices[1:]))
        if not ips:
            raise ValueError(f"{devices[1:]} has no address_N= lines (the hccn.conf format).")
        return ServerSpec(server.strip(), ips)
    entries = [d.strip() for d in devices.split(",") if d.strip()]
    ips = [e.split("/")[0] for e in entries]
    sdids = [e.split("/")[1] for e in entries if "/" in e]
    return ServerSpec(server.strip(), ips, sdids if len(sdids) == len(entries) else None)


def generate(servers: list[ServerSpec], version: str = "1.0", devices_per_server: int | None = None,
             super_pod_id: str = "0", mgmt_prefix: int = 24) -> dict[str, Any]:
    """A rank table: ranks numbered server by server, device by device, from 0."""
    if version not in VERSIONS:
        raise ValueError(f"--version must be one of {', '.join(VERSIONS)}; got {version!r}.")
    if not servers:
        raise ValueError("give at least one --server MGMT_IP=DEVICE_IP,...")
    server_list, rank = [], 0
    for spec in servers:
        count = devices_per_server or len(spec.device_ips)
        if len(spec.device_ips) < count:
            raise ValueError(f"server {spec.server_id} has {len(spec.device_ips)} device IPs but "
                             f"--devices-per-server is {count}: list one IP per device.")
        if version == "1.2" and (spec.super_device_ids is None or len(spec.super_device_ids) < count):
            raise ValueError(f"version 1.2 needs each device as IP/SUPER_DEVICE_ID (npu-smi info -t spod-info "
                             f"shows the SDID); server {spec.server_id} lacks them.")
        devices = []
        for device_id in range(count):
            device = {"device_id": str(device_id), "device_ip": spec.device_ips[device_id]}
            if version == "1.2":
                device["super_device_id"] = spec.super_device_ids[device_id]
            device["rank_id"] = str(rank)
            devices.append(device)
            rank += 1
        server_list.append({"server_id": spec.server_id, "device": devices, "host_nic_ip": "reserve"})
    table: dict[str, Any] = {"version": version, "server_count": str(len(servers)), "server_list": server_list}
    if version == "1.2":
        table["super_pod_list"] = [{"super_pod_id": super_pod_id,
                                    "server_list": [{"server_id": s.server_id} for s in servers]}]
    table["status"] = "completed"
    # Checked before it is written: generate never hands out a table validate would refuse.
    problems = [p for p in validate(table, mgmt_prefix) if p.severity == "error"]
    if problems:
        raise ValueError("; ".join(f"{p.path}: {p.message}" for p in problems))
    return table


@dataclass(frozen=True)
class Problem:
    path: str  # JSON path: $.server_list[1].device[3].device_ip
    message: str
    fix: str
    severity: str = "error"  # or "warning"


def _ip(value: Any) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(str(value))
    except ValueError:
        return None


def _int(value: Any) -> int | None:
    try:
        return int(str(value))
    except ValueError:
        return None


def validate_text(text: str, mgmt_prefix: int = 24, devices_per_server: int | None = None) -> list[Problem]:
    try:
        table = json.loads(text)
    except json.JSONDecodeError as e:
        return [Problem("$", f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                        "fix the syntax there (a trailing comma or a missing quote is typical), or regenerate "
                        "with `tengyun rank-table generate`")]
    return validate(table, mgmt_prefix, devices_per_server)


def validate(table: Any, mgmt_prefix: int = 24, devices_per_server: int | None = None) -> list[Problem]:
    """Every problem HCCL would trip on, each with its JSON path and the fix. ``mgmt_prefix``:
    the management network's prefix length, for the same-subnet check (/24 unless told)."""
    if not isinstance(table, dict):
        return [Problem("$", "the rank table must be a JSON object",
                        "regenerate it with `tengyun rank-table generate`")]
    problems: list[Problem] = []
    version = table.get("version")
    if version not in VERSIONS:
        problems.append(Problem("$.version", f"version {version!r} is not one of {', '.join(VERSIONS)}",
                                'set "version": "1.0" (Atlas A2) or "1.2" (with super_device_id, Atlas A3)'))
    if table.get("status") != "completed":
        problems.append(Problem("$.status", f"status is {table.get('status')!r}", 'set "status": "completed"'))
    servers = table.get("server_list")
    if not isinstance(servers, list) or not servers:
        problems.append(Problem("$.server_list", "server_list is missing or empty",
                                "list every server with its devices"))
        return problems
    count = _int(table.get("server_count"))
    if count != len(servers):
        problems.append(Problem("$.server_count", f"server_count is {table.get('server_count')!r} but server_list "
                                f"has {len(servers)} servers", f'set "server_count": "{len(servers)}"'))
    problems += _validate_devices(table, servers, version, mgmt_prefix, devices_per_server)
    if version == "1.2" and "super_pod_list" in table:
        known = {s.get("server_id") for s in servers if isinstance(s, dict)}
        for p, pod in enumerate(table.get("super_pod_list") or []):
            for k, entry in enumerate(pod.get("server_list") or []):
                if entry.get("server_id") not in known:
                    problems.append(Problem(f"$.super_pod_list[{p}].server_list[{k}].server_id",
                                            f"{entry.get('server_id')!r} is not in server_list",
                                            "list the same server_ids in super_pod_list and server_list"))
    return problems


def _validate_devices(table: dict, servers: list, version: Any, mgmt_prefix: int,
                      devices_per_server: int | None) -> list[Problem]:
    problems: list[Problem] = []
    seen_ips: dict[str, str] = {}  # device_ip -> path of its first use
    seen_servers: dict[str, str] = {}
    ranks: list[tuple[int, str]] = []  # (rank id, path) in file order
    counts = []
    for s, server in enumerate(servers):
        base = f"$.server_list[{s}]"
        if not isinstance(server, dict):
            problems.append(Problem(base, "a server must be an object", "see the 1.0 shape in docs/operations.md"))
            continue
        mgmt = _ip(server.get("server_id"))
        if mgmt is None:
            problems.append(Problem(f"{base}.server_id", f"server_id {server.get('server_id')!r} is not an IP address",
                                    "use the server's management IP"))
        elif str(mgmt) in seen_servers:
            problems.append(Problem(f"{base}.server_id", f"server {mgmt} is listed twice (first at "
                                    f"{seen_servers[str(mgmt)]})", "list each server once"))
        else:
            seen_servers[str(mgmt)] = f"{base}.server_id"
        devices = server.get("device")
        if not isinstance(devices, list) or not devices:
            problems.append(Problem(f"{base}.device", "no devices", "list the server's NPUs"))
            continue
        counts.append((len(devices), base))
        device_ids: dict[int, str] = {}
        for d, device in enumerate(devices):
            path = f"{base}.device[{d}]"
            device_id = _int(device.get("device_id"))
            if device_id is None or not 0 <= device_id <= MAX_DEVICE_ID:
                problems.append(Problem(f"{path}.device_id", f"device_id {device.get('device_id')!r} is not 0-"
                                        f"{MAX_DEVICE_ID}", "use the NPU's physical id as npu-smi info shows it"))
            elif device_id in device_ids:
                problems.append(Problem(f"{path}.device_id", f"device_id {device_id} repeats {device_ids[device_id]}",
                                        "each NPU appears once per server"))
            else:
                device_ids[device_id] = f"{path}.device_id"
            problems += _check_device_ip(device.get("device_ip"), f"{path}.device_ip", mgmt, mgmt_prefix, seen_ips)
            if version == "1.2" and "super_device_id" not in device:
                problems.append(Problem(f"{path}.super_device_id", "version 1.2 needs super_device_id",
                                        "take the SDID from npu-smi info -t spod-info, or use version 1.0"))
            rank = _int(device.get("rank_id"))
            if rank is None:
                problems.append(Problem(f"{path}.rank_id", f"rank_id {device.get('rank_id')!r} is not a number",
                                        "number the ranks 0, 1, 2, ... in file order"))
            else:
                ranks.append((rank, f"{path}.rank_id"))
    expected = devices_per_server or (max(c for c, _ in counts) if counts else 0)
    for n, base in counts:
        if n != expected:
            problems.append(Problem(f"{base}.device", f"{n} devices, other servers have {expected}",
                                    "give every server the same number of NPUs (HCCL's server-level topology "
                                    "assumes it)"))
    return problems + _check_ranks(ranks)


def _check_device_ip(value: Any, path: str, mgmt: Any, mgmt_prefix: int, seen: dict[str, str]) -> list[Problem]:
    ip = _ip(value)
    if ip is None:
        return [Problem(path, f"device_ip {value!r} is not an IP address",
                        "use the NPU's RoCE address: hccn_tool -i <device_id> -ip -g, or /etc/hccn.conf")]
    problems = []
    if str(ip) in seen:
        problems.append(Problem(path, f"device_ip {ip} is also used at {seen[str(ip)]}",
                                "every NPU has its own RoCE address: hccn_tool -i <device_id> -ip -g"))
    else:
        seen[str(ip)] = path
    if mgmt is not None and ip == mgmt:
        problems.append(Problem(path, f"device_ip {ip} is the server's management IP: HCCL traffic would go "
                                      f"over the management network",
                                "set the NPU's RoCE address (hccn_tool -i <device_id> -ip -g)"))
    elif mgmt is not None and ip.version == mgmt.version and \
            ip in ipaddress.ip_network(f"{mgmt}/{mgmt_prefix}", strict=False):
        problems.append(Problem(path, f"device_ip {ip} is on the management subnet "
                                      f"{ipaddress.ip_network(f'{mgmt}/{mgmt_prefix}', strict=False)}: HCCL would "
                                      f"use the 1 Gbps management network, not RoCE",
                                "use the RoCE address of that NPU (hccn_tool -i <device_id> -ip -g); if the "
                                "management network is narrower, pass --mgmt-prefix"))
    return problems


def _check_ranks(ranks: list[tuple[int, str]]) -> list[Problem]:
    """rank_id: unique, 0..N-1 with no gap, increasing in file order (server by server)."""
    problems, seen = [], {}
    for rank, path in ranks:
        if rank in seen:
            problems.append(Problem(path, f"rank_id {rank} repeats {seen[rank]}", "give each device its own rank_id"))
        seen.setdefault(rank, path)
    missing = sorted(set(range(len(ranks))) - set(seen))
    if missing:
        extra = sorted(r for r in seen if r >= len(ranks) or r < 0)
        problems.append(Problem(seen[extra[0]] if extra else "$.server_list",
                                f"rank ids are not contiguous: {len(ranks)} devices but rank_id "
                                f"{', '.join(map(str, missing))} missing"
                                + (f" and {extra} out of range" if extra else ""),
                                f"number the ranks 0-{len(ranks) - 1}, server by server in file order"))
    for (prev, _), (rank, path) in zip(ranks, ranks[1:]):
        if rank < prev:
            problems.append(Problem(path, f"rank_id {rank} comes after rank_id {prev}: ranks must increase in "
                                          f"file order", "number the ranks server by server, device by device"))
            break
    return problems


# ----- consuming a table: this node's HCCL environment (`tengyun serve --rank-table`) ------------
# torch_npu builds its HCCL communicators from the table named by RANK_TABLE_FILE (Ascend/pytorch
# docs/zh/environment_variable_reference/RANK_TABLE_FILE.md: the path must not be a symlink; a
# missing file silently falls back to negotiation; a wrong one fails only at the first collective),
# and HCCL requires each process's rank to be the table's rank_id (HcclCommInitClusterInfo). RANK_SIZE
# is the table's device count (CANN environment variable reference).
@dataclass(frozen=True)
class HcclNode:
    """This node's part of a rank table and the environment its ranks start with."""

    server_index: int  # = --node-rank
    server_id: str  # management IP
    device_ids: list[int]  # physical NPU ids, local rank order
    device_ips: list[str]  # their RoCE addresses
    rank_ids: list[int]  # = this node's global ranks
    env: dict[str, str]  # RANK_TABLE_FILE, RANK_SIZE, ASCEND_RT_VISIBLE_DEVICES

    def describe(self) -> str:
        return (f"this node is server {self.server_id} (--node-rank {self.server_index}): NPUs "
                f"{','.join(map(str, self.device_ids))} (RoCE {', '.join(self.device_ips)}) as ranks "
                f"{self.rank_ids[0]}-{self.rank_ids[-1]}; " + " ".join(f"{k}={v}" for k, v in self.env.items()))


def parse_ip_addresses(text: str) -> set[str]:
    """`ip -o addr show` -> the host's addresses: '2: eth0    inet 10.0.0.11/24 brd ...' -> {'10.0.0.11'}."""
    found = set()
    for line in text.splitlines():
        words = line.split()
        for key, value in zip(words, words[1:]):
            if key in ("inet", "inet6") and _ip(value.split("/")[0]) is not None:
                found.add(str(_ip(value.split("/")[0])))
    return found


def node_environment(table: dict[str, Any], path: str, nnodes: int, node_rank: int, tp: int, pp: int,
                     local_ips: set[str] = frozenset(), visible: str | None = None) -> HcclNode:
    """This node's devices, ranks and HCCL environment from a valid ``table`` (read from ``path``),
    checked against --nnodes / --node-rank / -tp / -pp (ranks are node-major: node n holds ranks
    n * per_node ...), this host's addresses and $ASCEND_RT_VISIBLE_DEVICES; ValueError names both sides."""
    servers = table["server_list"]
    if len(servers) != nnodes:
        raise ValueError(f"--rank-table {path} lists {len(servers)} servers but --nnodes is {nnodes}: pass --nnodes "
                         f"{len(servers)} (one `tengyun serve` per server, --node-rank 0-{len(servers) - 1}), or use "
                         f"a rank table of the {nnodes} server(s) you run on.")
    here = [i for i, s in enumerate(servers) if str(s.get("server_id")) in local_ips]
    if here and node_rank not in here:
        raise ValueError(f"this host is server {here[0]} ({servers[here[0]]['server_id']}) in --rank-table {path} "
                         f"but --node-rank is {node_rank}: pass --node-rank {here[0]}.")
    server, per_node = servers[node_rank], tp * pp // nnodes
    devices = server["device"]
    if len(devices) != per_node:
        raise ValueError(f"--rank-table {path} gives server {server['server_id']} {len(devices)} NPUs but "
                         f"--tensor-parallel-size {tp} x --pipeline-parallel-size {pp} over --nnodes {nnodes} puts "
                         f"{per_node} ranks on each node: list {per_node} NPUs per server, or change the sizes "
                         f"so that tp x pp = {len(devices) * nnodes}.")
    ranks = [int(d["rank_id"]) for d in devices]
    expected = list(range(node_rank * per_node, (node_rank + 1) * per_node))
    if ranks != expected:
        raise ValueError(f"--rank-table {path} numbers server {server['server_id']}'s NPUs as ranks {ranks} but "
                         f"--node-rank {node_rank} runs ranks {expected}: number the ranks server by server in "
                         f"--node-rank order (`tengyun rank-table generate`).")
    device_ids = [int(d["device_id"]) for d in devices]
    wanted = ",".join(map(str, device_ids))
    if visible and visible.replace(" ", "") != wanted:
        raise ValueError(f"ASCEND_RT_VISIBLE_DEVICES is {visible} but --rank-table {path} gives this node NPUs "
                         f"{wanted}: unset ASCEND_RT_VISIBLE_DEVICES (the rank table decides) or make them agree.")
    env = {"RANK_TABLE_FILE": path, "RANK_SIZE": str(sum(len(s["device"]) for s in servers)),
           "ASCEND_RT_VISIBLE_DEVICES": wanted}
    return HcclNode(node_rank, str(server["server_id"]), device_ids, [str(d["device_ip"]) for d in devices],
                    ranks, env)


def read_node_environment(path: str, nnodes: int, node_rank: int, tp: int, pp: int, local_ips: set[str],
                          visible: str | None) -> HcclNode:
    """--rank-table ``path`` validated (its errors raise ValueError) and consumed by node_environment."""
    real = os.path.realpath(path)  # torch_npu refuses a symlinked RANK_TABLE_FILE
    try:
        text = Path(real).read_text()
    except OSError as e:
        raise ValueError(f"--rank-table {path}: cannot read it ({e.strerror}); pass the hccl.json of this "
                         f"cluster (`tengyun rank-table generate` writes one).") from None
    errors = [p for p in validate_text(text) if p.severity == "error"]
    if errors:
        listed = "; ".join(f"{p.path}: {p.message} (fix: {p.fix})" for p in errors[:3])
        raise ValueError(f"--rank-table {path} is not a valid rank table: {listed}"
                         + (f"; and {len(errors) - 3} more" if len(errors) > 3 else "")
                         + f". `tengyun rank-table validate {path}` lists every problem.")
    return node_environment(json.loads(text), real, nnodes, node_rank, tp, pp, local_ips, visible)
