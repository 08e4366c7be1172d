"""Per-parameter weight loaders: each parameter copies (its shard of) a checkpoint tensor."""

from __future__ import annotations

import torch


class WeightShapeError(ValueError):
    """A checkpoint tensor whose shape disagrees with the parameter built from config.json."""

    def __init__(self, expected: tuple[int, ...], actual: tuple[int, ...]):
        self.expected = tuple(expected)
        self.actual = tuple(actual)
        super().__init__(f"expected shape {list(self.expected)} from config.json, got {list(self.actual)}")


def check_shape(target: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(target.shape) != tuple(loaded.shape):
        raise WeightShapeError(tuple(target.shape), tuple(loaded.shape))


def default_weight_loader(param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
    check_shape(param.data, loaded_weight)
    param.data.copy_(loaded_weight)


def set_weight_loader(param: torch.nn.Parameter, loader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]
