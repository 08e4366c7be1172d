"""The communicator set-up runs under a deadline (parallel_state.communicator_setup): a rank whose
peer joined the rendezvous but never builds its groups (a hung hccl_init, a firewall between the
nodes) exits 1 within the deadline, its log naming the rank, host, master and likely causes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from conftest import free_port_pair

RANK = r"""
import datetime, logging, sys, time
import torch.distributed as dist
from tengyun.distributed.parallel_state import init_distributed
from tengyun.distributed.rank_info import RankInfo
logging.basicConfig(level=logging.INFO)
rank, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
info = RankInfo(rank, rank, 2, 2, 1, f"tcp://127.0.0.1:{port}", 60.0)
if mode == "stuck":  # joins the rendezvous, then never sets up its communicators
    dist.init_process_group("gloo", init_method=info.init_method, world_size=2, rank=rank,
                            timeout=datetime.timedelta(seconds=60))
    time.sleep(60)
else:
    init_distributed(info, "gloo", setup_timeout_s=3.0)
    print("SET UP", flush=True)
"""


def _rank(rank: int, port: int, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(port), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_a_peer_that_never_sets_up_makes_the_rank_exit_1_naming_rank_host_master_and_causes():
    port = free_port_pair()
    ranks = [_rank(0, port, "bounded"), _rank(1, port, "stuck")]
    try:
        started = time.monotonic()
        out, _ = ranks[0].communicate(timeout=60)
        assert ranks[0].returncode == 1, out
        assert time.monotonic() - started < 40  # the 3 s deadline after start-up, not the 60 s rendezvous timeout
        assert (f"rank 0 on {socket.gethostname()} hung for 3 s setting up its gloo "
                f"communicators with the other 1 rank(s) (master 127.0.0.1:{port}). Likely causes: the device "
                f"network addresses (RoCE: `hccn_tool -i N -ip -g`") in out, out
        assert "a firewall between the nodes" in out and "run `tengyun doctor` on each" in out
        assert "SET UP" not in out
    finally:
        for p in ranks:
            p.kill()
            p.wait()


def test_both_ranks_set_up_within_the_deadline():
    port = free_port_pair()
    ranks = [_rank(r, port, "bounded") for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=60)[0] for p in ranks]
        assert [p.returncode for p in ranks] == [0, 0], outs
        assert all("SET UP" in out for out in outs)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_worker_sets_up_its_communicators_within_distributed_timeout(tiny_checkpoints, monkeypatch):
    """The deadline a rank's communicator set-up runs under is --distributed-timeout, as the docs say."""
    import pytest

    from tengyun.config import EngineConfig
    from tengyun.distributed.rank_info import RankInfo
    from tengyun.worker.worker import Worker

    asked = {}

    class Stop(Exception):
        pass

    def record(info, backend, setup_timeout_s=None):
        asked.update(backend=backend, setup_timeout_s=setup_timeout_s)
        raise Stop

    monkeypatch.setattr("tengyun.worker.worker.init_distributed", record)
    config = EngineConfig(str(tiny_checkpoints["llama"]), distributed_timeout=42, kv_cache_memory="1MiB").finalize()
    with pytest.raises(Stop):
        Worker(config, RankInfo(rank=0, local_rank=0, world_size=2, tp_size=2, pp_size=1,
                                init_method="tcp://127.0.0.1:1", timeout_s=1800))
    assert asked == {"backend": "gloo", "setup_timeout_s": 42}
