"""Process groups and the collectives the model uses: tensor-parallel (TP), pipeline-parallel (PP)
and, with --enable-expert-parallel, expert-parallel (EP).

Rank layout (vLLM's): global rank = pp_rank * tp_size + tp_rank, so a TP group is a run of
consecutive ranks and, with ranks numbered node by node, stays inside one node.
    tp=2, pp=2: TP groups [0, 1] [2, 3]; PP groups [0, 2] [1, 3]; stage 0 = ranks 0, 1.

EP group: the ranks among which a MoE layer's experts are divided whole. Without data parallelism
it is the stage's TP group (every TP rank holds every token, so no token moves before the experts
and the combine is the TP all-reduce); with --data-parallel-size it spans every replica's TP ranks
(widen_expert_parallel; the exchange between replicas is distributed/data_parallel.py).

A process that never calls init_distributed() is rank 0 of 1 and every collective is a no-op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import pickle
import socket
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tengyun.distributed.rank_info import RankInfo

logger = logging.getLogger(__name__)


@dataclass
class _State:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    rank: int = 0
    tp_group: object = None
    cpu_group: object = None  # gloo over every rank: pickled messages, whatever the device backend
    stage_group: object = None  # gloo over this pipeline stage's ranks: the step message's fan-out
    result_group: object = None  # gloo, rank 0 and the sampler rank: results, apart from the step's traffic
    ep_rank: int = 0  # --enable-expert-parallel: this rank's place in the EP group
    ep_size: int = 1  # 1: expert parallelism off (or one rank)


_STATE = _State()


def init_distributed(info: RankInfo, backend: str, setup_timeout_s: float | None = None) -> None:
    """Join the world over ``backend`` (gloo / nccl / hccl) and build the TP groups. Once every
    rank has joined (the rendezvous waits up to info.timeout_s), the communicators are set up
    and proven by a barrier within ``setup_timeout_s`` (--distributed-timeout; default
    info.timeout_s): a hang there is logged naming this rank, its host, the master and the likely
    causes, and the process exits 1 (a hung HCCL init cannot be interrupted), which the engine
    reports as this rank's death."""
    global _STATE
    timeout = datetime.timedelta(seconds=info.timeout_s)
    dist.init_process_group(backend, init_method=info.init_method, world_size=info.world_size,
                            rank=info.rank, timeout=timeout)
    with communicator_setup(info, backend, setup_timeout_s or info.timeout_s):
        _build_groups(info, timeout)
        dist.barrier()  # device backends create their world communicator here (HCCL: hccl_init)


def _build_groups(info: RankInfo, timeout: datetime.timedelta) -> None:
    global _STATE
    tp_group = None
    for pp_rank in range(info.pp_size):  # every rank creates every group, in the same order
        ranks = list(range(pp_rank * info.tp_size, (pp_rank + 1) * info.tp_size))
        group = dist.new_group(ranks, timeout=timeout)
        if pp_rank == info.pp_rank:
            tp_group = group
    # Its own group even under gloo, so pickled messages never interleave with PP tensors.
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    stage_group = None
    for pp_rank in range(info.pp_size):
        group = dist.new_group(list(range(pp_rank * info.tp_size, (pp_rank + 1) * info.tp_size)),
                               backend="gloo", timeout=timeout)
        if pp_rank == info.pp_rank:
            stage_group = group
    # Rank 0's result thread receives on this group while its main thread sends on the others.
    result_group = dist.new_group(sorted({0, sampler_rank(info.tp_size, info.pp_size)}), backend="gloo",
                                  timeout=timeout)
    ep_rank, ep_size = (info.tp_rank, info.tp_size) if info.expert_parallel else (0, 1)  # EP group = TP group
    if ep_size > 1:
        logger.info("Expert parallel: rank %d is expert-parallel rank %d of %d (the TP group of stage %d)",
                    info.rank, ep_rank, ep_size, info.pp_rank)
    _STATE = _State(info.tp_rank, info.tp_size, info.pp_rank, info.pp_size, info.rank, tp_group, cpu_group,
                    stage_group, result_group, ep_rank, ep_size)
    if tp_group is not None and info.tp_size > 1:
        dist.barrier(group=tp_group)  # and the TP group's, used by every layer


