"""HCCL rank tables: generate -> validate passes; every error is caught at its JSON path."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from tengyun.host.ranktable import ServerSpec, generate, parse_hccn_conf, parse_server_arg, validate, validate_text

HCCN_CONF = "\n".join(f"address_{i}=192.168.{100 + i % 4}.{11 + i}\nnetmask_{i}=255.255.255.0" for i in range(8))


def two_servers(version: str = "1.0") -> dict:
    servers = []
    for s, mgmt in enumerate(("10.0.0.10", "10.0.0.11")):
        ips = [f"192.168.{100 + d % 4}.{11 + d + 20 * s}" for d in range(8)]
        sdids = [str(0x40000000 + 8 * s + d) for d in range(8)] if version == "1.2" else None
        servers.append(ServerSpec(mgmt, ips, sdids))
    return generate(servers, version)


def paths(problems) -> list[str]:
    return [p.path for p in problems]


def test_generated_tables_validate_clean():
    table = two_servers()
    assert validate(table) == []
    assert table["version"] == "1.0" and table["server_count"] == "2" and table["status"] == "completed"
    second = table["server_list"][1]
    assert second["server_id"] == "10.0.0.11" and second["host_nic_ip"] == "reserve"
    assert second["device"][0] == {"device_id": "0", "device_ip": "192.168.100.31", "rank_id": "8"}
    a3 = two_servers("1.2")
    assert validate(a3) == []
    assert a3["server_list"][0]["device"][1]["super_device_id"] == str(0x40000001)
    assert a3["super_pod_list"] == [{"super_pod_id": "0",
                                     "server_list": [{"server_id": "10.0.0.10"}, {"server_id": "10.0.0.11"}]}]


def test_server_arguments_and_hccn_conf():
    assert parse_hccn_conf(HCCN_CONF)[:2] == ["192.168.100.11", "192.168.101.12"]
    spec = parse_server_arg("10.0.0.10=@/etc/hccn.conf", read_file=lambda path: HCCN_CONF)
    assert (spec.server_id, len(spec.device_ips)) == ("10.0.0.10", 8)
    spec = parse_server_arg("10.0.0.10=192.168.1.1/1073741824,192.168.1.2/1073741825")
    assert spec.device_ips == ["192.168.1.1", "192.168.1.2"] and spec.super_device_ids == ["1073741824", "1073741825"]
    with pytest.raises(ValueError, match="expected MGMT_IP=DEVICE_IP"):
        parse_server_arg("10.0.0.10")


def test_generate_refuses_device_ips_on_the_management_network():
    with pytest.raises(ValueError, match=r"\$.server_list\[0\].device\[1\].device_ip: device_ip 10.0.0.20 is on "
                                         r"the management subnet 10.0.0.0/24"):
        generate([ServerSpec("10.0.0.10", ["192.168.100.11", "10.0.0.20"])])
    with pytest.raises(ValueError, match="version 1.2 needs each device as IP/SUPER_DEVICE_ID"):
        generate([ServerSpec("10.0.0.10", ["192.168.100.11"])], "1.2")


def test_duplicate_device_ip_is_caught_with_both_paths():
    table = two_servers()
    table["server_list"][1]["device"][3]["device_ip"] = table["server_list"][0]["device"][5]["device_ip"]
    [problem] = validate(table)
    assert problem.path == "$.server_list[1].device[3].device_ip"
    assert problem.message == "device_ip 192.168.101.16 is also used at $.server_list[0].device[5].device_ip"


def test_device_ip_equal_to_or_beside_the_management_ip():
    table = two_servers()
    table["server_list"][0]["device"][2]["device_ip"] = "10.0.0.10"
    table["server_list"][1]["device"][0]["device_ip"] = "10.0.0.99"
    problems = validate(table)
    assert paths(problems) == ["$.server_list[0].device[2].device_ip", "$.server_list[1].device[0].device_ip"]
    assert problems[0].message.startswith("device_ip 10.0.0.10 is the server's management IP")
    assert problems[1].message.startswith("device_ip 10.0.0.99 is on the management subnet 10.0.0.0/24")
    assert "hccn_tool -i <device_id> -ip -g" in problems[1].fix
    assert validate(table, mgmt_prefix=28)[1:] == []  # 10.0.0.99 is outside 10.0.0.0/28


def test_wrong_counts():
    table = two_servers()
    table["server_count"] = "3"
    del table["server_list"][1]["device"][7]
    problems = validate(table)
    assert paths(problems) == ["$.server_count", "$.server_list[1].device"]
    assert problems[0].message == "server_count is '3' but server_list has 2 servers"
    assert problems[1].message == "7 devices, other servers have 8"
    assert paths(validate(two_servers(), devices_per_server=4)) == ["$.server_list[0].device",
                                                                     "$.server_list[1].device"]


def test_rank_ids_must_be_unique_contiguous_and_in_order():
    gap = two_servers()
    gap["server_list"][1]["device"][7]["rank_id"] = "16"
    [problem] = validate(gap)
    assert problem.path == "$.server_list[1].device[7].rank_id"
    assert problem.message == "rank ids are not contiguous: 16 devices but rank_id 15 missing and [16] out of range"
    swapped = two_servers()
    swapped["server_list"][0]["device"][0]["rank_id"], swapped["server_list"][1]["device"][0]["rank_id"] = "8", "0"
    [problem] = validate(swapped)
    assert problem.path == "$.server_list[0].device[1].rank_id"
    assert problem.message == "rank_id 1 comes after rank_id 8: ranks must increase in file order"
    dup = two_servers()
    dup["server_list"][0]["device"][1]["rank_id"] = "0"
    assert paths(validate(dup))[0] == "$.server_list[0].device[1].rank_id"


def test_duplicate_device_id_and_bad_fields():
    table = two_servers()
    table["server_list"][0]["device"][4]["device_id"] = "3"
    table["server_list"][1]["server_id"] = "node-b"
    table["version"] = "2.0"
    table["status"] = "initializing"
    problems = validate(table)
    assert paths(problems) == ["$.version", "$.status", "$.server_list[0].device[4].device_id",
                               "$.server_list[1].server_id"]
    assert problems[2].message == "device_id 3 repeats $.server_list[0].device[3].device_id"


def test_version_1_2_needs_super_device_ids_and_known_pod_servers():
    table = two_servers("1.2")
    del table["server_list"][0]["device"][6]["super_device_id"]
    table["super_pod_list"][0]["server_list"][1]["server_id"] = "10.0.0.99"
    assert paths(validate(table)) == ["$.server_list[0].device[6].super_device_id",
                                      "$.super_pod_list[0].server_list[1].server_id"]


def test_malformed_json_names_line_and_column():
    text = json.dumps(two_servers(), indent=4)
    broken = text.replace('"status": "completed"', '"status": "completed",')
    [problem] = validate_text(broken)
    assert problem.path == "$"
    assert problem.message.startswith("not valid JSON: Expecting property name enclosed in double quotes at line")


def test_cli_generate_then_validate(tmp_path):
    out = tmp_path / "hccl.json"
    conf = tmp_path / "hccn.conf"
    conf.write_text(HCCN_CONF)

    def tengyun(*args):
        return subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", *args],
                              capture_output=True, text=True, timeout=120)

    gen = tengyun("rank-table", "generate", "--server", f"10.0.0.10=@{conf}", "-o", str(out))
    assert gen.returncode == 0, gen.stderr
    ok = tengyun("rank-table", "validate", str(out))
    assert (ok.returncode, ok.stdout.strip()) == (0, f"{out}: OK")
    bad = copy.deepcopy(json.loads(out.read_text()))
    bad["server_list"][0]["device"][1]["device_ip"] = "10.0.0.11"
    out.write_text(json.dumps(bad))
    fail = tengyun("rank-table", "validate", str(out))
    assert fail.returncode == 1
    assert fail.stdout.startswith("error: $.server_list[0].device[1].device_ip: device_ip 10.0.0.11 is on the "
                                  "management subnet")
