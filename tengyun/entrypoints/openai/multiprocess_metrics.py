"""/metrics of N API processes as one server (`--api-server-count N`): Prometheus multiprocess mode.

    every API process: its metric objects write their values to files in PROMETHEUS_MULTIPROC_DIR
    any API process's /metrics: MergedMetrics reads all the files (counters and histograms summed;
                                gauges per their multiprocess_mode), adds the vllm: twins of the merged
                                families and the collectors that are no files (engine process_*,
                                device gauges), and leaves out its own process_*

Who writes what: API process 0 (ClientRouter.METRICS_OWNER) records every engine metric, from the
progress and stats of every step; the others record their own HTTP responses and
tengyun:server_ready. So a token is counted once, and the engine gauges (mode mostrecent: the
latest set wins, and only process 0 sets them) come from one source. server_ready is livemin:
1 only while every live API process answers /health 200.

The mode must be on before the first metric object exists: enable_multiprocess_metrics() runs in
the supervisor before it forks the API processes.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Iterable

from prometheus_client import CollectorRegistry, ProcessCollector, multiprocess, values
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from tengyun.entrypoints.openai.metrics import PREFIX, EngineMetrics
from tengyun.entrypoints.openai.vllm_metrics import VllmMetrics

logger = logging.getLogger("tengyun.server")
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def enable_multiprocess_metrics() -> str | None:
    """Turn multiprocess mode on for the metric objects made from now on, in this process and the
    ones it forks. Returns the directory made for it (remove it at exit), or None when the user
    set PROMETHEUS_MULTIPROC_DIR (theirs to wipe between runs, as vLLM says)."""
    made = None
    if os.environ.get(MULTIPROC_ENV):
        logger.warning("%s=%s is set: its files are read as this server's metrics; wipe the directory "
                       "between runs or /metrics counts the old ones too (unset it and Tengyun makes and "
                       "removes its own).", MULTIPROC_ENV, os.environ[MULTIPROC_ENV])
    else:
        made = tempfile.mkdtemp(prefix="tengyun-metrics-")
        os.environ[MULTIPROC_ENV] = made
    values.ValueClass = values.get_value_class()  # prometheus_client chose at import; choose again
    return made


def remove_metrics_dir(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


def mark_process_dead(pid: int) -> None:
    """Drop a gone API process's live* gauges (tengyun:server_ready)."""
    multiprocess.mark_process_dead(pid)


class _Merged:
    """One merged family, read by VllmMetrics as it reads a live metric object."""

    def __init__(self, metric: Metric):
        self.metric = metric

    def collect(self) -> list[Metric]:
        return [self.metric]


class MergedMetrics:
    """A collector: the whole server's metrics (see the module doc) for this API process's /metrics."""

    def __init__(self, metrics: EngineMetrics, vllm_aliases: bool, show_hidden_for: tuple[int, int] | None):
        self.local = metrics.registry  # this process's metric objects and its other collectors
        self.short_names = metrics.families  # short name -> family: which families get vllm: twins
        self.vllm_aliases = vllm_aliases
        self.show_hidden_for = show_hidden_for
        self.files = multiprocess.MultiProcessCollector(None)

    def collect(self) -> Iterable[Metric]:
        merged = list(self.files.collect())
        yield from merged
        if self.vllm_aliases:
            by_name = {metric.name: metric for metric in merged}
            families = {short: _Merged(by_name[PREFIX + short]) for short in self.short_names
                        if PREFIX + short in by_name}
            yield from VllmMetrics(families, self.show_hidden_for).collect()
        for collector in list(self.local._collector_to_names):  # noqa: SLF001 - the registry lists no other way
            if isinstance(collector, (MetricWrapperBase, VllmMetrics)):
                continue  # in the files (merged above), or made from them
            if isinstance(collector, ProcessCollector) and collector._prefix == "process_":  # noqa: SLF001
                continue  # this API process's own: which one answers a scrape is chance
            yield from collector.collect()


def merged_registry(metrics: EngineMetrics, vllm_aliases: bool,
                    show_hidden_for: tuple[int, int] | None) -> CollectorRegistry:
    """What /metrics serves in one API process of several."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MergedMetrics(metrics, vllm_aliases, show_hidden_for))
    return registry
