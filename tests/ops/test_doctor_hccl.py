"""`tengyun doctor` on an Ascend host: the HCCL variables (CANN's documented ranges, the defaults
Tengyun sets) and each card's RoCE port from recorded `hccn_tool` outputs."""

from __future__ import annotations

from test_doctor import ascend_host, fixture, only, ran

from tengyun.host.probe import CommandOutput
from tengyun.ops.doctor import Status, exit_code, run_checks


def _hccn(links: dict[int, str], ips: dict[int, str | None]) -> dict:
    commands = dict(ascend_host().commands)
    for n, link in links.items():
        commands[f"hccn_tool -i {n} -link -g"] = ran(fixture(f"hccn_tool_link_{link}.txt"))
    for n, ip in ips.items():
        commands[f"hccn_tool -i {n} -ip -g"] = ran(fixture("hccn_tool_ip.txt").replace("192.168.100.101", ip)) \
            if ip else CommandOutput(1, "", "")
    return commands


def test_unset_hccl_variables_are_ok_naming_the_defaults_the_ranks_set():
    finding = only(run_checks(ascend_host()), "HCCL env")
    assert finding.status == Status.OK
    assert finding.detail == ("HCCL_CONNECT_TIMEOUT=1200 (Tengyun default), HCCL_EXEC_TIMEOUT=1200 (Tengyun default)")


def test_hccl_variable_outside_cann_range_fails():
    facts = ascend_host(env={**ascend_host().env, "HCCL_CONNECT_TIMEOUT": "30", "HCCL_EXEC_TIMEOUT": "600"})
    finding = only(run_checks(facts), "HCCL env")
    assert finding.status == Status.FAIL
    assert "HCCL_CONNECT_TIMEOUT=30 is outside CANN's range [120, 7200] s" in finding.detail
    assert "HCCL_CONNECT_TIMEOUT=1200" in finding.fix


def test_eight_roce_ports_up_with_their_own_addresses_are_ok():
    ips = {n: f"192.168.100.{101 + n}" for n in range(8)}
    findings = run_checks(ascend_host(commands=_hccn({n: "up" for n in range(8)}, ips)))
    finding = only(findings, "RoCE")
    assert finding.status == Status.OK and exit_code(findings) == 0
    assert finding.detail.startswith("8 RoCE port(s) UP: NPU0 192.168.100.101/255.255.255.0, NPU1 192.168.100.102")


def test_a_port_down_a_card_without_address_and_a_shared_address_fail():
    links = {0: "up", 1: "down", 2: "up", 3: "up"}
    ips = {0: "192.168.100.101", 1: "192.168.100.102", 2: None, 3: "192.168.100.101"}
    findings = run_checks(ascend_host(commands=_hccn(links, ips)))
    finding = only(findings, "RoCE")
    assert finding.status == Status.FAIL and exit_code(findings) == 1
    assert finding.detail.startswith("NPU1 link DOWN; NPU2 without an IP address; the same address "
                                     "192.168.100.101 on NPU0, NPU3")
    assert "hccn_tool -i N -ip -s address A netmask M" in finding.fix


def test_missing_hccn_tool_warns_and_a_host_without_the_probe_skips_the_check():
    commands = {**ascend_host().commands, "hccn_tool": None}
    assert only(run_checks(ascend_host(commands=commands)), "RoCE").status == Status.WARN
    assert [f for f in run_checks(ascend_host()) if f.check == "RoCE"] == []
