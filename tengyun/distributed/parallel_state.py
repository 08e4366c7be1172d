"""Process-group state. Single process for now: tensor-parallel rank 0 of 1."""

from __future__ import annotations

_TP_RANK = 0
_TP_SIZE = 1


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def tensor_model_parallel_all_reduce(x):
    if _TP_SIZE == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x)
    return x
