"""`tengyun serve M --headless -dp 4 -dpl 2 -dpr 2 -dpa HEAD -dpp PORT`: this node's
data-parallel replicas (2 and 3) for the API server on HEAD, with no API server here (vLLM's
headless data-parallel node).

    connect_replica(2), connect_replica(3)    each welcomed by the API node (data_parallel_link.py);
                                              a refusal (flags differ, ranges overlap) exits 2 here
    fork an engine process per replica        _engine_process_main over its socket: the same loop
                                              as behind the pipes, requests and results on one socket
    wait until every engine process exits     the API node said Shutdown, or went away (end of file
                                              reads as Shutdown); or one died: the node stops its
                                              others once they are idle, exit 1

This process forks the engine processes only after every replica was welcomed (one thread here,
so fork is safe), then closes its copies of the sockets: an engine process that dies closes its
connection, which the API node reads as that replica dead. The engine processes die with this
one (PR_SET_PDEATHSIG), so killing this process takes the node's replicas down with it.

A ReplicaObserver (this node's /health and /metrics, entrypoints/openai/headless_replica_node.py)
hears each replica's link, start and exit, and a copy of every message its engine process sends
the API node (ResultsTee: pickled once, written to the socket and to a pipe read here), so the
node counts its replicas' steps without a hop between them and the API node.
Pure Python: no torch import.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from functools import partial
from multiprocessing import Pipe, get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

from tengyun.engine.data_parallel_client import _build_replica, replica_environments
from tengyun.engine.data_parallel_link import connect_replica, describe_replicas
from tengyun.engine.engine_process import _engine_process_main, _exit_text
from tengyun.sizing.data_parallel import local_replicas, rpc_port

logger = logging.getLogger(__name__)
IDLE_POLL_S = 0.5  # after a replica died: how often the node asks whether the others are idle


class ReplicaObserver:
    """What run_headless_replicas tells this node's server; this base ignores everything and stops
    a node's other replicas at once after one died. ``stop_handle``: a Connection that turns
    readable when the node should stop (SIGTERM), watched with the engine processes."""

    stop_handle: Connection | None = None

    def linked(self, index: int) -> None: ...

    def started(self, index: int, pid: int) -> None: ...

    def message(self, index: int, message: Any) -> None:
        """A copy of what replica ``index``'s engine process sent the API node (EngineReady,
        StepResult, EngineDead, EngineStartFailed), on a reader thread of its own."""

    def exited(self, index: int, pid: int, code: int) -> None: ...

    def others_idle(self) -> bool:
        """After a replica died: whether the live ones have no requests left (then they are stopped)."""
        return True


class ResultsTee:
    """The engine process's results end: each message pickled once, to the API node's socket and
    to this node's copy pipe. A full or closed copy pipe never holds up the API node's copy: the
    node's reader drains it, and the node's exit kills the engine process anyway."""

    def __init__(self, remote: Connection, copy: Connection):
        self.remote, self.copy = remote, copy

    def send(self, message: Any) -> None:
        data = ForkingPickler.dumps(message)
        self.remote.send_bytes(data)  # raises OSError once the API node is gone (engine_process handles it)
        try:
            self.copy.send_bytes(data)
        except OSError:
            pass


def run_headless_replicas(config: Any, fork_safe: bool, observer: ReplicaObserver | None = None) -> int:
    """Serve this node's replicas until they all stop -> 0 when each exited cleanly (or
    ``observer.stop_handle`` turned readable: SIGTERM), 1 otherwise or when the API node never
    answered. Raises ValueError (exit 2) when the API node refuses this node."""
    observer = observer or ReplicaObserver()
    stop = observer.stop_handle
    indexes = local_replicas(config)
    envs = replica_environments(config, os.environ)
    node = uuid.uuid4().hex  # this launch, so the API node reserves the whole range for one node
    where = f"{config.data_parallel_address}:{rpc_port(config)}"
    logger.info("Data parallel: headless node for %s of %d, connecting to the API node at %s",
                describe_replicas(indexes), config.data_parallel_size, where)
    links = []
    try:
        for index in indexes:
            conn = connect_replica(config, index, node, config.distributed_timeout,
                                   stop=lambda: stop is not None and stop.poll())
            if conn is None:  # SIGTERM while waiting for the API node
                return 0
            links.append(conn)
            observer.linked(index)
    except ConnectionError as e:
        logger.error("%s", e)
        return 1
    finally:
        if len(links) < len(indexes):
            for conn in links:
                conn.close()
    method = "fork" if fork_safe else "spawn"
    processes, copies = _start_engine_processes(config, method, indexes, envs, links)
    for index, process in processes.items():
        observer.started(index, process.pid)
    for index, copy in copies.items():
        threading.Thread(target=_read_copies, args=(copy, index, observer), name=f"tengyun-replica-{index}-copy",
                         daemon=True).start()
    logger.info("Data parallel: %s in process(es) %s (%s), connected to %s", describe_replicas(indexes),
                ", ".join(str(p.pid) for p in processes.values()), method, where)
    return _wait_for_replicas(processes, observer)


def _start_engine_processes(config: Any, method: str, indexes: range, envs: list, links: list
                            ) -> tuple[dict[int, Any], dict[int, Connection]]:
    """Each replica's engine process over its welcomed connection -> (index -> process, index ->
    the read end of its copy pipe)."""
    processes, copies = {}, {}
    for index, env, conn in zip(indexes, envs, links):
        copy_read, copy_write = Pipe(duplex=False)
        # fork copies every open end: the child closes those of this node and its siblings, so a
        # sibling's exit still ends its own connection and copy pipe (spawn copies nothing)
        inherited = (copy_read, *copies.values(), *(c for c in links if c is not conn and not c.closed))
        process = get_context(method).Process(
            target=_engine_process_main,
            args=(partial(_build_replica, env), config, conn, ResultsTee(conn, copy_write),
                  inherited if method == "fork" else ()),
            name=f"tengyun-replica-{index}", daemon=False)  # not daemon: its executor may start rank processes
        process.start()
        conn.close()  # the engine process holds the only copy: its exit ends the connection
        copy_write.close()  # and the copy pipe: its exit ends the reader
        processes[index], copies[index] = process, copy_read
    return processes, copies


def _read_copies(copy: Connection, index: int, observer: ReplicaObserver) -> None:
    """Replica ``index``'s copied messages to the observer until its engine process exits."""
    while True:
        try:
            message = copy.recv()
        except (EOFError, OSError):
            return
        try:
            observer.message(index, message)
        except Exception:  # an observer's bug must not stop the reads: a full pipe would hold up the replica
            logger.exception("Data parallel: observing replica %d's message failed", index)


