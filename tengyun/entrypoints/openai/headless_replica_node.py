"""`tengyun serve M --headless -dp 4 -dpl 2 -dpr 2 -dpa HEAD -dpp PORT`: a data-parallel node's
replicas (engine/headless_replicas.py, in the main thread) behind the headless node's app on
--host/--port (headless_server.py: the same routes, key rules and life as a --headless rank node):

    GET /health          200 while every replica of this node is linked to the API node, loaded and
                         alive; 503 naming the replica and why otherwise
    GET /health/detail   the same status code, with each replica's state and load, and the devices' sample
    GET /metrics         each replica's engine metrics (metrics.py) with engine="<its global index>",
                         as the API node labels its own; tengyun:replica_alive / replica_ready
                         {node, engine}; this process's process_*; tengyun:server_ready; the device gauges
    GET /version

The replicas' metrics count what their engine processes send the API node: each message is copied
to this process (headless_replicas.ResultsTee), where one EngineMetrics per replica reads it.

Life of the process:
    bind the port (503 "waiting for the API node") -> linked, loading (503 naming the replicas) ->
    all loaded (200) -> a replica exits or reports its engine dead: 503 naming it; the node stops its
    other replicas once their requests in flight have finished, then 503 for EXIT_LINGER_S, exit 1.
    The API node said Shutdown or went away: every replica stops, exit 0 (a supervisor starts the
    node again, to join the next API node). SIGTERM / SIGINT: the replicas are killed, exit 0.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from multiprocessing import Pipe
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import GaugeMetricFamily

from tengyun.config import EngineConfig
from tengyun.engine.async_engine import EngineDead, StepResult
from tengyun.engine.data_parallel_link import describe_replicas
from tengyun.engine.engine_process import EngineReady, EngineStartFailed, _exit_text
from tengyun.engine.headless_replicas import ReplicaObserver, run_headless_replicas
from tengyun.entrypoints.openai.data_parallel_metrics import EngineLabelled
from tengyun.entrypoints.openai.device_metrics import PREFIX, DeviceSampler
from tengyun.entrypoints.openai.headless_server import serve_headless
from tengyun.entrypoints.openai.metrics import EngineMetrics
from tengyun.entrypoints.openai.server_config import ServerConfig
from tengyun.platforms import platform_class
from tengyun.sizing.data_parallel import local_replicas, rpc_port


@dataclass(frozen=True)
class ReplicaState:
    index: int  # global: vLLM's engine index, the API node's engine label
    linked: bool = False  # welcomed by the API node
    pid: int | None = None  # its engine process's, once started
    ready: bool = False  # loaded (its EngineReady went to the API node)
    exit_code: int | None = None  # None while running (or not started)
    error: str | None = None  # what it reported before exiting: its engine loop died, or it failed to load
    running: int = 0  # its last step's requests
    waiting: int = 0

    def as_json(self) -> dict:
        state = "exited" if self.exit_code is not None else "dead" if self.error else "ready" if self.ready else \
            "loading" if self.pid else "linked" if self.linked else "connecting"
        return {"engine": str(self.index), "pid": self.pid, "state": state, "exit_code": self.exit_code,
                "error": self.error, "running": self.running, "waiting": self.waiting}


class ReplicaNode(ReplicaObserver):
    """This node's replicas as run_headless_replicas reports them (its main thread and one reader
    thread per replica), read by the app (uvicorn's thread): each ReplicaState is replaced whole."""

    def __init__(self, config: EngineConfig, vllm_aliases: bool = True,
                 show_hidden_for: tuple[int, int] | None = None):
        self.config = config
        self.indexes = local_replicas(config)
        self.replicas = {i: ReplicaState(i) for i in self.indexes}
        self.metrics = {i: EngineMetrics(config, CollectorRegistry(), vllm_aliases, show_hidden_for)
                        for i in self.indexes}
        self.api_node = f"{config.data_parallel_address}:{rpc_port(config)}"
        self.ended: str | None = None  # why run_headless_replicas returned non-zero, once it has
        self.deaths: list[int] = []  # replicas that exited unexpectedly or reported their engine dead, in order
        self._stop_read, self._stop_write = Pipe(duplex=False)
        self.stop_handle = self._stop_read

    @property
    def name(self) -> str:
        """'data-parallel node (replicas 2..3)'."""
        return f"data-parallel node ({describe_replicas(self.indexes)})"

    def request_stop(self) -> None:
        """From a signal handler: run_headless_replicas kills the replicas and returns 0."""
        self._stop_write.send_bytes(b"stop")

    # ----- ReplicaObserver ----------------------------------------------------------------
    def linked(self, index: int) -> None:
        self.replicas[index] = replace(self.replicas[index], linked=True)

    def started(self, index: int, pid: int) -> None:
        self.replicas[index] = replace(self.replicas[index], pid=pid)

    def message(self, index: int, message: Any) -> None:
        state, metrics = self.replicas[index], self.metrics[index]
        if isinstance(message, EngineReady):
            metrics.start_from(message.stats)
            state = replace(state, ready=True, pid=message.pid)
        elif isinstance(message, StepResult):
            metrics.on_step(message.progress, message.stats)
            state = replace(state, running=message.stats.num_running, waiting=message.stats.num_waiting)
        elif isinstance(message, EngineDead):
            state = replace(state, error=message.message)
        elif isinstance(message, EngineStartFailed):
            state = replace(state, error=f"its engine failed to start: {message.error}")
        self.replicas[index] = state
        if state.error and index not in self.deaths:
            self.deaths.append(index)

    def exited(self, index: int, pid: int, code: int) -> None:
        self.replicas[index] = replace(self.replicas[index], pid=pid, exit_code=code if code is not None else -1)
        if code != 0 and index not in self.deaths:
            self.deaths.append(index)

    def others_idle(self) -> bool:
        return all(s.running + s.waiting == 0 for s in self.replicas.values() if s.exit_code is None)

    # ----- what the app serves ------------------------------------------------------------
    def unavailable_reason(self) -> str | None:
        """Why /health answers 503; None while every replica is linked, loaded and alive."""
        states = list(self.replicas.values())
        if self.deaths:
            return self._failure(self.replicas[self.deaths[0]])
        if self.ended is not None:
            return self.ended
        if stopped := [s for s in states if s.exit_code == 0]:
            return (f"data-parallel replica {stopped[0].index} stopped: the API node at {self.api_node} said Shutdown "
                    f"or went away; this node exits.")
        if unlinked := [s.index for s in states if not s.linked]:
            return (f"waiting for the API node at {self.api_node} (--data-parallel-address, --data-parallel-rpc-port) "
                    f"to welcome data-parallel {describe_replicas(range(unlinked[0], unlinked[-1] + 1))}.")
        if loading := [s.index for s in states if not s.ready]:
            return f"data-parallel {describe_replicas(range(loading[0], loading[-1] + 1))} loading."
        return None

    def _failure(self, s: ReplicaState) -> str:
        """'data-parallel replica 2 (pid 5120) on this node exited unexpectedly (killed by SIGKILL: out
        of memory?); this node stops its other replicas once their requests in flight have finished.'"""
        what = (f"exited unexpectedly ({_exit_text(s.exit_code)})" if s.exit_code is not None else "died")
        cause = f": {s.error}" if s.error else ""
        return (f"data-parallel replica {s.index} (pid {s.pid}) on this node {what}{cause}; this node stops its "
                f"other replicas once their requests in flight have finished (see its log).")

    def health_json(self, sampler: DeviceSampler | None) -> dict:
        reason = self.unavailable_reason()
        sample = sampler.latest if sampler else None
        return {"status": "ok" if reason is None else "unavailable", "reason": reason, "headless": True,
                "api_node": self.api_node, "data_parallel": [s.as_json() for s in self.replicas.values()],
                "device_type": self.config.device_type, "node": sampler.node if sampler else None,
                **(sample.as_json() if sample is not None else {"devices": None, "links": None})}

    def collectors(self, hostname: str) -> list:
        return [ReplicaCollector(self, hostname), ProcessCollector(registry=None),
                EngineLabelled([self.metrics[i].registry for i in self.indexes], self.indexes)]

    def not_here(self) -> str:
        return (f"this node runs data-parallel {describe_replicas(self.indexes)} (--headless); send API requests "
                f"to the API node ({self.config.data_parallel_address}).")


class ReplicaCollector:
    """tengyun:replica_alive and tengyun:replica_ready{node, engine} at scrape time."""

    def __init__(self, node: ReplicaNode, hostname: str):
        self.node, self.hostname = node, hostname

    def describe(self):
        return []

    def collect(self):
        labels = ["node", "engine"]
        alive = GaugeMetricFamily(PREFIX + "replica_alive", "1 while the data-parallel replica's engine process runs "
                                  "(a --headless node's replicas, once started), 0 once it exited or reported its "
                                  "engine dead.",
                                  labels=labels)
        ready = GaugeMetricFamily(PREFIX + "replica_ready", "1 while the replica is linked to the API node, "
                                  "loaded and alive.", labels=labels)
        for s in [s for s in self.node.replicas.values() if s.pid is not None]:  # started: no alert while waiting
            running = s.exit_code is None and s.error is None
            alive.add_metric([self.hostname, str(s.index)], float(running))
            ready.add_metric([self.hostname, str(s.index)], float(running and s.ready and s.linked))
        yield alive
        yield ready


def run_headless_replica_node(config: EngineConfig, server: ServerConfig) -> int:
    """Serve the node's app in a thread while run_headless_replicas runs the replicas here."""
    node = ReplicaNode(config, vllm_aliases=not server.disable_vllm_metric_aliases,
                       show_hidden_for=server.show_hidden_metrics_for_version)
    fork_safe = platform_class(config.device_type).fork_safe
    return serve_headless(node, server, config.device_type, node.name,
                          lambda: run_headless_replicas(config, fork_safe, node))
