"""`tengyun plan --profile-json FILE`: the plan's estimate beside what a running engine measured.

FILE is what GET /health/detail answered on a running server (node 0's "memory" list, or a
--headless node's "ranks"), or a list of those rank reports (worker/memory_profile.py
MemoryReport). The plan keeps its own estimate; this says how it compares with the measured step
and what the KV cache would hold with the measured peak in its place."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from tengyun.sizing.plan import Plan

REPORT_FIELDS = ("rank", "weights", "activation_used", "activation_estimate", "profile_tokens")


def read_profile(path: str) -> list[dict]:
    """The rank reports in ``path``; ValueError naming the flag when there are none."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--profile-json {path}: cannot read it as JSON ({e}).") from None
    if isinstance(data, dict):
        data = data.get("memory") or [r.get("memory") for r in data.get("ranks") or ()] or [data]
    reports = [r for r in data if isinstance(r, dict) and all(k in r for k in REPORT_FIELDS)] \
        if isinstance(data, list) else []
    if not reports:
        raise ValueError(f"--profile-json {path}: no rank memory report in it; save a running server's "
                         f"'curl -s http://HOST:PORT/health/detail' and pass that file.")
    return reports


def compare(plan: Plan, reports: list[dict], replan: Callable[[int], Plan]) -> dict[str, Any]:
    """The rank whose step took the most against the plan's estimate; ``replan(activation)``: the
    same plan with that many bytes reserved for a step (None where --kv-cache-memory is the budget)."""
    rank = max(reports, key=lambda r: r["activation_used"])
    measured = replan(rank["activation_used"]) if plan.sizing.kv_cache_memory is None else None
    return {
        "rank": rank["rank"], "measured_by": rank.get("measured_by"), "profile_tokens": rank["profile_tokens"],
        "planned_tokens": plan.sizing.max_num_batched_tokens, "activation_peak": rank.get("activation_peak"),
        "activation_used": rank["activation_used"], "activation_estimate": plan.activation_bytes,
        "weights_measured": max(r["weights"] for r in reports),
        "weights_planned": max(s.weight_bytes for s in plan.stages),
        "blocks_planned": plan.blocks, "blocks_with_measured_peak": measured.blocks if measured else None,
    }


def profile_lines(c: dict[str, Any]) -> list[str]:
    def mib(n: int) -> str:
        return f"{n / 2**20:.1f} MiB"

    source = "measured" if c["activation_peak"] is not None else "estimated by the engine (not measurable there)"
    lines = [f"Profile (rank {c['rank']}, {c['measured_by']}): one step of {c['profile_tokens']} tokens took "
             f"{mib(c['activation_used'])} ({source}); this plan's estimate is {mib(c['activation_estimate'])}"
             + (f" ({c['activation_estimate'] / c['activation_used']:.2f}x)" if c["activation_used"] else "")]
    if c["profile_tokens"] != c["planned_tokens"]:
        lines.append(f"  the profile ran at {c['profile_tokens']} tokens per step, this plan at "
                     f"{c['planned_tokens']} (--max-num-batched-tokens): the figures are not like for like")
    lines.append(f"  weights: {mib(c['weights_measured'])} measured on the fullest rank, "
                 f"{mib(c['weights_planned'])} planned for the fullest stage")
    if c["blocks_with_measured_peak"] is not None:
        lines.append(f"  KV cache with the measured peak in place of the estimate: {c['blocks_with_measured_peak']:,} "
                     f"blocks (planned {c['blocks_planned']:,})")
    return lines
