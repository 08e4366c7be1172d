"""MultiprocExecutor: one process per rank (``--distributed-executor-backend mp``).

Every rank, rank 0 included, runs in its own process (rank_process.py says how it starts);
the engine process holds no model and imports no torch. The engine talks to rank 0 over a
pipe (worker_process.py says what crosses it). Each local rank also has its own pipe for
start-up and error reports, and its process sentinel is watched, so a rank that dies is
named at once:

    WorkerDiedError: worker rank 1 (pid 4242) exited with code -9 ...

A step with no answer within --distributed-timeout seconds is an error too, never a hang.
Ranks of other nodes (``--headless``) are started by `run_headless` there, which reports
each exit over the node link (node_link.py, --master-port + 1), watched in the same wait:

    WorkerDiedError: worker rank 3 (pid 4242) on node 1 exited with code -9 ...
    WorkerDiedError: node 1 (ranks 2, 3) lost its connection to the engine ...
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from tengyun.config import EngineConfig
from tengyun.distributed.rank_info import RankInfo, node_ranks
from tengyun.engine.messages import ModelRunnerOutput, SchedulerOutput
from tengyun.executor.node_link import (
    NodeLinkClient, NodeLinkServer, NodeLost, NodeObserver, RankExit, describe_ranks, link_port,
)
from tengyun.executor.rank_process import SpawnedRank, start_method, start_rank
from tengyun.executor.worker_process import EXECUTE, SHUTDOWN
from tengyun.platforms import Platform, platform_class

logger = logging.getLogger(__name__)

# torch.distributed's own timeout (rendezvous, collectives). Generous: ranks wait in the KV
# block count all-reduce for the slowest rank to load its weights. A step that hangs is caught
# sooner, by the engine's --distributed-timeout on its answer.
COLLECTIVE_TIMEOUT_S = 1800.0


class WorkerDiedError(RuntimeError):
    """A rank's process exited or reported an error; the message names the rank."""


@dataclass
class _Rank:
    rank: int
    process: SpawnedRank | multiprocessing.Process
    pipe: Connection  # engine side


def launch_node(config: EngineConfig, master_port: int) -> list[_Rank]:
    """Start this node's ranks (config.node_rank), each in its own process (rank_process.py:
    a fresh interpreter that never re-runs the user's script, or fork when asked for)."""
    platform = platform_class(config.device_type)
    method = start_method(platform.fork_safe)
    ranks = node_ranks(config.world_size, config.nnodes, config.node_rank)
    threads = _threads_per_rank(platform, len(ranks) * local_replicas(config))
    logger.info("Starting ranks %s with %s", list(ranks), method)
    started = []
    for local_rank, rank in enumerate(ranks):
        info = RankInfo(rank, local_rank, config.world_size, config.tensor_parallel_size,
                        config.pipeline_parallel_size, f"tcp://{config.master_addr}:{master_port}",
                        max(config.distributed_timeout, COLLECTIVE_TIMEOUT_S),
                        expert_parallel=config.enable_expert_parallel)
        process, pipe = start_rank(method, config, info, threads, name=f"tengyun-rank{rank}")
        started.append(_Rank(rank, process, pipe))
    return started


