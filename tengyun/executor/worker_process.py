"""The main function of one rank's process (started by MultiprocExecutor or a --headless node).

Every step, rank 0 takes the SchedulerOutput from the engine's pipe and broadcasts it over
the gloo CPU group as one pickled message, together with the tokens sampled last step
(ranks that do not sample append them to their own sequence state):

    engine --pipe--> rank 0 --broadcast (sched, last step's tokens)--> ranks 1..N-1
    sampling rank (TP rank 0 of the last PP stage) --send--> rank 0 --pipe--> engine

Replies on the pipe: ("ready", rank, info), ("result", ModelRunnerOutput), ("error", rank, text).
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

logger = logging.getLogger(__name__)

EXECUTE, SHUTDOWN = "execute", "shutdown"


def worker_main(config, rank: RankInfo, pipe: Connection | None, threads: int) -> None:
    """Entry point of a spawned rank; ``pipe`` talks to the engine (None on other nodes' ranks)."""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(levelname)s %(asctime)s rank{rank.rank} %(name)s: %(message)s", force=True)
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
    from tengyun.distributed.parallel_state import (
        broadcast_object, is_sampler_rank, recv_object, sampler_rank, send_object,
    )

    sampler = sampler_rank(rank.tp_size, rank.pp_size)
    sampled: dict[int, list[int]] = {}  # last step's tokens, known to rank 0
    while True:
        if rank.rank == 0:
            message = pipe.recv()
            kind, sched = message[0], message[1] if len(message) > 1 else None
            if rank.world_size > 1:
                broadcast_object((kind, sched, sampled))
        else:
            kind, sched, sampled = broadcast_object(None)
        if kind == SHUTDOWN:
            return
        output = worker.execute_model(sched, None if is_sampler_rank() else sampled)
        if sampler != 0:
            if rank.rank == sampler:
                send_object(output, 0)
            elif rank.rank == 0:
                output = recv_object(sampler)
        if rank.rank == 0:
            sampled = dict(output.sampled_token_ids)
            pipe.send(("result", output))


def _reply(pipe: Connection | None, message: tuple) -> None:
    if pipe is None:
        return
    try:
        pipe.send(message)
    except (BrokenPipeError, OSError):
        pass


def _exit_with_parent() -> None:
    """Exit when the process that started this one goes away (killed engine or launcher)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
