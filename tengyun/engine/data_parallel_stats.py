"""DataParallelStats: the engine stats of N data-parallel replicas as one EngineStats (what the
stats log line, /health/detail and GET /load read), with each replica's own kept for the
per-engine metrics (vLLM's `engine` label).

    replica 0: running 3, waiting 1, KV 0.50 of 100 blocks, 40 generated
    replica 1: running 1, waiting 0, KV 0.10 of 100 blocks, 12 generated
    ->          running 4, waiting 1, KV (50 + 10) / 200 = 0.30 of 200 blocks, 52 generated

Pure Python: no torch import.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from tengyun.engine.llm_engine import EngineStats
from tengyun.spec_decode.stats import SpecDecodeStats

SUMMED = ("num_running", "num_waiting", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
          "prompt_tokens", "generation_tokens", "num_kv_blocks")


@dataclass
class DataParallelStats(EngineStats):
    engine_index: int = 0  # the replica whose step produced this update
    replicas: tuple[EngineStats, ...] = ()  # each replica's latest, by index


def combine(replicas: list[EngineStats], engine_index: int) -> DataParallelStats:
    """The replicas' stats as one (sums; KV usage weighted by each replica's blocks)."""
    sums = {name: sum(getattr(r, name) for r in replicas) for name in SUMMED}
    used = sum(r.kv_cache_usage * r.num_kv_blocks for r in replicas)
    usage = used / sums["num_kv_blocks"] if sums["num_kv_blocks"] else max(r.kv_cache_usage for r in replicas)
    return DataParallelStats(
        **sums, kv_cache_usage=usage, spec_decode=_spec_decode(replicas),
        running_loras=tuple(sorted({a for r in replicas for a in r.running_loras})),
        waiting_loras=tuple(sorted({a for r in replicas for a in r.waiting_loras})),
        expert_load=_expert_load(replicas), engine_index=engine_index, replicas=tuple(replicas))


def _spec_decode(replicas: list[EngineStats]) -> SpecDecodeStats | None:
    stats = [r.spec_decode for r in replicas if r.spec_decode is not None]
    if not stats:
        return None
    total = dataclasses.replace(stats[0], num_accepted_tokens_per_pos=list(stats[0].num_accepted_tokens_per_pos))
    for s in stats[1:]:
        total.num_drafts += s.num_drafts
        total.num_draft_tokens += s.num_draft_tokens
        total.num_accepted_tokens += s.num_accepted_tokens
        total.num_accepted_tokens_per_pos = [a + b for a, b in zip(total.num_accepted_tokens_per_pos,
                                                                    s.num_accepted_tokens_per_pos)]
    return total


def _expert_load(replicas: list[EngineStats]) -> dict[tuple[int, int], int] | None:
    loads = [r.expert_load for r in replicas if r.expert_load is not None]
    if not loads:
        return None
    total: Counter = Counter()
    for load in loads:
        total.update(load)
    return dict(total)