class MultiprocExecutor:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.timeout = config.distributed_timeout
        port = config.master_port or _free_port(config.master_addr)
        logger.info("Starting %d worker process(es) on this node (tp %d x pp %d over %d node(s), rendezvous %s:%d)",
                    config.world_size // config.nnodes, config.tensor_parallel_size,
                    config.pipeline_parallel_size, config.nnodes, config.master_addr, port)
        self._inbox: dict[int, list[tuple]] = {}
        # Before the ranks start: a headless node launches its ranks only once welcomed here.
        self.link = NodeLinkServer(link_port(port), config.nnodes, config.world_size) if config.nnodes > 1 else None
        self.ranks = launch_node(config, port)
        self._driver = self.ranks[0]
        try:
            infos = [self._receive(r, timeout=None, expect="ready") for r in self.ranks]
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = infos[0]["num_blocks"]  # already the minimum over all ranks
        self.num_state_slots = infos[0]["num_state_slots"]  # likewise (0: no linear-attention layers)
        self.num_state_snapshots = infos[0]["num_state_snapshots"]  # likewise (0 also: prefix caching off)
        self.weight_bytes = {r.rank: info["weight_bytes"] for r, info in zip(self.ranks, infos)}
        self.memory_reports = [info["memory"] for info in infos]  # this node's ranks
        for r, info in zip(self.ranks, infos):
            logger.info("rank %d (pid %d) holds %.2f MiB of weights", r.rank, info["pid"],
                        info["weight_bytes"] / 2**20)

    # ----- the Executor interface -----------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(sched)
        return self.next_result()

    def submit(self, sched: SchedulerOutput) -> None:
        """Start a step without waiting for it: with pipeline parallel, stage 0 takes the next
        batch while later stages still run earlier ones (worker_process.py)."""
        self._send(self._driver, (EXECUTE, sched))

    def next_result(self) -> ModelRunnerOutput:
        """The result of the oldest submitted step not yet returned (steps come back in order)."""
        return self._receive(self._driver, timeout=self.timeout, expect="result")

    def check_health(self) -> None:
        """Raise WorkerDiedError if any rank's process has exited, here or on another node
        (called while idle too)."""
        if self.link is not None and (events := self.link.poll()):
            raise self._remote_died(events[0])
        for r in self.ranks:
            if not r.process.is_alive():
                raise self._local_exit(r)

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._driver.process.is_alive():
            try:
                self._driver.pipe.send((SHUTDOWN,))
            except (BrokenPipeError, OSError):
                pass
        for r in self.ranks:
            r.process.join(timeout)
            if r.process.is_alive():
                r.process.terminate()
                r.process.join(timeout)
        if self.link is not None:
            self.link.close()

    # ----- pipes and sentinels --------------------------------------------------------------
    def _send(self, r: _Rank, message: tuple) -> None:
        try:
            r.pipe.send(message)
        except (BrokenPipeError, OSError):
            raise self._died(r) from None

    def _receive(self, r: _Rank, timeout: float | None, expect: str):
        """The next message from rank ``r``, while watching every local rank's pipe and process;
        other ranks' messages (their "ready") wait in ``_inbox`` for their turn."""
        if self._inbox.get(r.rank):
            return self._payload(self._inbox[r.rank].pop(0))
        watched = {x.pipe: x for x in self.ranks} | {x.process.sentinel: x for x in self.ranks}
        while True:
            ready = wait(list(watched) + self._link_handles(), timeout)
            if not ready:
                raise WorkerDiedError(
                    f"no {expect} from the workers within --distributed-timeout {self.timeout:g} s "
                    f"(a rank is stuck, or the network to another node is cut); raise --distributed-timeout "
                    f"if steps are legitimately this slow."
                )
            # Deaths first (other nodes' reports, then local sentinels): errors are their consequence.
            if events := self._link_events(ready):
                raise self._remote_died(events[0])
            local = [h for h in ready if h in watched]
            for handle in sorted(local, key=lambda h: h is watched[h].pipe):
                source = watched[handle]
                if handle is not source.pipe:
                    raise self._local_exit(source)
                try:
                    message = source.pipe.recv()
                except (EOFError, OSError):
                    raise self._died(source) from None
                if message[0] == "error":
                    raise self._failure(message)
                if source is r:
                    return self._payload(message)
                self._inbox.setdefault(source.rank, []).append(message)

    @staticmethod
    def _payload(message: tuple):
        return message[1] if message[0] == "result" else message[2]

    def _failure(self, message: tuple) -> Exception:
        """A rank's ("error", rank, text, is_config_error) report as the exception to raise."""
        _, rank, text, is_config_error = message
        if is_config_error:  # e.g. the KV cache is too small: name the flag, exit 2
            return ValueError(text)
        # A peer's death makes the reporting rank's collective fail (and the reporter may
        # exit too): name the other rank that died, here or on another node, if one did.
        dead = self._first_dead(grace_s=1.0, besides=rank)
        if isinstance(dead, _Rank):
            return self._died(dead, f"; rank {rank} then failed: {text}")
        if dead is not None:
            return self._remote_died(dead, f"; rank {rank} then failed: {text}")
        return WorkerDiedError(f"worker rank {rank} failed: {text}")

    def _local_exit(self, r: _Rank) -> Exception:
        """A local rank's process ended: if it reported an error on the way out (a collective
        failed under it), that report names the cause; otherwise its own death is the cause."""
        try:
            message = r.pipe.recv() if r.pipe.poll() else None
        except (EOFError, OSError):
            message = None
        if message is not None and message[0] == "error":
            return self._failure(message)
        return self._died(r)

    def _first_dead(self, grace_s: float, besides: int) -> _Rank | RankExit | NodeLost | None:
        """The first rank other than ``besides`` whose process has exited (another node's
        report first), or a node whose link dropped, waiting up to ``grace_s`` for one."""
        others = [r for r in self.ranks if r.rank != besides]
        deadline = time.monotonic() + grace_s
        while True:
            ready = wait([r.process.sentinel for r in others] + self._link_handles(),
                         max(0.0, deadline - time.monotonic()))
            if events := self._link_events(ready):
                return events[0]
            dead = next((r for r in others if not r.process.is_alive()), None)
            if dead is not None or time.monotonic() >= deadline:
                return dead

    # ----- the node link (other nodes' ranks) ----------------------------------------------
    def _link_handles(self) -> list:
        return self.link.handles() if self.link is not None else []

    def _link_events(self, ready: list) -> list[RankExit | NodeLost]:
        """Read the ready link handles (accepting connections, welcoming nodes)."""
        events = []
        for handle in ready:
            if self.link is not None and self.link.owns(handle):
                events += self.link.read(handle)
        return events

    def _remote_died(self, event: RankExit | NodeLost, detail: str = "") -> WorkerDiedError:
        if isinstance(event, RankExit):
            return WorkerDiedError(
                f"worker rank {event.rank} (pid {event.pid}) on node {event.node} exited with code "
                f"{event.code}{detail}; the engine cannot continue (see the rank{event.rank} log lines "
                f"on node {event.node})."
            )
        return WorkerDiedError(
            f"node {event.node} ({describe_ranks(event.ranks)}) lost its connection to the engine{detail}: "
            f"its --headless launcher or the whole host is gone, or the network between the nodes broke; "
            f"the engine cannot continue (see node {event.node}'s log)."
        )

    def _died(self, r: _Rank, detail: str = "") -> WorkerDiedError:
        r.process.join(0.5)
        code = r.process.exitcode
        how = "is not responding" if code is None else f"exited with code {code}"
        return WorkerDiedError(
            f"worker rank {r.rank} (pid {r.process.pid}) {how}{detail}; the engine cannot continue "
            f"(see the rank{r.rank} log lines above)."
        )


