"""Data parallelism's settings (vLLM's --data-parallel-* flags), checked once for `tengyun serve`
and `tengyun plan`, and the one layout fact both read.

    --data-parallel-size 2 -tp 2: 2 replicas x 2 ranks = 4 ranks; each replica holds the whole
    model (split over its own TP ranks), its own KV cache and scheduler; one API server in front.
    With --enable-expert-parallel the EP group would span all dp x tp ranks (vLLM's semantics):
    512 experts / (4 x 8) = 16 whole experts per rank, attention replicated per replica.

    Replicas over nodes (vLLM's layout): -dp 4 -dpl 2 on the API node runs replicas 0, 1;
    --headless -dp 4 -dpl 2 -dpr 2 on another runs 2, 3 and connects them to the API node's
    --data-parallel-address : --data-parallel-rpc-port (engine/data_parallel_link.py).

Pure Python: `tengyun plan` imports it without torch.
"""

from __future__ import annotations

from typing import Any


DATA_PARALLEL_ENV = "TENGYUN_DATA_PARALLEL"  # a replica's "<index>,<replicas>,<host>:<port>" (vLLM: VLLM_DP_RANK)
DEFAULT_RPC_PORT = 29550  # vLLM's --data-parallel-rpc-port default, where replicas span nodes


def local_replicas(settings: Any) -> range:
    """The replica indexes this node runs: -dp 4 -> 0..3; -dp 4 -dpl 2 -dpr 2 -> 2..3."""
    start = settings.data_parallel_start_rank
    local = settings.data_parallel_size_local
    return range(start, start + (settings.data_parallel_size if local is None else local))


def spans_nodes(settings: Any) -> bool:
    """Whether some replicas run on another node (this one runs fewer than --data-parallel-size)."""
    return len(local_replicas(settings)) < settings.data_parallel_size


def rpc_port(settings: Any) -> int:
    """Where the API node listens for other nodes' replicas (replicas over nodes only)."""
    return settings.data_parallel_rpc_port or DEFAULT_RPC_PORT


def expert_exchange_address(settings: Any) -> str | None:
    """Where the replicas' workers meet for the expert exchange over nodes: the API node's
    --data-parallel-address, --data-parallel-rpc-port + 1 (13345 -> 13346); None on one node."""
    if not spans_nodes(settings):
        return None
    return f"{settings.data_parallel_address or '127.0.0.1'}:{rpc_port(settings) + 1}"


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
    start = settings.data_parallel_start_rank
    if not 0 <= start < dp:
        raise ValueError(f"--data-parallel-start-rank must be in 0..{dp - 1} (--data-parallel-size {dp}); "
                         f"got {start}.")
    mine = local_replicas(settings)
    if mine.stop > dp:
        given = f"{len(mine)}" if local is not None else f"unset, so all {dp}"
        raise ValueError(f"--data-parallel-start-rank {start} with --data-parallel-size-local {given} runs "
                         f"replicas {start}..{mine.stop - 1}, past the last of --data-parallel-size {dp} "
                         f"({dp - 1}): pass --data-parallel-size-local {dp - start} or less.")
    port = settings.data_parallel_rpc_port
    if port is not None and not 0 < port < 65535:
        raise ValueError(f"--data-parallel-rpc-port must be in 1..65534 (try 13345); got {port}.")


def serving_problem(settings: Any) -> str | None:
    """What `tengyun serve` cannot run of a layout `tengyun plan` can still plan, or None: a node's
    role unclear (API node or --headless replicas), replicas whose ranks span nodes, and data
    parallel with expert parallel beside pipeline stages or drafts."""
    dp = settings.data_parallel_size
    if problem := _node_role_problem(settings):
        return problem
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


def _node_role_problem(settings: Any) -> str | None:
    """Replicas over nodes: the API node runs replicas from 0; a --headless node runs a later
    range and must know the API node's address."""
    dp, start = settings.data_parallel_size, settings.data_parallel_start_rank
    if dp == 1 or settings.nnodes > 1:
        return None
    if settings.headless and start == 0:
        return (f"--headless with --data-parallel-size {dp} runs replicas for another node's API server, from "
                f"--data-parallel-start-rank (this node's first replica; the API node runs 0 up to its "
                f"--data-parallel-size-local - 1): pass it, or drop --headless on the node that serves the API.")
    if settings.headless and not settings.data_parallel_address:
        return ("--headless with --data-parallel-size needs --data-parallel-address (the API node's address) and "
                "--data-parallel-rpc-port (its port for the replicas, the same on every node).")
    if not settings.headless and start != 0:
        return (f"--data-parallel-start-rank {start} runs replicas for another node's API server: add --headless "
                f"(with --data-parallel-address, the API node's address), or drop --data-parallel-start-rank on "
                f"the node that serves the API.")
    return None
