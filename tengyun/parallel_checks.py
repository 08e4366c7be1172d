"""The parallel settings' own checks, run when an EngineConfig is built (before the model is
read): TP / PP sizes, the executor, nodes and ports, timeouts, data parallel, and --rank-table
(else $RANK_TABLE_FILE) read against this node. ``config``: the EngineConfig being built (not
imported here: config.py imports this module)."""

from __future__ import annotations

import os
from typing import Any

from tengyun.sizing.data_parallel import check_data_parallel

SUPPORTED_EXECUTOR_BACKENDS = ("mp", "uni")


def check_parallel_values(config: Any) -> None:
    """The parallel layout as typed (sizes, nodes, ports, timeouts, data parallel), then --rank-table."""
    if config.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1 (try 1); got {config.tensor_parallel_size}.")
    if config.pipeline_parallel_size < 1:
        raise ValueError(f"--pipeline-parallel-size must be >= 1 (try 1); got {config.pipeline_parallel_size}.")
    if config.executor_backend not in SUPPORTED_EXECUTOR_BACKENDS:
        raise ValueError(f"--distributed-executor-backend must be one of mp, uni; "
                         f"got {config.distributed_executor_backend!r}.")
    if config.executor_backend == "uni" and config.world_size > 1:
        raise ValueError(
            f"--distributed-executor-backend uni runs one process, but --tensor-parallel-size x "
            f"--pipeline-parallel-size is {config.world_size}: use --distributed-executor-backend mp."
        )
    if config.nnodes < 1 or not 0 <= config.node_rank < config.nnodes:
        raise ValueError(f"--node-rank must be in [0, --nnodes {config.nnodes}); got {config.node_rank}.")
    if config.world_size % config.nnodes:
        raise ValueError(
            f"--tensor-parallel-size x --pipeline-parallel-size = {config.world_size} ranks cannot be "
            f"split evenly over --nnodes {config.nnodes}: use a node count that divides {config.world_size}."
        )
    if config.nnodes > 1 and config.master_port is None:
        raise ValueError("--nnodes > 1 needs --master-port (the same free port on every node, e.g. 29500) "
                         "and --master-addr (node 0's address).")
    if config.headless and config.node_rank == 0 and config.data_parallel_size == 1:
        raise ValueError("--headless runs workers only; node 0 runs the engine: drop --headless "
                         "or pass --node-rank 1 or higher (data-parallel replicas for another node's API "
                         "server: --data-parallel-size with --data-parallel-start-rank).")
    if config.master_port is not None and not 0 < config.master_port < 65536:
        raise ValueError(f"--master-port must be in 1..65535 (try 29500); got {config.master_port}.")
    check_data_parallel(config)
    if config.distributed_timeout <= 0:
        raise ValueError(
            f"--distributed-timeout must be positive seconds (try 300); got {config.distributed_timeout}.")
    if config.device_init_timeout is not None and config.device_init_timeout <= 0:
        raise ValueError(f"--device-init-timeout must be positive seconds (try 120); "
                         f"got {config.device_init_timeout}.")
    read_rank_table(config)


def read_rank_table(config: Any) -> None:
    """--rank-table (else $RANK_TABLE_FILE): validated and checked against this node's settings."""
    from tengyun.host import probe, ranktable

    if config.rank_table is None:
        config.rank_table = os.environ.get("RANK_TABLE_FILE") or None
    if config.rank_table is None:
        return
    local_ips = ranktable.parse_ip_addresses(probe.ip_addresses())
    config.hccl_node = ranktable.read_node_environment(
        config.rank_table, config.nnodes, config.node_rank, config.tensor_parallel_size, config.pipeline_parallel_size,
        local_ips, os.environ.get("ASCEND_RT_VISIBLE_DEVICES"))