def setup_failure(info: RankInfo, backend: str, what: str) -> str:
    """The error for a communicator set-up that hung or failed: who, where, and what to check."""
    master = info.init_method.removeprefix("tcp://")
    return (f"rank {info.rank} on {socket.gethostname()} {what} setting up its {backend} communicators with the "
            f"other {info.world_size - 1} rank(s) (master {master}). Likely causes: the device network "
            f"addresses (RoCE: `hccn_tool -i N -ip -g` on each node, reachable from the others; HCCL_IF_IP / "
            f"HCCL_SOCKET_IFNAME naming the right interface), a firewall between the nodes (the master port "
            f"and HCCL's ports, HCCL_IF_BASE_PORT onwards), or different software versions on the nodes "
            f"(CANN, torch_npu, driver: run `tengyun doctor` on each). Raise --distributed-timeout if the "
            f"set-up is only slow.")


@contextlib.contextmanager
def communicator_setup(info: RankInfo, backend: str, timeout_s: float):
    """Run the body within ``timeout_s``: past it, log setup_failure and exit 1; an error in it
    is raised again as RuntimeError with setup_failure's message."""
    def hung() -> None:
        logger.error("%s", setup_failure(info, backend, f"hung for {timeout_s:g} s"))
        logging.shutdown()
        os._exit(1)

    watchdog = threading.Timer(timeout_s, hung)
    watchdog.daemon = True
    watchdog.start()
    try:
        yield
    except Exception as e:
        raise RuntimeError(setup_failure(info, backend, f"failed ({type(e).__name__}: {e})")) from e
    finally:
        watchdog.cancel()


def destroy_distributed() -> None:
    global _STATE
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE = _State()


def get_tp_rank() -> int:
    return _STATE.tp_rank


def get_tp_size() -> int:
    return _STATE.tp_size


def get_pp_rank() -> int:
    return _STATE.pp_rank


def get_pp_size() -> int:
    return _STATE.pp_size


def get_rank() -> int:
    return _STATE.rank


def get_ep_rank() -> int:
    return _STATE.ep_rank


def get_ep_size() -> int:
    """Ranks a MoE layer's experts are divided whole among; 1 without --enable-expert-parallel."""
    return _STATE.ep_size


def widen_expert_parallel(replica: int, replicas: int) -> None:
    """--data-parallel-size with --enable-expert-parallel: the EP group spans every replica's TP
    ranks (distributed/data_parallel.py); replica d's TP rank t is EP rank d * tp + t."""
    global _STATE
    _STATE = dataclasses.replace(_STATE, ep_rank=replica * _STATE.tp_size + _STATE.tp_rank,
                                 ep_size=replicas * _STATE.tp_size)
    logger.info("Expert parallel: rank %d of replica %d is expert-parallel rank %d of %d (all replicas' TP ranks)",
                _STATE.tp_rank, replica, _STATE.ep_rank, _STATE.ep_size)


def expert_parallel_combine(y: torch.Tensor) -> torch.Tensor:
    """Each EP rank's output of its own experts, y [T, H] -> the sum over the EP group, on every rank.
    The EP group is the TP group (see the module docstring): the TP all-reduce."""
    return tensor_model_parallel_all_reduce(y)


def is_first_pp_rank() -> bool:
    return _STATE.pp_rank == 0


def is_last_pp_rank() -> bool:
    return _STATE.pp_rank == _STATE.pp_size - 1


def is_sampler_rank() -> bool:
    """The one rank that samples and returns results: TP rank 0 of the last PP stage."""
    return is_last_pp_rank() and _STATE.tp_rank == 0


