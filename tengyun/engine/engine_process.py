"""EngineProcessClient: the engine loop in a child process, the API server's default.

    API process (asyncio)                                engine process (its main thread)
    generate() -> sender thread --requests pipe-->       run_engine_loop: reads between steps
    _dispatch  <- event loop    <--results pipe--        one StepResult per step

In one process the model's step loop and the HTTP event loop take turns on the GIL: every
torch op releases it and must win it back, and while the event loop parses a request or
writes a chunk the step waits (up to the 5 ms switch interval each time). vLLM runs its
engine core in its own process for the same reason. Here the engine process is forked before
the HTTP server binds its port or starts a thread, from a process that has not touched a
device, so it shares nothing with the server but two pipes:

- requests (API -> engine): AddRequest, AbortRequest, Shutdown. A sender thread writes them,
  so a long prompt never blocks the event loop while the engine is mid-step.
- results (engine -> API): EngineReady or EngineStartFailed once, then StepResult per step
  and EngineDead. The event loop reads them itself when the pipe is readable (add_reader), not
  through a reader thread: a thread that hands each one over is a second wake-up, and while the
  engine's threads hold both cores of a small machine each wake-up can wait a scheduler slice
  (~3-4 ms seen on 2 cores, before a stream's first token went out).

The engine process ignores SIGINT and SIGTERM: the API process decides when it stops (after a
drain, with Shutdown), and it exits by itself when the API process is gone (end of file on
the requests pipe, or a changed parent). Pure Python: no torch import.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
from dataclasses import dataclass, field
from multiprocessing import Pipe, get_context
from multiprocessing.connection import Connection
from typing import Any, Callable

from tengyun.tokenizer import class_path
from tengyun.engine.async_engine import (
    AbortRequest, AddRequest, AsyncEngineBase, EngineDead, Shutdown, StepResult, receive_messages, run_engine_loop,
)
from tengyun.engine.prompt_elision import PromptKeeper, PromptSender

logger = logging.getLogger(__name__)

MULTIPROCESSING_ENVS = ("TENGYUN_ENABLE_MULTIPROCESSING", "VLLM_ENABLE_V1_MULTIPROCESSING")  # first set wins
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
SHUTDOWN_GRACE_S = 10.0  # after Shutdown: how long the engine process may take before it is killed


@dataclass
class EngineReady:
    stats: Any  # EngineStats of the loaded, idle engine
    pid: int
    tokenizer_class: str | None = None  # tokenizer.class_path of the engine's tokenizer
    memory_reports: list = field(default_factory=list)  # LLMEngine.memory_reports


class EngineGone(EngineDead):
    """EngineDead read from the end of the results pipe (or a remote replica's connection): the
    engine process, or its node, went without a word. A cause, never the consequence of another
    engine's failure (that one's loop reports itself first, as EngineDead)."""


@dataclass
class EngineStartFailed:
    error: BaseException  # what building the engine raised (a ValueError names the flag to change)


def engine_in_thread_reason(fork_safe: bool, disable_frontend_multiprocessing: bool = False,
                            fork: bool = True) -> str | None:
    """Why the server should run the engine loop in a thread of its own process, or None for a
    child process: the flag or the environment asks for it, or (``fork``: the child would be
    forked) the device runtime cannot be forked or other threads run."""
    if disable_frontend_multiprocessing:
        return "--disable-frontend-multiprocessing"
    name, value = next(((n, os.environ[n]) for n in MULTIPROCESSING_ENVS if os.environ.get(n)), (None, "1"))
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1; got {value!r}.")
    if value == "0":
        return f"{name}=0"
    if not fork:
        return None
    if not fork_safe:
        return "this device's runtime is not known to survive fork"
    if threading.active_count() > 1:  # Python threads; torch's import leaves an idle native one
        return f"{threading.active_count()} threads are running, and fork copies a lock another thread holds as held"
    return None


def launch_for_server(config: Any, fork_safe: bool, disable_frontend_multiprocessing: bool
                      ) -> "EngineProcessClient | None":
    """The server's engine process, forked now (it loads the model while the server starts), or
    None where the engine runs in a thread of the server process; logs which and why. Call while
    the server process still has one thread."""
    reason = engine_in_thread_reason(fork_safe, disable_frontend_multiprocessing)
    if getattr(config, "data_parallel_size", 1) > 1:  # replicas, each in an engine process of its own
        from tengyun.engine.data_parallel_client import launch_replicas

        refused = engine_in_thread_reason(fork_safe, disable_frontend_multiprocessing, fork=False)
        return launch_replicas(config, refused, "fork" if reason is None else "spawn")
    if reason is not None:
        logger.info("Engine: in a thread of the server process (%s)", reason)
        return None
    return EngineProcessClient.launch(config)


class EngineProcessClient(AsyncEngineBase):
    """AsyncLLMEngine's interface over an engine loop in a child process (see the module doc)."""

    @classmethod
    def launch(cls, config: Any, build: Callable[[Any], Any] | None = None,
               method: str = "fork") -> "EngineProcessClient":
        """Fork the engine process, which builds ``build(config)`` (LLMEngine.from_config) and
        serves it. Call while this process has one thread; start() and wait_ready() follow.
        ``method`` "spawn": a fresh interpreter instead (data-parallel replicas on a device whose
        runtime does not survive fork; ``build`` must then pickle)."""
        requests_out, requests_in = Pipe(duplex=False)
        results_out, results_in = Pipe(duplex=False)
        process = get_context(method).Process(
            target=_engine_process_main,
            args=(build or _build_llm_engine, config, requests_out, results_in, (requests_in, results_out)),
            name="tengyun-engine", daemon=False)  # not daemon: its executor may start rank processes
        process.start()
        requests_out.close()
        results_in.close()
        logger.info("Engine: in process %d, loading there while the HTTP server starts here", process.pid)
        return cls(config, process, requests_in, results_out)

    def __init__(self, config: Any, process: Any, requests: Connection, results: Connection):
        super().__init__(config, latest_stats=None)
        self.process = process
        self._requests = requests  # written by the sender thread only
        self._results = results  # read on the event loop only (_read_ready)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ready: asyncio.Future | None = None
        self._loaded = False  # EngineReady arrived
        self._stopping = False  # shutdown() ran: the end of the results pipe is expected
        # multiprocessing's join is not thread-safe: of two threads waiting, one reaps the child
        # and the other sees no exit code. _gone_report (on a thread) and shutdown() both wait.
        self._process_lock = threading.Lock()
        self.start_error: BaseException | None = None  # what loading raised there (its traceback is logged there)
        self.gone = False  # its death was EngineGone: the process (or connection) ended, not the loop
        self._prompts = PromptKeeper()  # prompts the engine sends once per request (prompt_elision.py)

    # ----- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the sender thread and the results reader; call from the event loop that will call
        generate()."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        threading.Thread(target=self._send_forever, name="tengyun-engine-send", daemon=True).start()
        self._loop.add_reader(self._results.fileno(), self._read_ready)

    async def wait_ready(self) -> None:
        """Until the engine process has loaded the model; raises what loading raised."""
        await asyncio.shield(self._ready)

    def shutdown(self, timeout: float = SHUTDOWN_GRACE_S) -> None:
        """Ask the engine process to stop, wait up to ``timeout`` s, then kill it. One still loading
        is killed at once: it reads no message until loaded, and has nothing to finish."""
        self._stopping = True
        if self.wait_exit(0) is None:
            self._outbox.put(Shutdown())
            exiting = self._loaded or self.start_error is not None  # a failed start exits by itself
            if self.wait_exit(timeout if exiting else 0) is None:
                if exiting:
                    logger.warning("The engine process did not stop within %.0f s: killing it", timeout)
                else:
                    logger.info("Stopping the engine process while it loads (SIGKILL)")
                self.process.kill()
                self.wait_exit(5.0)
        self._outbox.put(None)  # stops the sender thread

    def wait_exit(self, timeout: float) -> int | None:
        """The engine process's exit code once it has exited within ``timeout`` s, else None."""
        with self._process_lock:
            self.process.join(timeout)
            return self.process.exitcode

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and self.wait_exit(0) is None

    # ----- transport ----------------------------------------------------------------------
    def _send(self, message: AddRequest | AbortRequest | Shutdown) -> None:
        self._outbox.put(message)

    def _send_forever(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._requests.send(message)
            except (OSError, ValueError):  # the engine process is gone: the reader reports it
                return

    def _read_ready(self) -> None:
        """On the event loop, when the results pipe is readable: every message waiting there. The
        engine writes a message whole, so a recv that finds its start finds the rest promptly."""
        try:
            while True:
                self._on_message(self._results.recv())
                if not self._results.poll():
                    return
        except (EOFError, OSError):
            self._loop.remove_reader(self._results.fileno())
            if not self._stopping:  # the report may wait seconds for the exit code: not on the loop
                threading.Thread(target=lambda: self._post(self._gone_report()), name="tengyun-engine-gone",
                                 daemon=True).start()

    def _read_forever(self) -> None:
        """On a thread of its own instead (a remote replica's socket): every message until the end."""
        while True:
            try:
                message = self._results.recv()
            except (EOFError, OSError):
                if not self._stopping:
                    self._post(self._gone_report())
                return
            self._post(message)

    def _gone_report(self) -> EngineDead:
        """What the results ending means while nobody asked the engine to stop (may block: it waits
        for the exit code)."""
        return EngineGone(self._gone_message())

    def _gone_message(self) -> str:
        """Why the results pipe ended while nobody asked the engine to stop."""
        return f"The engine process exited unexpectedly ({_exit_text(self.wait_exit(5.0))})."

    def _post(self, message: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._on_message, message)
        except RuntimeError:  # event loop closed: nobody is listening any more
            pass

    def _on_message(self, message: Any) -> None:
        """On the event loop: settle the start-up future, or dispatch as the thread transport does."""
        if isinstance(message, EngineReady):
            self.latest_stats, self._loaded = message.stats, True
            self.tokenizer_class = message.tokenizer_class
            self.memory_reports = message.memory_reports
            self._ready.done() or self._ready.set_result(None)
        elif isinstance(message, EngineStartFailed):
            self.start_error = message.error
            self.dead_error = f"The engine failed to start: {message.error}"
            self._ready.done() or self._ready.set_exception(message.error)
        elif isinstance(message, EngineDead):
            if self.dead_error is None:  # the loop's own report comes before the end of the pipe
                self.gone = isinstance(message, EngineGone)
                self._ready.done() or self._ready.set_exception(RuntimeError(message.message))
                self._dispatch(message)
        else:
            self._dispatch(self._prompts.restore(message))


# ----- the engine process ---------------------------------------------------------------------
def _build_llm_engine(config: Any) -> Any:
    from tengyun.engine.llm_engine import LLMEngine

    return LLMEngine.from_config(config)


def _die_with_parent() -> None:
    """Exit when the API process is gone. Linux: the kernel sends SIGKILL (PR_SET_PDEATHSIG; the
    API process forks from its main thread, which lives as long as it does), so no thread polls:
    a polling Python thread wakes to contend for the GIL with a load blocked in C (safetensors
    opening a hung mount holds it), ~1% of a core that a stalled start-up must not show
    (`tengyun supervise --start-stall-timeout`). Elsewhere: the polling thread."""
    recorded = multiprocessing.parent_process()  # its pid as of the fork, whatever happened since
    parent = recorded.pid if recorded is not None else os.getppid()
    try:
        libc = ctypes.CDLL(None)
        armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        armed = False
    if not armed:
        from tengyun.executor.worker_process import _exit_with_parent

        _exit_with_parent()
    elif os.getppid() != parent:  # it went before the signal was armed
        os._exit(1)


def _engine_process_main(build: Callable[[Any], Any], config: Any, requests: Connection, results: Connection,
                         api_ends: tuple[Connection, ...]) -> None:
    for end in api_ends:  # the copies fork made of the API process's ends: only then does its exit read as EOF
        end.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C drains in the API process, which then says Shutdown
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # so does a SIGTERM sent to the whole group (systemd)
    _die_with_parent()
    try:
        engine = build(config)
    except BaseException as e:  # noqa: BLE001 - the API process reports it and exits 2 (config) or 1
        if not isinstance(e, ValueError):
            logger.exception("Loading the engine failed")
        _send_result(results, EngineStartFailed(portable_error(e)))
        return
    _send_result(results, EngineReady(engine.get_stats(), os.getpid(), class_path(getattr(engine, "tokenizer", None)),
                                      engine.memory_reports))
    prompts = PromptSender()  # the API process's EngineProcessClient keeps them (PromptKeeper)
    run_engine_loop(engine, lambda block: _receive(engine, requests, block),
                    lambda message: _send_result(results, prompts.slim(message)))


def _receive(engine: Any, requests: Connection, block: bool) -> list:
    """receive_messages from the requests pipe; its end of file (the API process is gone) reads
    as Shutdown."""
    try:
        return receive_messages(lambda timeout: requests.recv() if requests.poll(timeout) else None, engine, block)
    except (EOFError, OSError):
        return [Shutdown()]


def _send_result(results: Connection, message: Any) -> None:
    if isinstance(message, StepResult) and message.rejected:
        message.rejected = {rid: portable_error(e) for rid, e in message.rejected.items()}
    try:
        results.send(message)
    except (OSError, ValueError):  # the API process is gone; the next receive reads Shutdown
        pass


def portable_error(error: BaseException) -> BaseException:
    """``error`` if it survives pickling as itself, else a ValueError / RuntimeError with its text
    (an exception whose __init__ takes other arguments than its message does not unpickle)."""
    try:
        copy = pickle.loads(pickle.dumps(error))
        if type(copy) is type(error) and str(copy) == str(error):
            return error
    except Exception:  # noqa: BLE001 - any pickling failure means: send the text
        pass
    kind = ValueError if isinstance(error, ValueError) else RuntimeError
    return kind(f"{type(error).__name__}: {error}" if kind is RuntimeError else str(error))


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}" + (": out of memory?" if -code == signal.SIGKILL else "")
    return f"exit code {code}"
