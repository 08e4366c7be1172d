"""Data-parallel replicas over two nodes, each in its own network namespace (test_headless_netns's
veth pair): the API node listens on its --data-parallel-address only, the headless node's replica
connects from its own address and serves a completion; when the link is taken down (no FIN reaches
either side) the API node names replica 1 and its node within seconds (TCP keepalive), exits 1,
the headless node stops by itself and no process is left. Skipped, saying why, where namespaces
cannot be made."""

from __future__ import annotations

import json
import sys

from remote_server import MAX_MODEL_LEN, server_model  # noqa: F401 (fixture)
from test_headless_netns import _assert_none_left, _ip, _kill_left, _tails, _tree, _wait, namespaces  # noqa: F401 (fixture)

STOP_WAIT_S = 60  # far above the ~5 s keepalive bound: only a hang reaches it


def test_a_cut_link_to_a_headless_data_parallel_node_is_named_and_nothing_hangs(namespaces, server_model, tmp_path):
    ns = namespaces
    common = [sys.executable, "-m", "tengyun.entrypoints.openai.api_server", str(server_model),
              "-dp", "2", "-dpl", "1", "-dpa", ns.addr[0], "-dpp", "13345", "--kv-cache-memory", "64MiB",
              "--max-model-len", str(MAX_MODEL_LEN), "--device-metrics-interval", "0", "--disable-uvicorn-access-log"]
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TENGYUN_API_KEY": "", "VLLM_API_KEY": ""}
    logs = [tmp_path / "api_node.log", tmp_path / "headless.log"]
    procs = [ns.run(0, [*common, "--host", ns.addr[0], "--port", "8000"], env, logs[0]),
             ns.run(1, [*common, "--headless", "-dpr", "1"], env, logs[1])]
    try:
        url = f"http://{ns.addr[0]}:8000"
        _wait(ns, 0, url + "/health", 200, procs, logs)
        replicas = json.loads(ns.http(0, url + "/health/detail")[1])["data_parallel"]
        assert [(r["node"], r["alive"]) for r in replicas] == [(None, True), (ns.addr[1], True)]
        for i in range(2):  # one on each replica (least load, then round-robin)
            status, body = ns.http(0, url + "/v1/completions", {"prompt": f"Hello {i}", "max_tokens": 3})
            assert status == 200, body
        seen = _tree(procs[0].pid) | _tree(procs[1].pid)

        assert _ip("-n", ns.ns[1], "link", "set", ns.veth[1], "down").returncode == 0
        assert procs[0].wait(STOP_WAIT_S) == 1, _tails(logs)
        assert (f"data-parallel engine 1 (pid {replicas[1]['pid']} on {ns.addr[1]}): The connection to its node "
                f"{ns.addr[1]} closed") in logs[0].read_text()
        assert procs[1].wait(STOP_WAIT_S) == 0, _tails(logs)
        assert "replica 1 stopped" in logs[1].read_text()
        _assert_none_left(seen)
    finally:
        _kill_left(procs)
