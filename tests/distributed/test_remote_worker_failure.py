"""A rank of another node that dies during a step is named as the cause of rank 0's failed
collective, even when its node's report comes after rank 0's error (node 0: LLM in this
process; node 1: a --headless server process on 127.0.0.1)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from tengyun import LLM, SamplingParams
from tengyun.executor.multiproc_executor import WorkerDiedError

from conftest import free_port_pair

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
SHAPE = dict(block_size=8, max_model_len=64, kv_cache_memory="1MiB", tensor_parallel_size=2, nnodes=2)


def _start_headless_node(model, port: int, log_path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "tengyun.entrypoints.openai.api_server", str(model), "--headless",
            "--block-size", "8", "--max-model-len", "64", "--kv-cache-memory", "1MiB",
            "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(port)]
    return subprocess.Popen(argv, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)


def test_remote_rank_killed_before_a_step_is_named_even_when_its_report_is_late(tiny_checkpoints, tmp_path):
    port = free_port_pair()
    log = tmp_path / "node1.log"
    node1 = _start_headless_node(tiny_checkpoints["llama"], port, log)
    llm = None
    try:
        llm = LLM(str(tiny_checkpoints["llama"]), node_rank=0, master_addr="127.0.0.1", master_port=port, **SHAPE)
        assert llm.generate([[1, 2, 3]], PARAMS)[0].outputs[0].token_ids  # the world works
        pid = int(re.search(r"Headless node 1: ranks \[1\] \(pids \[(\d+)\]\)", log.read_text()).group(1))
        os.kill(node1.pid, signal.SIGSTOP)  # node 1's launcher cannot report yet
        os.kill(pid, signal.SIGKILL)
        # Rank 0's broadcast fails at once; node 1's report follows 0.3 s later, inside the grace.
        threading.Timer(0.3, os.kill, (node1.pid, signal.SIGCONT)).start()
        with pytest.raises(WorkerDiedError, match=rf"worker rank 1 \(pid {pid}\) on node 1 exited with code -9"):
            llm.generate([[4, 5, 6]], PARAMS)
        assert node1.wait(60) == 1
    finally:
        if llm is not None:
            llm.llm_engine.shutdown()
        if node1.poll() is None:
            node1.kill()
            node1.wait()
