"""How a rank's process starts: a fresh interpreter that never re-runs the user's script, or fork.

multiprocessing's "spawn" re-runs the main script's top level in every child (as ``__mp_main__``)
to find the target, so a script that calls ``LLM(..., tensor_parallel_size=2)`` without an
``if __name__ == "__main__":`` guard would build another LLM in each rank. Ranks here start as

    python -c BOOTSTRAP <pipe fd> tengyun-rank<N>

which imports only tengyun: the engine sends its sys.path, then (config, RankInfo, threads)
down the pipe, and the child runs worker_main. No guard is needed, whatever the device and
whatever this process did before (CUDA initialised, OpenMP threads running).

TENGYUN_WORKER_MULTIPROC_METHOD (or vLLM's VLLM_WORKER_MULTIPROC_METHOD) = "fork" forks
instead: ranks start without importing torch again, but only where the platform's runtime
survives fork (Platform.fork_safe); elsewhere the ranks start fresh, with a warning.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import subprocess
import sys
import weakref
from multiprocessing import Pipe, get_context
from multiprocessing.connection import Connection

from tengyun.executor.worker_process import worker_main

logger = logging.getLogger(__name__)

METHOD_ENVS = ("TENGYUN_WORKER_MULTIPROC_METHOD", "VLLM_WORKER_MULTIPROC_METHOD")  # first set wins
METHODS = ("spawn", "fork")

# sys.path first, so tengyun imports from where the engine's did (a checkout on sys.path works);
# the pickled arguments are read before that import too, so the engine never waits on it.
_BOOTSTRAP = (
    "import sys\n"
    "from multiprocessing.connection import Connection\n"
    "pipe = Connection(int(sys.argv[1]))\n"
    "sys.path[:] = pipe.recv()\n"
    "arguments = pipe.recv_bytes()\n"
    "from tengyun.executor.rank_process import child_main\n"
    "child_main(pipe, arguments)\n"
)


def start_method(fork_safe: bool) -> str:
    """"spawn" unless the environment asks for "fork" and the platform's runtime survives it."""
    name, value = next(((n, os.environ[n]) for n in METHOD_ENVS if os.environ.get(n)), (None, "spawn"))
    if value not in METHODS:
        raise ValueError(f"{name} must be spawn or fork; got {value!r} (unset it for spawn).")
    if value == "fork" and not fork_safe:
        logger.warning("%s=fork ignored: this device's runtime is already initialised in the engine "
                       "process and a forked rank could not use it; starting the ranks with spawn "
                       "(fresh interpreters, no `if __name__ == \"__main__\":` guard needed).", name)
        return "spawn"
    return value


def start_rank(method: str, config, info, threads: int, name: str):
    """Start one rank running worker_main(config, info, pipe, threads) -> (its process, the
    engine's end of its pipe). The process has multiprocessing.Process's pid, sentinel,
    is_alive(), exitcode, join(timeout) and terminate()."""
    ours, theirs = Pipe()
    if method == "fork":
        process = get_context("fork").Process(target=worker_main, args=(config, info, theirs, threads),
                                              name=name, daemon=True)
        process.start()
    else:
        process = SpawnedRank(theirs, name)
        _send_arguments(ours, config, info, threads)
    theirs.close()
    return process, ours


def _send_arguments(ours: Connection, config, info, threads: int) -> None:
    """What _BOOTSTRAP reads before it imports tengyun."""
    try:
        ours.send(sys.path)
        ours.send_bytes(pickle.dumps((config, info, threads)))
    except OSError:  # the child already died: its sentinel and exit code tell the engine
        pass


def child_main(pipe: Connection, arguments: bytes) -> None:
    """The fresh interpreter's side of SpawnedRank (after _BOOTSTRAP set sys.path)."""
    config, info, threads = pickle.loads(arguments)
    worker_main(config, info, pipe, threads)


class SpawnedRank:
    """A rank in a fresh interpreter, with multiprocessing.Process's waiting interface.

    ``sentinel`` is the read end of a pipe whose write end only the child holds: it reads EOF
    (is ready for multiprocessing.connection.wait) once the child has exited, however it died.
    """

    def __init__(self, theirs: Connection, name: str):
        sentinel, alive = os.pipe()
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, str(theirs.fileno()), name],
                pass_fds=(theirs.fileno(), alive), close_fds=True)
        finally:
            os.close(alive)
        self.sentinel = sentinel
        self.pid = self._popen.pid
        weakref.finalize(self, os.close, sentinel)
        _running.add(self)

    @property
    def exitcode(self) -> int | None:
        """None while running; -N when killed by signal N (as multiprocessing reports it)."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()


_running: weakref.WeakSet[SpawnedRank] = weakref.WeakSet()


@atexit.register
def _stop_running() -> None:
    """Ranks end with the interpreter that started them, as multiprocessing's daemon processes
    do (each also exits within a second of losing its parent: worker_process._exit_with_parent)."""
    ranks = [r for r in _running if r.is_alive()]
    for r in ranks:
        r.terminate()
    for r in ranks:
        r.join(5.0)
