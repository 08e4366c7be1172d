"""vLLM's metric names: every `tengyun:X` family is exported again as `vllm:X`, with vLLM's
label names (model_name, engine), so dashboards and alerts written for vLLM read Tengyun as is.

The twins are made at scrape time from the same samples, so they can never disagree:

    tengyun:prompt_tokens_total{model_name="m"} 12   ->  vllm:prompt_tokens_total{engine="0",model_name="m"} 12

Names vLLM has deprecated are hidden, as vLLM hides them, unless
`--show-hidden-metrics-for-version X.Y` asks for the ones vLLM X.Y still exported:

    vllm:gpu_cache_usage_perc           = kv_cache_usage_perc          last exported by default in vLLM 0.10
    vllm:gpu_prefix_cache_queries/hits  = prefix_cache_queries/hits    last exported by default in vLLM 0.10
    vllm:time_per_output_token_seconds  = inter_token_latency_seconds  last exported by default in vLLM 0.11

so `--show-hidden-metrics-for-version 0.10` brings back all four and `0.11` the last one. (vLLM
itself accepts only the minor version before its own; this keeps its meaning for every version.)
"""

from __future__ import annotations

import argparse
import logging
import re
from typing import Iterable

from prometheus_client.metrics_core import Metric

logger = logging.getLogger(__name__)

VLLM_PREFIX = "vllm:"
ENGINE_LABEL = {"engine": "0"}  # vLLM labels each engine core; Tengyun runs one

# vllm name -> (the tengyun family it repeats, the last vLLM minor version that exported it by default)
HIDDEN = {
    "gpu_cache_usage_perc": ("kv_cache_usage_perc", (0, 10)),
    "gpu_prefix_cache_queries": ("prefix_cache_queries", (0, 10)),
    "gpu_prefix_cache_hits": ("prefix_cache_hits", (0, 10)),
    "time_per_output_token_seconds": ("inter_token_latency_seconds", (0, 11)),
}


def minor_version(value: str) -> tuple[int, int]:
    """'0.10' or '0.10.2' -> (0, 10): the argparse type of --show-hidden-metrics-for-version."""
    match = re.fullmatch(r"(\d+)\.(\d+)(\.\d+)?", value.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a vLLM version such as 0.10, got {value!r}")
    return int(match[1]), int(match[2])


def hidden_shown(version: tuple[int, int] | None) -> dict[str, str]:
    """The hidden vllm names vLLM `version` still exported: {vllm name: tengyun name}.
    None -> {}; (0, 10) -> all four; (0, 11) -> time_per_output_token_seconds alone."""
    if version is None:
        return {}
    return {name: source for name, (source, last) in HIDDEN.items() if version <= last}


class VllmMetrics:
    """A collector repeating tengyun families under vllm: names; register it in the same registry."""

    def __init__(self, families: dict, show_hidden_for: tuple[int, int] | None = None):
        # families: {short name: prometheus_client metric}, filled by EngineMetrics (read at scrape time).
        self.families = families
        self.hidden = hidden_shown(show_hidden_for)

    def collect(self) -> Iterable[Metric]:
        for name, family in self.families.items():
            yield from _renamed(family, VLLM_PREFIX + name)
        for name, source in self.hidden.items():
            yield from _renamed(self.families[source], VLLM_PREFIX + name,
                                f"Deprecated: use vllm:{source} (same values).")


def _renamed(family, name: str, documentation: str | None = None) -> Iterable[Metric]:
    """family's samples under `name` with engine="0" added:
    tengyun:inter_token_latency_seconds_bucket{le="0.1"} -> vllm:time_per_output_token_seconds_bucket{le="0.1"}."""
    for source in family.collect():
        metric = Metric(name, documentation or source.documentation, source.type, source.unit)
        metric.samples = [s._replace(name=name + s.name[len(source.name):], labels={**s.labels, **ENGINE_LABEL})
                          for s in source.samples]
        yield metric