def _wait_for_replicas(processes: dict[int, Any], observer: ReplicaObserver) -> int:
    """Until every engine process has exited, logging each as it goes; once one died, until the
    others are idle (observer.others_idle), then they are killed: a node runs all of its replicas
    or none, so its supervisor restarts it whole."""
    by_sentinel = {process.sentinel: index for index, process in processes.items()}
    stop = [observer.stop_handle] if observer.stop_handle is not None else []
    clean = True
    try:
        while by_sentinel:
            ready = wait([*by_sentinel, *stop], None if clean else IDLE_POLL_S)
            if any(handle in stop for handle in ready) or (not clean and observer.others_idle()):
                _kill(processes)
                break
            for sentinel in [h for h in ready if h in by_sentinel]:
                index = by_sentinel.pop(sentinel)
                clean = _joined(index, processes[index], bool(by_sentinel), observer) and clean
    except KeyboardInterrupt:  # Ctrl-C (the engine processes ignore it): they go now, as with a lost node
        _kill(processes)
    return 0 if clean else 1


def _joined(index: int, process: Any, others_left: bool, observer: ReplicaObserver) -> bool:
    """Log replica ``index``'s engine process's exit -> whether it was clean."""
    process.join()
    observer.exited(index, process.pid, process.exitcode)
    if process.exitcode == 0:
        logger.info("Data parallel: replica %d stopped (the API node said Shutdown, or went away)", index)
        return True
    logger.error("Data parallel: replica %d's engine process (pid %d) exited unexpectedly (%s)%s", index, process.pid,
                 _exit_text(process.exitcode), "; this node stops its other replicas once their requests in flight "
                 "have finished" if others_left else "")
    return False


def _kill(processes: dict[int, Any]) -> None:
    """Every engine process now (else multiprocessing's exit handler would wait for them to stop by themselves)."""
    for process in processes.values():
        if process.exitcode is None:
            process.kill()
    for process in processes.values():
        process.join()
