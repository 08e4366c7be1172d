"""ClientRouter: one engine loop serving N API processes (`--api-server-count N`), each over its
own pair of pipes, as run_engine_loop's ``receive`` and ``emit``.

    API process i --requests[i]--> receive(): ids tagged "i:<id>"      --> engine loop
    API process i <--results[i]--  emit(): each StepResult split by tag <-- engine loop

Invariants:
- Request ids are unique across API processes: the engine only ever sees "i:<id>", so two
  processes may both send "cmpl-1" (a client's own X-Request-Id, say). Aborts are tagged alike.
- Every client gets a StepResult after every step that changed anything: the outputs and
  rejections of its own requests, with its own ids back, and the engine's stats (so an idle
  API process's /health/detail shows the engine's load, not what it was at its last answer).
- Client 0 (the metrics owner) gets the progress of every request too (tagged ids): it alone
  records the engine's metrics for the whole server, so the counters count each token once.
  The others get no progress.
- A client that says Shutdown or whose pipe ends (its process is gone) leaves: its requests are
  aborted. The loop shuts down when every client has left.
Pure Python: no torch import.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from tengyun.engine.async_engine import AbortRequest, AddRequest, EngineDead, Shutdown, StepResult

METRICS_OWNER = 0  # the API process whose step listeners see every request's progress


def tag(client: int, request_id: str) -> str:
    """3, "cmpl-1" -> "3:cmpl-1"."""
    return f"{client}:{request_id}"


def untag(tagged: str) -> tuple[int, str]:
    """"3:cmpl-1" -> (3, "cmpl-1")."""
    client, request_id = tagged.split(":", 1)
    return int(client), request_id


class ClientRouter:
    def __init__(self, requests: list[Connection], send: Callable[[int, Any], None]):
        self._requests = requests  # index: client
        self._client_of = {id(conn): client for client, conn in enumerate(requests)}
        self._send = send  # send(client, message): one client's results pipe
        self._open = set(range(len(requests)))
        self._said_shutdown = False
        self._live: list[set[str]] = [set() for _ in requests]  # tagged ids not finished, per client
        self._pending: deque = deque()  # messages read but not yet handed to the loop

    def take(self, timeout: float) -> Any:
        """The next message from any client within ``timeout`` s (0: only one already there), None if
        none came; Shutdown once every client has left."""
        if not self._pending and self._open:
            for conn in wait([self._requests[c] for c in self._open], timeout):
                self._read(self._client_of[id(conn)])
        if self._pending:
            return self._pending.popleft()
        if not self._open and not self._said_shutdown:
            self._said_shutdown = True
            return Shutdown()
        return None

    def _read(self, client: int) -> None:
        try:
            message = self._requests[client].recv()
        except (EOFError, OSError):
            message = Shutdown()
        if isinstance(message, Shutdown):
            self._leave(client)
        elif isinstance(message, AddRequest):
            message.request_id = tag(client, message.request_id)
            self._live[client].add(message.request_id)
            self._pending.append(message)
        elif isinstance(message, AbortRequest):
            self._pending.append(AbortRequest([tag(client, rid) for rid in message.request_ids]))

    def _leave(self, client: int) -> None:
        self._open.discard(client)
        if self._live[client]:
            self._pending.append(AbortRequest(sorted(self._live[client])))

    def emit(self, message: StepResult | EngineDead) -> None:
        if isinstance(message, EngineDead):
            for client in range(len(self._requests)):
                self._send(client, message)
            return
        for client, part in self._split(message).items():
            if client in self._open:
                self._send(client, part)

    def _split(self, result: StepResult) -> dict[int, StepResult]:
        """One StepResult per open client; the metrics owner's with every request's progress."""
        parts = {client: StepResult([], result.stats) for client in self._open}
        parts[METRICS_OWNER] = StepResult([], result.stats, {}, result.progress)
        for output in result.outputs:
            client, request_id = untag(output.request_id)
            part = parts.setdefault(client, StepResult([], result.stats))
            part.outputs.append(dataclasses.replace(output, request_id=request_id))
        for tagged, error in result.rejected.items():
            client, request_id = untag(tagged)
            parts.setdefault(client, StepResult([], result.stats)).rejected[request_id] = error
            self._live[client].discard(tagged)
        for progress in result.progress:
            if progress.finished:
                self._live[untag(progress.request_id)[0]].discard(progress.request_id)
        return parts
