"""The LLMEngine step loop fed and read from asyncio, with two transports.

    event loop (HTTP)                          engine loop (run_engine_loop)
    generate() --AddRequest/AbortRequest-->    applied between steps
    per-request asyncio.Queue <--StepResult--  once per step that changed something

AsyncLLMEngine runs the loop in a thread of this process; engine_process.EngineProcessClient
runs it in a child process (the server's default), so the model's threads never wait for the
HTTP side's GIL. Only small picklable messages cross the boundary, never shared engine
objects. Pure Python: no torch import.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from tengyun.outputs import RequestOutput, RequestProgress
from tengyun.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

HEALTH_CHECK_INTERVAL_S = 0.5  # while idle: how soon a dead worker process is noticed


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served any more."""


# ----- messages: event loop -> engine thread ---------------------------------------------
@dataclass
class AddRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    first_turn: int = 0
    lora_request: Any = None  # tengyun.lora.request.LoRARequest; None: the base model


@dataclass
class AbortRequest:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


@dataclass
class StartWave:
    """--data-parallel-size with --enable-expert-parallel: request ``wave`` reached some replica; step
    with the others (engine/data_parallel_wave.py)."""
    wave: int


# ----- messages: engine thread -> event loop ---------------------------------------------
@dataclass
class StepResult:
    outputs: list[RequestOutput]  # in each request's output kind
    stats: Any  # EngineStats after the step
    rejected: dict[str, Exception] = field(default_factory=dict)  # request_id -> add_request error
    progress: list[RequestProgress] = field(default_factory=list)  # every request the step changed
    # Requests whose outputs here left out prompt and prompt_token_ids in transit: the receiver has
    # them from the request's first output (engine/prompt_elision.py); empty within a process
    elided_prompts: frozenset[str] = frozenset()


@dataclass
class EngineDead:
    message: str


StepListener = Callable[[list[RequestProgress], Any], None]


def run_engine_loop(engine: Any, receive: Callable[[bool], list], emit: Callable[[Any], None]) -> None:
    """The engine side of either transport, until Shutdown: apply the messages ``receive(block)``
    returns (block: nothing to step, so wait for one), step while requests remain, ``emit`` a
    StepResult after every step that changed something; on any error emit EngineDead and stop."""
    try:
        while True:
            rejected: dict[str, Exception] = {}
            for message in receive(not engine.has_unfinished_requests()):
                if isinstance(message, Shutdown):
                    engine.shutdown()
                    return
                if isinstance(message, AbortRequest):
                    engine.abort_request(message.request_ids)
                elif isinstance(message, StartWave):
                    engine.start_wave(message.wave)
                else:
                    try:
                        engine.add_request(message.request_id, message.prompt, message.params,
                                           message.arrival_time, message.first_turn,
                                           lora_request=message.lora_request)
                    except Exception as e:  # bad input: that caller's error, nobody else's
                        rejected[message.request_id] = e
            outputs, progress = engine.step_with_progress() if engine.has_unfinished_requests() else ([], [])
            if progress or rejected:
                emit(StepResult(outputs, engine.get_stats(), rejected, progress))
    except BaseException as e:  # noqa: BLE001 - report any death, then stop
        logger.exception("Engine loop died")
        emit(EngineDead(f"The engine loop died: {type(e).__name__}: {e}"))
        engine.shutdown()


def receive_messages(take: Callable[[float], Any], engine: Any, block: bool) -> list:
    """The messages waiting for the engine loop, from ``take(timeout)`` (the next message within
    ``timeout`` s, 0: only one already there; None if none came). With ``block``, wait for one,
    checking every HEALTH_CHECK_INTERVAL_S that the executor's workers are alive (raises if not)."""
    messages = []
    while block and not messages:
        message = take(HEALTH_CHECK_INTERVAL_S)
        if message is None:
            engine.check_health()
        else:
            messages.append(message)
    while (message := take(0)) is not None:
        messages.append(message)
    return messages


class AsyncEngineBase:
    """The event-loop side both transports share: per-request streams, step listeners, death.
    A subclass delivers messages to the engine loop (``_send``) and feeds ``_dispatch`` with what
    the loop emits, on the event loop."""

    def __init__(self, config: Any, latest_stats: Any):
        self.config = config
        self._streams: dict[str, asyncio.Queue] = {}
        self._listeners: list[StepListener] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead_error: str | None = None
        self.latest_stats = latest_stats
        # "module:class" of the tokenizer the engine loaded, where it runs in another process
        # (tokenizer.get_tokenizer loads that class without importing torch); None: load as it does
        self.tokenizer_class: str | None = None
        # Each rank's memory once loaded (worker/memory_profile.py MemoryReport.as_json), this node's ranks
        self.memory_reports: list[dict] = []

    def _send(self, message: AddRequest | AbortRequest | Shutdown) -> None:
        raise NotImplementedError

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def add_step_listener(self, listener: StepListener) -> None:
        """Called on the event loop after every step with (progress, stats): metrics, logs. The
        progress covers every request the step changed, whatever its output kind."""
        self._listeners.append(listener)

    # ----- requests -----------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       arrival_time: float | None = None, first_turn: int = 0,
                       lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's RequestOutputs in params.output_kind (CUMULATIVE and DELTA: after
        every step that changed it), the last one finished. Raises add_request's ValueError for
        bad input, EngineDeadError if the loop died. Closing or cancelling the iterator early
        aborts the request (KV blocks freed)."""
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._send(AddRequest(request_id, prompt, params, arrival_time or time.time(), first_turn, lora_request))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, Exception):
                    finished = True  # rejected or dead: nothing left to abort
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if ids and self.dead_error is None:
            self._send(AbortRequest(ids))

    def abort_all(self) -> None:
        self.abort(list(self._streams))

    # ----- event loop side ----------------------------------------------------------------
    def _dispatch(self, message: StepResult | EngineDead) -> None:
        if isinstance(message, EngineDead):
            self.dead_error = message.message
            for stream in self._streams.values():
                stream.put_nowait(EngineDeadError(message.message))
            return
        for request_id, error in message.rejected.items():
            if request_id in self._streams:
                self._streams[request_id].put_nowait(error)
        for output in message.outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)
        self.latest_stats = message.stats
        for listener in self._listeners:
            try:
                listener(message.progress, message.stats)
            except Exception:  # a metrics bug must not break serving
                logger.exception("Step listener %r failed", listener)


class AsyncLLMEngine(AsyncEngineBase):
    """The engine loop in a thread of this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, tests)."""

    def __init__(self, engine: Any):
        super().__init__(engine.config, engine.get_stats())
        self.memory_reports = engine.memory_reports
        self.engine = engine  # touched only by the engine thread once start() ran
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, config: Any) -> "AsyncLLMEngine":
        from tengyun.engine.llm_engine import LLMEngine

        return cls(LLMEngine.from_config(config))

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will call generate()."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=run_engine_loop, args=(self.engine, self._receive, self._emit),
                                        name="tengyun-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(Shutdown())
            self._thread.join(timeout)

    @property
    def is_healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    def _send(self, message: AddRequest | AbortRequest | Shutdown) -> None:
        self._inbox.put(message)

    def _receive(self, block: bool) -> list:
        return receive_messages(self._take, self.engine, block)

    def _take(self, timeout: float) -> Any:
        try:
            return self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _emit(self, message: StepResult | EngineDead) -> None:
        try:
            self._loop.call_soon_threadsafe(self._dispatch, message)
        except RuntimeError:  # event loop closed: nobody is listening any more
            pass
