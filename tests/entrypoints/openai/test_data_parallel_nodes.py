"""Data-parallel replicas over two "nodes" (vLLM's multi-node layout), each node a process tree of
its own on 127.0.0.1: the API node `-dp 2 -dpl 1 -dpa 127.0.0.1 -dpp P` runs replica 0 and the
API; `--headless -dp 2 -dpl 1 -dpr 1 -dpa 127.0.0.1 -dpp P` runs replica 1 and connects it.
Requests routed to the remote replica get one engine's greedy tokens and logprobs; killing the
headless node's whole process tree turns /health 503 naming replica 1 and its node while
replica 0's request finishes; nodes whose flags disagree are refused naming the flag, and a
missing API node or headless node ends in a timeout naming the flags; a headless node whose API
node is killed stops by itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from conftest import free_port_pair
from remote_server import MAX_MODEL_LEN, RemoteServer, free_port, server_model  # noqa: F401 (fixtures)
from test_data_parallel_server import (  # noqa: F401 (fixtures)
    _check_same_as_one_engine, _kill_replica_1_under_two_long_requests, _one_engine, _running, _wait_for, _when,
    hybrid_moe_model,
)


class HeadlessNode:
    """`api_server MODEL --headless ...` in a session of its own (its own process tree), output in a
    log; its /health and /metrics on a free --port (url)."""

    def __init__(self, model, args: list[str], log_path):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [str(model), "--headless", "--kv-cache-memory", "64MiB", "--max-model-len", str(MAX_MODEL_LEN),
                "--port", str(port), *args]
        self.proc = subprocess.Popen([sys.executable, "-m", "tengyun.entrypoints.openai.api_server", *argv],
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_exit(self, timeout: float = 120.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"headless node still running {timeout} s later:\n{self.log()}")

    def kill_tree(self) -> None:
        """SIGKILL to the node's every process (its launcher and engine processes), as a lost host."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill_tree()
        self._log.close()


def _link(dp: int, port: int) -> list[str]:
    return ["-dp", str(dp), "-dpa", "127.0.0.1", "-dpp", str(port)]


