"""tengyun:expert_load_tokens_total{model_name, layer, expert} (--enable-expert-load-metrics):
tokens routed to each expert of each MoE layer since the server started serving.

A collector, not a Counter incremented per step: the engine keeps the totals (EngineStats.expert_load,
summed from each step's nonzero counts), and the series are built from the latest totals only when
/metrics is read, so a step costs no per-expert work here. Experts never routed to have no series.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client.core import CounterMetricFamily

NAME = "tengyun:expert_load_tokens"
DOC = ("Tokens routed to each expert of each MoE layer (a token counts once per expert of its top k), "
       "by layer index and expert id.")


class ExpertLoadCollector:
    """``totals()`` -> ({(layer, expert): tokens} now, the same at start, counted before serving)."""

    def __init__(self, model_name: str, totals: Callable[[], tuple[dict | None, dict | None]]):
        self.model_name = model_name
        self.totals = totals

    def collect(self):
        family = CounterMetricFamily(NAME, DOC, labels=["model_name", "layer", "expert"])
        now, start = self.totals()
        start = start or {}
        for (layer, expert), tokens in sorted((now or {}).items()):
            counted = tokens - start.get((layer, expert), 0)
            if counted > 0:
                family.add_metric([self.model_name, str(layer), str(expert)], counted)
        yield family

    def describe(self):
        yield CounterMetricFamily(NAME, DOC, labels=["model_name", "layer", "expert"])
