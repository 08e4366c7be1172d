"""One engine process shared by N API processes (`--api-server-count N`).

    supervisor (api_server_pool.py) --fork--> engine process: ClientRouter over N pipe pairs
                                    --fork--> API process i: SharedEngineClient(i) on pair i

SharedEngineLaunch forks the engine process with N (requests, results) pipe pairs and keeps the
API ends until each API process takes its own (``client(i)``); the supervisor then closes the
rest, so an API process that dies reads as end of file in the engine. The engine process is as
in engine_process.py (ignores SIGINT / SIGTERM, dies with the supervisor), except that it stops
when every API process has left (client_router.py), not when one has.

SharedEngineClient is EngineProcessClient without the process: the supervisor owns it. Its
shutdown() says Shutdown ("this API process leaves"), and client 0 alone calls its step
listeners (ClientRouter sends only it the progress). Pure Python: no torch import.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from multiprocessing import Pipe, get_context
from multiprocessing.connection import Connection
from typing import Any, Callable

from tengyun.engine.async_engine import EngineDead, Shutdown, StepListener, receive_messages, run_engine_loop
from tengyun.engine.client_router import METRICS_OWNER, ClientRouter
from tengyun.engine.engine_process import (
    EngineProcessClient, EngineReady, EngineStartFailed, _build_llm_engine, _die_with_parent, _send_result,
    portable_error,
)
from tengyun.tokenizer import class_path

logger = logging.getLogger(__name__)


@dataclass
class EnginePid:
    pid: int  # what EngineHost reads of the engine's process (its ProcessCollector)


@dataclass
class WarmUpRendezvous:
    """How N API processes start serving together: each counts itself in ``loaded`` once its
    tokenizer is loaded; process 0 waits for all N, warms the engine up, and sets ``warm``; the
    others wait for ``warm`` (within WARM_POLL_S of each other, all answer /health 200)."""

    size: int
    loaded: Any  # multiprocessing Value("i")
    warm: Any  # multiprocessing Event


class SharedEngineLaunch:
    """The forked engine process and the API ends of its N pipe pairs."""

    def __init__(self, config: Any, num_clients: int, build: Callable[[Any], Any] | None = None):
        pairs = [(Pipe(duplex=False), Pipe(duplex=False)) for _ in range(num_clients)]
        engine_ends = [(requests[0], results[1]) for requests, results in pairs]  # (read, write)
        self.api_ends = [(requests[1], results[0]) for requests, results in pairs]  # (write, read)
        self.config = config
        context = get_context("fork")
        self.rendezvous = WarmUpRendezvous(num_clients, context.Value("i", 0), context.Event())
        self.process = context.Process(
            target=_shared_engine_main, args=(build or _build_llm_engine, config, engine_ends, self.api_ends),
            name="tengyun-engine", daemon=False)  # not daemon: its executor may start rank processes
        self.process.start()
        for read, write in engine_ends:
            read.close()
            write.close()
        logger.info("Engine: in process %d for %d API server processes, loading", self.process.pid, num_clients)

    def client(self, index: int) -> "SharedEngineClient":
        """API process ``index``'s client; call in that process, after close_others(index)."""
        requests, results = self.api_ends[index]
        return SharedEngineClient(self.config, EnginePid(self.process.pid), requests, results, index,
                                  self.rendezvous)

    def close_others(self, keep: int | None = None) -> None:
        """Close the API ends this process holds except pair ``keep`` (None: all of them)."""
        for index, (requests, results) in enumerate(self.api_ends):
            if index != keep:
                requests.close()
                results.close()


class SharedEngineClient(EngineProcessClient):
    """API process ``index``'s side of the shared engine (see the module doc)."""

    def __init__(self, config: Any, process: EnginePid, requests: Connection, results: Connection, index: int,
                 rendezvous: WarmUpRendezvous):
        super().__init__(config, process, requests, results)
        self.index = index
        self.rendezvous = rendezvous

    def add_step_listener(self, listener: StepListener) -> None:
        if self.index == METRICS_OWNER:  # the others get no progress: their listeners would count stats twice
            super().add_step_listener(listener)

    def shutdown(self, timeout: float = 0.0) -> None:
        """Leave the engine (it aborts what this process still runs); the supervisor stops it."""
        self._stopping = True
        self._outbox.put(Shutdown())
        self._outbox.put(None)

    def wait_exit(self, timeout: float) -> int | None:
        return None  # not this process's child: the supervisor waits for it and logs its exit code

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None

    def _gone_report(self) -> EngineDead:
        return EngineDead("The engine process exited unexpectedly (the server's log names its exit code).")


def _shared_engine_main(build: Callable[[Any], Any], config: Any, engine_ends: list[tuple[Connection, Connection]],
                        api_ends: list[tuple[Connection, ...]]) -> None:
    for ends in api_ends:  # fork's copies of the API ends: only then does an API process's exit read as EOF
        for end in ends:
            end.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API processes drain; the supervisor stops this one
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    results = [write for _, write in engine_ends]
    try:
        engine = build(config)
    except BaseException as e:  # noqa: BLE001 - each API process reports it and exits 2 (config) or 1
        if not isinstance(e, ValueError):
            logger.exception("Loading the engine failed")
        for write in results:
            _send_result(write, EngineStartFailed(portable_error(e)))
        return
    ready = EngineReady(engine.get_stats(), os.getpid(), class_path(getattr(engine, "tokenizer", None)),
                        engine.memory_reports)
    for write in results:
        _send_result(write, ready)
    router = ClientRouter([read for read, _ in engine_ends], lambda client, message: _send_result(results[client],
                                                                                                   message))
    run_engine_loop(engine, lambda block: receive_messages(router.take, engine, block), router.emit)
