"""`tengyun plan MODEL --compare tp8-pp4 dp4-tp8-ep`: layouts of the same cards side by side,
each planned as `tengyun plan` plans it (sizing/plan.py), the other settings shared.

A layout is dash-separated parts: tpN, ppN, dpN (each default 1) and ep (--enable-expert-parallel):
    tp8-pp4     -> TP 8 x PP 4: 32 cards, one replica, experts sliced over TP 8
    dp4-tp8-ep  -> DP 4 x TP 8 (EP 32): 32 cards, 4 replicas, 512 experts / 32 = 16 whole per card
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from tengyun.model_spec import as_spec
from tengyun.ops.plan import worst_stage
from tengyun.sizing.data_parallel import expert_split_problem
from tengyun.sizing.plan import Cards, Plan, make_plan
from tengyun.sizing.pp_layers import balanced_partition
from tengyun.sizing.resolve import ResolvedSizing

GiB = 2**30
_PART = re.compile(r"(tp|pp|dp)(\d+)|ep")


def parse_layout(text: str) -> dict[str, Any]:
    """'dp4-tp8-ep' -> {"dp": 4, "tp": 8, "pp": 1, "expert_parallel": True}; ValueError naming --compare."""
    layout: dict[str, Any] = {"dp": 1, "tp": 1, "pp": 1, "expert_parallel": False}
    for part in text.lower().split("-"):
        match = _PART.fullmatch(part)
        if match is None or (match[2] is not None and int(match[2]) < 1):
            raise ValueError(f"--compare {text!r}: each layout is dash-separated tpN, ppN, dpN and ep "
                             f"(e.g. tp8-pp4 or dp4-tp8-ep); {part!r} is none of them.")
        if match[1]:
            layout[match[1]] = int(match[2])
        else:
            layout["expert_parallel"] = True
    return layout


def layout_plans(config: Any, sizing: ResolvedSizing, layouts: list[str], cards: Cards | None = None,
                 checkpoint_bytes: int | None = None, name: str = "model", quant: Any = None) -> list[Plan]:
    """One Plan per layout: ``sizing`` with its tp, pp, dp and expert parallel replaced (the stages
    split as the engine would at that pp)."""
    spec, plans = as_spec(config), []
    for text in layouts:
        layout = parse_layout(text)
        if layout["expert_parallel"] and (problem := expert_split_problem(spec, layout["tp"], layout["dp"])):
            raise ValueError(f"--compare {text!r}: {problem}")
        layers = balanced_partition(spec, layout["pp"]) if layout["pp"] > 1 else None
        tried = dataclasses.replace(sizing, pp_layers=layers, **layout)
        plans.append(make_plan(spec, tried, cards, checkpoint_bytes, name, quant))
    return plans


def comparison_lines(plans: list[Plan], layouts: list[str], num_experts: int | None) -> list[str]:
    """A table, one column per layout: what each card holds, and what the cluster serves
    (``num_experts``: routed experts per MoE layer; None without)."""
    rows = [("layout", [_layout(p.sizing) for p in plans]),
            ("cards", [str(p.sizing.dp * p.sizing.tp * p.sizing.pp) for p in plans]),
            ("experts per card (per MoE layer)", [_experts(p, num_experts) for p in plans]),
            ("weights per card (worst stage)", [f"{worst_stage(p).weight_bytes / GiB:.2f} GiB" for p in plans]),
            ("KV budget per card", [f"{worst_stage(p).budget_bytes / GiB:.2f} GiB" for p in plans]),
            ("KV tokens per replica", [f"{p.cache_tokens:,}" for p in plans]),
            (f"sequences at {plans[0].max_model_len:,} tokens, per replica", [str(p.max_concurrency) for p in plans]),
            ("replicas", [str(p.sizing.dp) for p in plans]),
            ("sequences, all replicas", [f"{p.sizing.dp * p.max_concurrency:,}" for p in plans]),
            ("fits", ["yes" if p.fits else "no" for p in plans])]
    first = max(len(label) for label, _ in rows)
    widths = [max(len(layouts[i]), *(len(values[i]) for _, values in rows)) for i in range(len(plans))]
    header = " " * first + "  " + "  ".join(text.rjust(w) for text, w in zip(layouts, widths))
    return [header] + [label.ljust(first) + "  " + "  ".join(v.rjust(w) for v, w in zip(values, widths))
                       for label, values in rows]


def _layout(r: ResolvedSizing) -> str:
    ep = f" EP {r.expert_ranks}" if r.expert_parallel else ""
    return f"DP {r.dp} x TP {r.tp} x PP {r.pp}{ep}"


def _experts(plan: Plan, num_experts: int | None) -> str:
    r = plan.sizing
    if num_experts is None:
        return "-"
    return f"{num_experts // r.expert_ranks} whole" if r.expert_parallel else f"all {num_experts}, 1/{r.tp} of each"