def sampler_rank(tp_size: int, pp_size: int) -> int:
    return (pp_size - 1) * tp_size


# ----- tensor-parallel collectives --------------------------------------------------------
def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _STATE.tp_size == 1:
        return x
    dist.all_reduce(x, group=_STATE.tp_group)
    return x


def tensor_model_parallel_gather(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate every TP rank's x [..., n] along the last dim on TP rank 0 ([..., n * tp]);
    the other ranks get None."""
    if _STATE.tp_size == 1:
        return x
    first = _STATE.pp_rank * _STATE.tp_size
    parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)] if _STATE.tp_rank == 0 else None
    dist.gather(x.contiguous(), parts, dst=first, group=_STATE.tp_group)
    return torch.cat(parts, dim=-1) if parts is not None else None


def tensor_model_parallel_broadcast(x: torch.Tensor) -> torch.Tensor:
    """TP rank 0's x on every rank of its TP group, in place (the other ranks pass a buffer of
    the same shape and dtype): e.g. the tokens only the sampling rank computed."""
    if _STATE.tp_size == 1:
        return x
    dist.broadcast(x, src=_STATE.pp_rank * _STATE.tp_size, group=_STATE.tp_group)
    return x


# ----- pipeline-parallel point-to-point ---------------------------------------------------
def pp_send(tensors: list[torch.Tensor]) -> None:
    """Send to the same TP rank of the next stage (global rank + tp_size)."""
    dst = _STATE.rank + _STATE.tp_size
    for t in tensors:
        dist.send(t.contiguous(), dst)


def pp_recv(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Receive from the same TP rank of the previous stage, one tensor per shape."""
    src = _STATE.rank - _STATE.tp_size
    out = []
    for shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src)
        out.append(t)
    return out


# ----- pickled messages between ranks (CPU group) ----------------------------------------
def broadcast_object(obj: object, src: int = 0, *, within_stage: bool = False) -> object:
    """Rank ``src`` sends obj to every rank, or with ``within_stage`` to its pipeline stage's
    ranks (length, then bytes); returns it everywhere."""
    group = _STATE.stage_group if within_stage else _STATE.cpu_group
    if src == _STATE.rank:
        size, payload = _pickled(obj)
        dist.broadcast(size, src, group=group)
        dist.broadcast(payload, src, group=group)
        return obj
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src, group=group)
    return pickle.loads(payload.numpy().tobytes())


def send_object(obj: object, dst: int, *, result: bool = False) -> None:
    """obj to rank ``dst``; ``result``: over the results' own group (rank 0 <-> the sampler rank)."""
    group = _STATE.result_group if result else _STATE.cpu_group
    for t in _pickled(obj):
        dist.send(t, dst, group=group)


def isend_object(obj: object, dst: int) -> list:
    """send_object without waiting for ``dst`` to receive: the works to wait on (each holds its tensor)."""
    return [dist.isend(t, dst, group=_STATE.cpu_group) for t in _pickled(obj)]


def recv_object(src: int, *, result: bool = False) -> object:
    group = _STATE.result_group if result else _STATE.cpu_group
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src, group=group)
    return pickle.loads(payload.numpy().tobytes())


def _pickled(obj: object) -> tuple[torch.Tensor, torch.Tensor]:
    """(size [1] int64, payload [size] uint8) of obj pickled."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    return torch.tensor([payload.numel()], dtype=torch.int64), payload


def all_reduce_min(value: int) -> int:
    """The smallest ``value`` over every rank (e.g. KV blocks that fit on all of them)."""
    return _all_reduce_int(value, dist.ReduceOp.MIN)


def all_reduce_max(value: int) -> int:
    """The largest ``value`` over every rank (e.g. the step budget every rank profiles)."""
    return _all_reduce_int(value, dist.ReduceOp.MAX)


def _all_reduce_int(value: int, op) -> int:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=op, group=_STATE.cpu_group)
    return int(t.item())
