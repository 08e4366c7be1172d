"""DataParallelMetrics: --data-parallel-size N exports every engine metric once per replica, under
vLLM's `engine` label, tengyun: and vllm: names alike:

    tengyun:num_requests_running{engine="0",model_name="m"} 3.0
    tengyun:num_requests_running{engine="1",model_name="m"} 1.0
    vllm:num_requests_running{engine="0",model_name="m"} 3.0
    vllm:num_requests_running{engine="1",model_name="m"} 1.0

Each replica has an EngineMetrics of its own (its own registry, fed that replica's steps); one
collector in the server's registry repeats their samples with engine="<index>" set. The server's
process metrics and /health gauges are the server's, once. With one replica, EngineMetrics as it
is (tengyun: names carry model_name only; vllm: twins engine="0").
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.metrics_core import Metric

from tengyun.entrypoints.openai.metrics import EngineMetrics
from tengyun.outputs import RequestProgress


def engine_metrics(config: Any, vllm_aliases: bool = True, show_hidden_for: tuple[int, int] | None = None
                   ) -> "EngineMetrics | DataParallelMetrics":
    """The server's metrics: per replica under --data-parallel-size > 1, else EngineMetrics."""
    if config.data_parallel_size > 1:
        return DataParallelMetrics(config, vllm_aliases, show_hidden_for)
    return EngineMetrics(config, vllm_aliases=vllm_aliases, show_hidden_for=show_hidden_for)


class DataParallelMetrics:
    """EngineMetrics' interface (registry, start_from, on_step) over one EngineMetrics per replica;
    fed DataParallelStats (engine/data_parallel_stats.py): which replica stepped, and each one's stats."""

    def __init__(self, config: Any, vllm_aliases: bool = True, show_hidden_for: tuple[int, int] | None = None):
        self.config = config
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # this process's; the replicas' registries' copies are dropped
        self.engines = [EngineMetrics(config, CollectorRegistry(), vllm_aliases, show_hidden_for)
                        for _ in range(config.data_parallel_size)]
        self.registry.register(EngineLabelled([engine.registry for engine in self.engines]))

    def start_from(self, stats: Any) -> None:
        for engine, replica_stats in zip(self.engines, stats.replicas, strict=True):
            engine.start_from(replica_stats)

    def on_step(self, progress: list[RequestProgress], stats: Any) -> None:
        """The step of replica stats.engine_index: its progress records and its own stats."""
        self.engines[stats.engine_index].on_step(progress, stats.replicas[stats.engine_index])


class EngineLabelled:
    """A collector: the families of ``registries`` (one per replica, by index) merged by name, each
    sample labelled engine="<index>" (replacing the vllm: twins' engine="0"); process_* left out.
    ``indexes``: the replicas' global indexes where these are not 0..N-1 (a --headless node's
    replicas 2, 3: [2, 3])."""

    def __init__(self, registries: list[CollectorRegistry], indexes: Iterable[int] | None = None):
        self.registries = registries
        self.indexes = list(range(len(registries)) if indexes is None else indexes)

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for index, registry in zip(self.indexes, self.registries, strict=True):
            for family in registry.collect():
                if family.name.startswith("process_"):
                    continue
                target = merged.get(family.name)
                if target is None:
                    target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                target.samples += [s._replace(labels={**s.labels, "engine": str(index)}) for s in family.samples]
        return list(merged.values())
