"""`serve --rank-table hccl.json` (or $RANK_TABLE_FILE): the table is validated, this node's HCCL
environment derived from it, and a disagreement with --nnodes / --node-rank / -tp / this host
stops start-up naming both values."""

from __future__ import annotations

import json
import os

import pytest

from tengyun.config import EngineConfig
from tengyun.entrypoints.cli.main import main
from tengyun.host.ranktable import ServerSpec, generate, node_environment, parse_ip_addresses

HCCL_ENV = ("RANK_TABLE_FILE", "RANK_SIZE", "ASCEND_RT_VISIBLE_DEVICES")


def table(servers: int = 2, devices: int = 8) -> dict:
    return generate([ServerSpec(f"10.0.0.{10 + s}",
                                [f"192.168.{100 + d % 4}.{11 + d + 20 * s}" for d in range(devices)])
                     for s in range(servers)])


def write(tmp_path, content: dict) -> str:
    path = tmp_path / "hccl.json"
    path.write_text(json.dumps(content))
    return str(path)


def test_second_node_gets_its_devices_ranks_and_hccl_environment():
    node = node_environment(table(), "/etc/hccl.json", nnodes=2, node_rank=1, tp=8, pp=2)
    assert node.server_id == "10.0.0.11" and node.device_ids == list(range(8))
    assert node.rank_ids == list(range(8, 16))
    assert node.device_ips[:2] == ["192.168.100.31", "192.168.101.32"]
    assert node.env == {"RANK_TABLE_FILE": "/etc/hccl.json", "RANK_SIZE": "16",
                        "ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert "this node is server 10.0.0.11 (--node-rank 1): NPUs 0,1,2,3,4,5,6,7" in node.describe()


@pytest.mark.parametrize("settings, local_ips, visible, message", [
    (dict(nnodes=1, node_rank=0, tp=8, pp=2), set(), None,
     "--rank-table /etc/hccl.json lists 2 servers but --nnodes is 1: pass --nnodes 2"),
    (dict(nnodes=2, node_rank=0, tp=8, pp=2), {"127.0.0.1", "10.0.0.11"}, None,
     "this host is server 1 (10.0.0.11) in --rank-table /etc/hccl.json but --node-rank is 0: pass --node-rank 1"),
    (dict(nnodes=2, node_rank=0, tp=4, pp=1), set(), None,
     "gives server 10.0.0.10 8 NPUs but --tensor-parallel-size 4 x --pipeline-parallel-size 1 over --nnodes 2 puts "
     "2 ranks on each node"),
    (dict(nnodes=2, node_rank=1, tp=8, pp=2), set(), "4,5",
     "ASCEND_RT_VISIBLE_DEVICES is 4,5 but --rank-table /etc/hccl.json gives this node NPUs 0,1,2,3,4,5,6,7"),
])
def test_a_disagreement_with_this_nodes_settings_names_both_values(settings, local_ips, visible, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        node_environment(table(), "/etc/hccl.json", local_ips=local_ips, visible=visible, **settings)


def test_rank_ids_must_be_this_nodes_global_ranks():
    swapped = table()
    swapped["server_list"] = swapped["server_list"][::-1]  # 10.0.0.11 first, renumbered as ranks 0-7
    for s, server in enumerate(swapped["server_list"]):
        for d, device in enumerate(server["device"]):
            device["rank_id"] = str(8 * s + d)
    node_environment(swapped, "t.json", nnodes=2, node_rank=0, tp=8, pp=2)
    devices = swapped["server_list"][0]["device"]
    devices[0]["rank_id"], devices[1]["rank_id"] = "1", "0"  # NPU 0 would be rank 1: HCCL's rank != torch's
    with pytest.raises(ValueError, match=r"numbers server 10.0.0.11's NPUs as ranks \[1, 0, 2"):
        node_environment(swapped, "t.json", nnodes=2, node_rank=0, tp=8, pp=2)


def test_ip_addr_output_gives_the_hosts_addresses():
    text = ("1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever\n"
            "2: enp189s0f0    inet 10.0.0.11/24 brd 10.0.0.255 scope global enp189s0f0\\       valid_lft forever\n"
            "2: enp189s0f0    inet6 fe80::1/64 scope link \\       valid_lft forever preferred_lft forever\n")
    assert parse_ip_addresses(text) == {"127.0.0.1", "10.0.0.11", "fe80::1"}


def test_serve_with_a_rank_table_for_more_nodes_exits_2_naming_both(tmp_path, capsys):
    path = write(tmp_path, table())
    assert main(["serve", "--rank-table", path, "--port", "1", "-tp", "8", "-pp", "2"]) == 2
    assert f"error: --rank-table {path} lists 2 servers but --nnodes is 1: pass --nnodes 2" in capsys.readouterr().err


def test_rank_table_file_environment_is_read_and_an_invalid_table_refused(tmp_path, monkeypatch):
    broken = table(servers=1, devices=2)
    broken["server_list"][0]["device"][1]["device_ip"] = "10.0.0.10"  # the management IP
    monkeypatch.setenv("RANK_TABLE_FILE", write(tmp_path, broken))
    with pytest.raises(ValueError, match=r"is not a valid rank table: \$.server_list\[0\].device\[1\].device_ip: "
                                         r"device_ip 10.0.0.10 is the server's management IP.*`tengyun rank-table "
                                         r"validate .*hccl.json` lists every problem"):
        EngineConfig(tensor_parallel_size=2)


def test_finalize_exports_this_nodes_hccl_environment(tiny_checkpoints, tmp_path, monkeypatch):
    for key in HCCL_ENV:  # unset here, and restored to their value before the test afterwards
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    path = write(tmp_path, table(servers=1, devices=1))
    config = EngineConfig(model=str(tiny_checkpoints["llama"]), rank_table=path, device="cpu").finalize()
    assert config.hccl_node.env == {"RANK_TABLE_FILE": path, "RANK_SIZE": "1", "ASCEND_RT_VISIBLE_DEVICES": "0"}
    assert {key: os.environ[key] for key in HCCL_ENV} == config.hccl_node.env
