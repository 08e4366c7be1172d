"""Data parallelism's settings (vLLM's --data-parallel-* flags), checked once for `tengyun serve`
and `tengyun plan`, and the one layout fact both read.

    --data-parallel-size 2 -tp 2: 2 replicas x 2 ranks = 4 ranks; each replica holds the whole
    model (split over its own TP ranks), its own KV cache and scheduler; one API server in front.
    With --enable-expert-parallel the EP group would span all dp x tp ranks (vLLM's semantics):
    512 experts / (4 x 8) = 16 whole experts per rank, attention replicated per replica.

Pure Python: `tengyun plan` imports it without torch.
"""

from __future__ import annotations

from typing import Any


DATA_PARALLEL_ENV = "TENGYUN_DATA_PARALLEL"  # a replica's "<index>,<replicas>,<host>:<port>" (vLLM: VLLM_DP_RANK)


def replica_env(index: int, replicas: int, address: str) -> dict[str, str]:
    """The environment under which replica ``index``'s workers join the replicas' expert exchange
    (--data-parallel-size with --enable-expert-parallel; distributed/data_parallel.py reads it)."""
    return {DATA_PARALLEL_ENV: f"{index},{replicas},{address}"}


def expert_parallel_size(tp: int, dp: int = 1) -> int:
    """Ranks one MoE layer's experts are divided among under --enable-expert-parallel: dp x tp."""
    return tp * dp


def expert_split_problem(spec: Any, tp: int, dp: int) -> str | None:
    """Why --enable-expert-parallel cannot divide a ModelSpec's experts whole among dp x tp ranks, or None."""
    if dp == 1:
        return spec.expert_parallel_problem(tp)
    ranks = expert_parallel_size(tp, dp)
    if spec.moe is None or spec.moe.num_experts % ranks == 0:
        return None
    experts = spec.moe.num_experts
    return (f"--enable-expert-parallel divides the {experts} experts of each MoE layer whole among the {ranks} "
            f"expert-parallel ranks (--data-parallel-size {dp} x --tensor-parallel-size {tp}), but {ranks} does not "
            f"divide {experts}: use sizes whose product divides {experts}, or drop --enable-expert-parallel.")


def check_data_parallel(settings: Any) -> None:
    """The --data-parallel-* values as typed (EngineConfig's constructor); raises ValueError naming
    the flag. What `tengyun serve` cannot run yet is serving_problem's."""
    dp, local = settings.data_parallel_size, settings.data_parallel_size_local
    if dp < 1:
        raise ValueError(f"--data-parallel-size must be >= 1 (try 1); got {dp}.")
    if local is not None and not 1 <= local <= dp:
        raise ValueError(f"--data-parallel-size-local must be in 1..--data-parallel-size {dp}; got {local}.")
    if not 0 <= settings.data_parallel_start_rank < dp:
        raise ValueError(f"--data-parallel-start-rank must be in 0..{dp - 1} (--data-parallel-size {dp}); "
                         f"got {settings.data_parallel_start_rank}.")
    port = settings.data_parallel_rpc_port
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"--data-parallel-rpc-port must be in 1..65535 (try 13345); got {port}.")


def serving_problem(settings: Any) -> str | None:
    """What `tengyun serve` cannot run yet of a layout `tengyun plan` can still plan, or None:
    replicas on other nodes, replicas whose ranks span nodes, and data parallel with expert parallel."""
    dp, local = settings.data_parallel_size, settings.data_parallel_size_local
    if local is not None and local < dp:
        return (f"--data-parallel-size-local {local} < --data-parallel-size {dp} leaves {dp - local} replica(s) to "
                f"other nodes, which Tengyun does not run yet: run all {dp} on this node (drop "
                f"--data-parallel-size-local), or start one server per node behind a load balancer.")
    if settings.data_parallel_start_rank != 0:
        return (f"--data-parallel-start-rank {settings.data_parallel_start_rank} starts replicas for another node's "
                f"API server (vLLM's headless data-parallel nodes), which Tengyun does not run yet: drop "
                f"--data-parallel-start-rank.")
    if dp > 1 and settings.nnodes > 1:
        return (f"--data-parallel-size {dp} with --nnodes {settings.nnodes}: replicas whose ranks span nodes are not "
                f"run yet: use --nnodes 1 (every replica on this node), or --data-parallel-size 1.")
    if dp > 1 and settings.master_port is not None:
        return (f"--master-port with --data-parallel-size {dp}: each replica's ranks meet on a free port of their "
                f"own on one node: drop --master-port.")
    if dp > 1 and settings.enable_expert_parallel and settings.pipeline_parallel_size > 1:
        return (f"--enable-expert-parallel with --data-parallel-size {dp} steps the replicas together through each "
                f"MoE layer, which is not run with --pipeline-parallel-size {settings.pipeline_parallel_size} yet: "
                f"use --pipeline-parallel-size 1, or drop --enable-expert-parallel.")
    if dp > 1 and settings.enable_expert_parallel and settings.speculative_config is not None:
        return (f"--enable-expert-parallel with --data-parallel-size {dp} is not run with --speculative-config "
                f"yet: drop one of them.")
    return None