def run_headless(config: EngineConfig, observer: NodeObserver | None = None) -> int:
    """--headless: join node 0's engine over the node link, start this node's ranks, report
    each one's joining and exit (to node 0 and to ``observer``, this node's /health); exit
    non-zero as soon as one fails or node 0's engine closes the link, 0 when every rank ended
    cleanly or ``observer.stop_handle`` turned readable (SIGTERM: the ranks are terminated)."""
    observer = observer or NodeObserver()
    stop = [observer.stop_handle] if observer.stop_handle is not None else []
    ours = list(node_ranks(config.world_size, config.nnodes, config.node_rank))
    try:
        link = NodeLinkClient.connect(config.master_addr, config.master_port, config.node_rank, ours,
                                      within_s=config.distributed_timeout, stop=lambda: bool(wait(stop, 0)))
    except ConnectionError as e:
        logger.error("%s", e)
        return 1
    except ValueError as e:  # node 0 expects other ranks from this node: the flags differ
        logger.error("%s", e)
        return 2
    if link is None:
        return 0
    observer.linked()
    ranks = launch_node(config, config.master_port)
    logger.info("Headless node %d: ranks %s (pids %s) joining %s:%d", config.node_rank, [r.rank for r in ranks],
                [r.process.pid for r in ranks], config.master_addr, config.master_port)
    for r in ranks:
        observer.rank_started(r.rank, r.process.pid)
    code = _watch_ranks(config, link, ranks, observer, stop)
    link.close()
    return code


