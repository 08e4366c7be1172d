"""The main function of one rank's process (started by MultiprocExecutor or a --headless node).

Every step, rank 0 takes the SchedulerOutput from the engine's pipe and broadcasts it to its
pipeline stage's ranks as one pickled message (gloo), together with the tokens sampled since the
last message (ranks that do not sample append them to their own sequence state). Each stage
passes the message on to the same TP rank of the next stage ahead of the step's activations,
without waiting for that stage to take it, so stage 0 can run batch k + 1 while stage 1 still
runs batch k (the engine keeps up to P batches in flight, llm_engine.py):

    engine --pipe--> rank 0 --broadcast (sched, new tokens)--> stage 0 --isend--> stage 1 ... stage P-1
    sampling rank (TP rank 0 of the last stage) --send, result group--> rank 0's result thread --pipe--> engine

Results come back in the order the batches went in. Replies on the pipe: ("ready", rank, info),
("result", ModelRunnerOutput), ("error", rank, text).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from tengyun.distributed.rank_info import RankInfo
from tengyun.logging_config import configure_logging

logger = logging.getLogger(__name__)

EXECUTE, SHUTDOWN = "execute", "shutdown"


def worker_main(config, rank: RankInfo, pipe: Connection | None, threads: int) -> None:
    """Entry point of a spawned rank; ``pipe`` talks to the engine (None on other nodes' ranks)."""
    configure_logging(f"%(levelname)s %(asctime)s rank{rank.rank} %(name)s: %(message)s", force=True)
    _exit_with_parent()
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    try:
        from tengyun.worker.worker import Worker

        worker = Worker(config, rank)
        _reply(pipe, ("ready", rank.rank, {"num_blocks": worker.num_blocks, "num_state_slots": worker.num_state_slots,
                                           "num_state_snapshots": worker.num_state_snapshots,
                                           "weight_bytes": worker.weight_bytes,
                                           "memory": worker.memory_report.as_json(),
                                           "pid": os.getpid()}))
        _serve(worker, rank, pipe)
    except BaseException as e:  # noqa: BLE001 - report, then exit non-zero
        text = f"{type(e).__name__}: {e}"
        logger.error("rank %d failed: %s\n%s", rank.rank, text, traceback.format_exc())
        _reply(pipe, ("error", rank.rank, text, isinstance(e, ValueError)))
        sys.stdout.flush()
        os._exit(1)
    os._exit(0)


def _serve(worker, rank: RankInfo, pipe: Connection | None) -> None:
    from tengyun.distributed.parallel_state import is_sampler_rank

    link = _StepLink(rank, pipe)
    while True:
        kind, sched, sampled = link.receive()
        link.forward((kind, sched, sampled))
        if kind == SHUTDOWN:
            link.close()
            return
        output = worker.execute_model(sched, None if is_sampler_rank() else sampled)
        link.deliver(output)


class _StepLink:
    """How step messages reach this rank and leave it, and how results reach the engine.

    Invariant: tokens a result carries are in rank 0's ``_sampled`` before the engine sees that
    result, so the next message rank 0 sends (the first that can schedule those sequences again)
    carries them to the ranks that did not sample."""

    def __init__(self, rank: RankInfo, pipe: Connection | None):
        from tengyun.distributed.parallel_state import sampler_rank

        self.rank, self.pipe = rank, pipe
        self.tp, self.pp_rank = rank.tp_size, rank.pp_rank
        self.sampler = sampler_rank(rank.tp_size, rank.pp_size)
        self._sampled: dict[int, list[int]] = {}  # rank 0: tokens not yet sent on; seq_id -> tokens
        self._lock = threading.Lock()
        self._forwarding: list = []  # works of the message being sent to the next stage
        self._results = None
        if rank.rank == 0 and self.sampler != 0:  # results arrive while this rank runs later batches
            self._results = threading.Thread(target=self._relay_results, name="results", daemon=True)
            self._results.start()

    def receive(self) -> tuple:
        """(kind, SchedulerOutput | None, tokens sampled since the last message)."""
        from tengyun.distributed.parallel_state import broadcast_object, recv_object

        if self.pp_rank > 0:
            return recv_object(self.rank.rank - self.tp)
        if self.rank.rank != 0:
            return broadcast_object(None, within_stage=True)
        message = self.pipe.recv()
        with self._lock:
            sampled, self._sampled = self._sampled, {}
        message = (message[0], message[1] if len(message) > 1 else None, sampled)
        if self.tp > 1:
            broadcast_object(message, within_stage=True)
        return message

    def forward(self, message: tuple) -> None:
        """Pass the message to the next stage without waiting for it to be taken (the previous
        one has been: a stage takes messages in order)."""
        from tengyun.distributed.parallel_state import isend_object

        if self.pp_rank == self.rank.pp_size - 1:
            return
        self._wait_forwarded()
        self._forwarding = isend_object(message, self.rank.rank + self.tp)

    def deliver(self, output) -> None:
        """The step's result from the sampling rank to the engine (None elsewhere)."""
        from tengyun.distributed.parallel_state import send_object

        if self.rank.rank != self.sampler:
            return
        if self.rank.rank == 0:
            self._to_engine(output)
        else:
            send_object(output, 0, result=True)

    def close(self) -> None:
        from tengyun.distributed.parallel_state import send_object

        self._wait_forwarded()
        if self.rank.rank == self.sampler and self.sampler != 0:
            send_object(None, 0, result=True)  # after every result: rank 0's thread ends
        if self._results is not None:
            self._results.join()

    def _wait_forwarded(self) -> None:
        for work in self._forwarding:
            work.wait()
        self._forwarding = []

    def _relay_results(self) -> None:
        from tengyun.distributed.parallel_state import recv_object

        try:
            while (output := recv_object(self.sampler, result=True)) is not None:
                self._to_engine(output)
        except BaseException as e:  # noqa: BLE001 - a peer died: report as the main thread would
            text = f"{type(e).__name__}: {e}"
            logger.error("rank 0 failed receiving a result: %s\n%s", text, traceback.format_exc())
            _reply(self.pipe, ("error", 0, text, False))
            os._exit(1)

    def _to_engine(self, output) -> None:
        with self._lock:
            for seq_id, tokens in output.sampled_token_ids.items():
                self._sampled.setdefault(seq_id, []).extend(tokens)
        _reply(self.pipe, ("result", output), raise_errors=True)


_PIPE_LOCK = threading.Lock()  # rank 0's main thread and result thread both write to the pipe


def _reply(pipe: Connection | None, message: tuple, raise_errors: bool = False) -> None:
    if pipe is None:
        return
    try:
        with _PIPE_LOCK:
            pipe.send(message)
    except (BrokenPipeError, OSError):
        if raise_errors:
            raise


def _exit_with_parent() -> None:
    """Exit when the process that started this one goes away (killed engine or launcher)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