def test_replica_on_a_headless_node_answers_as_one_engine_and_its_loss_is_named(server_model, tmp_path):
    port = free_port_pair()
    head = RemoteServer(server_model, [*_link(2, port), "-dpl", "1", "--dtype", "float32",
                                       "--return-tokens-as-token-ids"], tmp_path / "head.log")
    node = HeadlessNode(server_model, [*_link(2, port), "-dpl", "1", "-dpr", "1", "--dtype", "float32"],
                        tmp_path / "node.log")
    try:
        head.wait_ready()
        client = openai.OpenAI(base_url=head.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        _check_same_as_one_engine(client, model, head.url, _one_engine(server_model))
        replicas = httpx.get(head.url + "/health/detail", timeout=10).json()["data_parallel"]
        assert [(r["engine"], r["node"], r["alive"]) for r in replicas] == [("0", None, True), ("1", "127.0.0.1", True)]
        assert f"Data parallel: replica 1 in process(es) {replicas[1]['pid']} (fork)" in node.log()

        threads, results, both = _kill_replica_1_under_two_long_requests(client, model, head, kill=node.kill_tree)
        assert _running(both, "vllm", "1") == 1
        health = _wait_for(lambda: _when(httpx.get(head.url + "/health", timeout=10), lambda r: r.status_code == 503),
                           "/health 503 after the headless node was killed")
        assert (f"data-parallel engine 1 (pid {replicas[1]['pid']} on 127.0.0.1): The connection to its node "
                f"127.0.0.1 closed") in health.text
        for thread in threads:
            thread.join(timeout=300)
        assert sorted(map(str, results.values()))[-1] == "length", results  # replica 0's: all its tokens
        assert sum(isinstance(r, Exception) for r in results.values()) == 1, results
        assert head.wait_exit(timeout=60) == 1
    finally:
        head.stop()
        node.stop()


def test_nodes_whose_flags_disagree_are_refused_naming_the_flag(server_model, hybrid_moe_model, tmp_path):
    port = free_port_pair()
    head = RemoteServer(server_model, [*_link(3, port), "-dpl", "1"], tmp_path / "head.log")
    nodes = []

    def node(*args: str, model=server_model) -> HeadlessNode:
        nodes.append(HeadlessNode(model, list(args), tmp_path / f"node{len(nodes)}.log"))
        return nodes[-1]

    try:
        first = node(*_link(3, port), "-dpl", "1", "-dpr", "1")  # replica 1: welcomed, loads
        _wait_for(lambda: "replica 1 connected from 127.0.0.1" in head.log(), "replica 1 connected")
        cases = [
            (node(*_link(3, port), "-dpl", "2", "-dpr", "1"), "replica 1 is already served by the node at 127.0.0.1"),
            (node(*_link(4, port), "-dpl", "1", "-dpr", "2"),
             "runs --data-parallel-size 4, but the API node runs --data-parallel-size 3"),
            (node(*_link(3, port), "-dpl", "1", "-dpr", "2", "--enable-expert-parallel"),
             "runs --enable-expert-parallel on, but the API node runs --enable-expert-parallel off"),
            (node(*_link(3, port), "-dpl", "1", "-dpr", "2", model=hybrid_moe_model),
             "serves another model (Qwen3_5MoeForCausalLM, 4 layers, hidden size 64, vocabulary 384) than the API "
             "node (LlamaForCausalLM, 2 layers, hidden size 64, vocabulary 384): give every node the same model"),
            (node(*_link(3, port), "-dpl", "1"), "--headless with --data-parallel-size 3 runs replicas for another"),
            (node(*_link(3, port), "-dpl", "2", "-dpr", "2"), "runs replicas 2..3, past the last of "
                                                              "--data-parallel-size 3"),
        ]
        for refused, message in cases:
            assert refused.wait_exit() == 2, refused.log()
            assert message in refused.log()
        assert first.proc.poll() is None
        health = httpx.get(head.url + "/health", timeout=10)  # replica 2's node never came
        assert health.status_code == 503 and (f"warming up; data-parallel replica 2 not connected yet (--headless "
                                              f"nodes, to port {port})") in health.text, health.text
        head.proc.kill()  # the API node goes away: the welcomed node's replica reads it as Shutdown
        assert first.wait_exit() == 0, first.log()
        assert "replica 1 stopped (the API node said Shutdown, or went away)" in first.log()
    finally:
        for each in nodes:
            each.stop()
        head.stop()


def test_a_missing_api_node_or_headless_node_times_out_naming_the_flags(server_model, tmp_path):
    port = free_port_pair()
    lonely = HeadlessNode(server_model, [*_link(2, port), "-dpl", "1", "-dpr", "1", "--distributed-timeout", "2"],
                          tmp_path / "node.log")
    try:
        assert lonely.wait_exit() == 1
        assert (f"data-parallel replica 1 could not reach the API node at 127.0.0.1:{port} (--data-parallel-address, "
                f"--data-parallel-rpc-port) within 2 s (--distributed-timeout)") in lonely.log()
    finally:
        lonely.stop()
    head = RemoteServer(server_model, [*_link(2, port), "-dpl", "1", "--distributed-timeout", "3"],
                        tmp_path / "head.log")
    try:
        assert head.wait_exit() == 1
        assert "data-parallel replica 1 never connected" in head.log()
        assert "(--data-parallel-address, --data-parallel-rpc-port) within 3 s (--distributed-timeout)" in head.log()
    finally:
        head.stop()


def test_expert_parallel_over_two_nodes_steps_in_lockstep_and_answers_as_one_engine(hybrid_moe_model, tmp_path):
    """EP 2 over DP 2 on Qwen3.5-MoE, the replicas on two nodes: each holds 4 of the 8 experts and
    they meet for every MoE layer at the API node's --data-parallel-rpc-port + 1; a request on one
    replica steps the other (on the other node) through the exchanges with an empty batch."""
    port = free_port_pair()
    flags = [*_link(2, port), "-dpl", "1", "--enable-expert-parallel", "--dtype", "float32"]
    head = RemoteServer(hybrid_moe_model, [*flags, "--return-tokens-as-token-ids"], tmp_path / "head.log")
    node = HeadlessNode(hybrid_moe_model, [*flags, "-dpr", "1"], tmp_path / "node.log")
    try:
        head.wait_ready()
        client = openai.OpenAI(base_url=head.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        _check_same_as_one_engine(client, model, head.url, _one_engine(hybrid_moe_model))
        one = client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})  # one replica busy, the other empty
        assert one.usage.completion_tokens == 8
        assert "replica 0 is expert-parallel rank 0 of 2" in head.log()
        assert "replica 1 is expert-parallel rank 1 of 2" in node.log()
        assert f"joined the replicas' expert exchange at 127.0.0.1:{port + 1}" in node.log()
        head.stop()  # SIGTERM: the API node tells every replica Shutdown, the remote one too
        assert node.wait_exit() == 0, node.log()
        assert "replica 1 stopped" in node.log() and "Engine loop died" not in head.log() + node.log()
    finally:
        head.stop()
        node.stop()
