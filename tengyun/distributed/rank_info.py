"""Where one worker process sits in the world (pure Python: the engine process builds these)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankInfo:
    """Where one worker process sits; built by the executor, sent to the process."""

    rank: int
    local_rank: int  # device index on this node
    world_size: int
    tp_size: int
    pp_size: int
    init_method: str  # tcp://MASTER_ADDR:MASTER_PORT
    timeout_s: float
    expert_parallel: bool = False  # --enable-expert-parallel: MoE experts divided whole over the EP group

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size


def node_ranks(world_size: int, nnodes: int, node_rank: int) -> range:
    """Global ranks on node ``node_rank``: consecutive, so a TP group stays inside a node.
    8 ranks, 2 nodes: node 0 -> 0..3, node 1 -> 4..7."""
    per_node = world_size // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)