def _watch_ranks(config: EngineConfig, link: NodeLinkClient, ranks: list, observer: NodeObserver, stop: list) -> int:
    """Until this node's ranks have all ended: report each one's joining and exit (to node 0 and
    ``observer``); on a failed rank, a readable ``stop`` handle (SIGTERM) or node 0's engine gone
    for 5 s, terminate the rest. -> the node's exit code (1: a rank failed or node 0 went; 0 else)."""
    code, joined, grace_until = 0, set(), None
    pending = {r.process.sentinel: r for r in ranks}
    pipes = {r.pipe: r for r in ranks}  # ("ready", ...) once a rank joined the world; EOF when it exits
    while pending:
        timeout = None if grace_until is None else max(0.0, grace_until - time.monotonic())
        ready = wait([*pending, *pipes, *([link.sock] if grace_until is None else []), *stop], timeout)
        _read_joins([h for h in ready if h in pipes], pipes, joined, len(ranks), link, observer)
        exited = [pending.pop(h) for h in ready if h in pending]
        for r in exited:
            r.process.join()
        for r in sorted(exited, key=lambda r: r.process.exitcode >= 0):  # killed by a signal first
            link.report_exit(r.rank, r.process.pid, r.process.exitcode)
            observer.rank_exited(r.rank, r.process.pid, r.process.exitcode)
            if r.process.exitcode != 0:
                logger.error("worker rank %d (pid %d) exited with code %s", r.rank, r.process.pid, r.process.exitcode)
                code = 1
        if link.sock in ready and link.engine_gone():  # a clean shutdown ends the ranks too: give them 5 s
            logger.warning("node 0's engine at %s closed the node link or stopped answering on it (node 0 stopped, or "
                           "the network between the nodes broke): stopping this node's ranks within 5 s",
                           config.master_addr)
            grace_until = time.monotonic() + 5.0
        stopping = any(h in stop for h in ready)
        if code or stopping or (grace_until is not None and time.monotonic() >= grace_until and pending):
            code = code or (0 if stopping else 1)
            for r in pending.values():
                r.process.terminate()
            for r in pending.values():
                r.process.join(10.0)
                observer.rank_exited(r.rank, r.process.pid, r.process.exitcode)
            break
    return code


def _read_joins(handles: list, pipes: dict, joined: set, num_ranks: int, link: NodeLinkClient,
                observer: NodeObserver) -> None:
    """Each rank's pipe says ("ready", ...) once it joined the world, then EOF when it exits; the
    last one to join is reported to node 0 with them all."""
    for handle in handles:
        try:
            message = handle.recv()
        except (EOFError, OSError):
            pipes.pop(handle)
            continue
        if message[0] == "ready":
            joined.add(pipes[handle].rank)
            observer.rank_joined(pipes[handle].rank, message[2].get("memory"))
            if len(joined) == num_ranks:
                link.report_joined(sorted(joined))


def local_replicas(config: EngineConfig) -> int:
    """Engine replicas on this node (--data-parallel-size-local, else --data-parallel-size): their
    ranks share the node's cores."""
    return config.data_parallel_size_local or config.data_parallel_size


def _threads_per_rank(platform: type[Platform], local_ranks: int) -> int:
    """CPU: split the cores between this node's ranks (all replicas' under --data-parallel-size)
    unless OMP_NUM_THREADS says otherwise (0 = leave torch's default). 4 ranks on 16 cores -> 4 threads each."""
    if not platform.ranks_share_host_cores or os.environ.get("OMP_NUM_THREADS"):
        return 0
    return max(1, (os.cpu_count() or 1) // local_ranks)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
