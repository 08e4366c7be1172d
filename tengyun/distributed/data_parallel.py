"""Expert parallelism across data-parallel replicas (--data-parallel-size N --enable-expert-parallel).

Each replica is its own engine with its own torch.distributed world (its tp ranks). The replicas'
ranks of the same TP index also form a DP group of their own, a gloo process group over a TCP
store on --data-parallel-rpc-port (or a free port): replica d's TP rank t is member d of group t.
The EP group is then all dp x tp ranks: rank (d, t) is EP rank d * tp + t and holds experts
[r * E / ep, (r + 1) * E / ep) (vLLM's layout).

One MoE layer, on every rank of every replica, in the same order (fused_moe.py):

    own tokens x [T_d, H], top-k ids / weights [T_d, K]
    -> all-gather over the DP group (padded to max T, then trimmed): X [sum T, H]
    -> this rank's experts over all of X -> partial Y [sum T, H]
    -> all-reduce over the DP group (the sum of the replicas' ranks of this TP index), keep own rows
    -> the TP all-reduce within the replica (expert_parallel_combine), as without DP

Every replica runs every MoE layer's exchange in the same steps: a replica with nothing to
schedule runs only the exchanges (run_empty_step), with zero tokens of its own. Each step starts
with a vote over the DP group (step_vote): whether any replica still has requests, or has seen a
newer wave than another (the engine's DataParallelWave), which decides for all of them at once
whether the next step runs.

The replica's index and the store's address come from the engine process that starts the
replica's worker(s) (DATA_PARALLEL_ENV), as vLLM passes VLLM_DP_RANK.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tengyun.engine.data_parallel_wave import keep_stepping
from tengyun.sizing.data_parallel import DATA_PARALLEL_ENV

logger = logging.getLogger(__name__)



@dataclass
class _DataParallel:
    rank: int  # the replica's index
    size: int  # replicas
    group: object  # gloo, the replicas' ranks of this TP index


_DP: _DataParallel | None = None


def init_from_env(tp_rank: int, timeout_s: float) -> tuple[int, int] | None:
    """Join this TP index's DP group when the environment names a replica; -> (replica, replicas)
    or None. Replica 0's TP rank 0 hosts the store."""
    global _DP
    value = os.environ.get(DATA_PARALLEL_ENV)
    if not value:
        return None
    index, size, address = value.split(",", 2)
    index, size = int(index), int(size)
    host, port = address.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), None, index == 0 and tp_rank == 0, timeout=timeout,
                          wait_for_workers=False)
    group = dist.ProcessGroupGloo(dist.PrefixStore(f"dp_ep/tp{tp_rank}", store), index, size, timeout)
    _DP = _DataParallel(index, size, group)
    logger.info("Data parallel: replica %d of %d, TP rank %d joined the replicas' expert exchange at %s",
                index, size, tp_rank, address)
    return index, size


def join_replicas(config, tp_rank: int) -> None:
    """A worker of one replica of --data-parallel-size N --enable-expert-parallel joins its TP index's
    DP group and widens the EP group over the replicas; a no-op otherwise."""
    from tengyun.distributed.parallel_state import widen_expert_parallel

    if not (config.enable_expert_parallel and config.data_parallel_size > 1):
        return
    joined = init_from_env(tp_rank, config.distributed_timeout)
    if joined is None:
        raise ValueError(f"--data-parallel-size {config.data_parallel_size} with --enable-expert-parallel runs "
                         f"replicas that `tengyun serve` starts together; this engine was started alone.")
    widen_expert_parallel(*joined)


def active() -> bool:
    return _DP is not None


def step_vote(unfinished: int, wave: int) -> bool:
    """Every replica, at the start of each step: its unfinished requests and the newest wave it has
    seen -> whether the replicas step again after this one (any request left anywhere, or a wave
    one replica has seen and another not yet). The same answer on every replica."""
    votes = [torch.zeros(2, dtype=torch.int64) for _ in range(_DP.size)]
    _DP.group.allgather([votes], [torch.tensor([unfinished, wave], dtype=torch.int64)]).wait()
    return keep_stepping([(int(v[0]), int(v[1])) for v in votes])


def gather_tokens(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, slice]:
    """This replica's x [T, H], weights / ids [T, K] -> every replica's, concatenated in replica
    order, and the rows that are this replica's. T = [3, 0, 2], this replica 2 -> rows 3:5 of 5."""
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(_DP.size)]
    _DP.group.allgather([counts], [torch.tensor([x.shape[0]], dtype=torch.int64)]).wait()
    counts = [int(c) for c in counts]
    start = sum(counts[:_DP.rank])
    return (_gather_padded(x, counts), _gather_padded(weights, counts), _gather_padded(ids, counts),
            slice(start, start + counts[_DP.rank]))


def _gather_padded(t: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """All-gather rows of unequal counts: gloo's allgather takes equal shapes, so pad to the largest."""
    rows = max(counts)
    padded = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[:t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in counts]
    _DP.group.allgather([parts], [padded]).wait()
    return torch.cat([part[:n] for part, n in zip(parts, counts)])


def sum_over_replicas(y: torch.Tensor) -> torch.Tensor:
    """y [sum T, H], this rank's experts' share for every replica's tokens -> summed over the DP group."""
    y = y.contiguous()
    _DP.group.allreduce([y]).wait()
    return y
