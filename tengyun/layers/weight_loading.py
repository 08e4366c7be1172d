"""Per-parameter weight loaders: each parameter copies (its shard of) a checkpoint tensor."""

from __future__ import annotations

import contextlib
import contextvars

import torch

from tengyun.quantization.awq_gptq_packing import dropped_tensor_problem

# Inside deferred_weights(): layers whose tensors depend on the checkpoint's quantisation
# (linear layers, MoE experts) allocate them on the meta device until they are told.
_DEFERRED = contextvars.ContextVar("tengyun_deferred_weights", default=False)


@contextlib.contextmanager
def deferred_weights(enabled: bool = True):
    """Build a model whose linear weights are allocated later (tengyun/layers/quantized.py): a
    quantised layer then never holds its dense weight, not even briefly."""
    token = _DEFERRED.set(enabled)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def weight_device() -> str | None:
    """The device a deferrable weight is built on: "meta" inside deferred_weights(), else the default."""
    return "meta" if _DEFERRED.get() else None


INTEGER_DTYPES = {"int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64}


def layout_dtype(layout, act_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of a TensorLayout (tengyun/quantization/scheme.py): "act" is ``act_dtype``;
    "float32" a scale kept in float32 whatever --dtype is (ModelSlim's deq_scale)."""
    if layout.dtype == "float32":
        return torch.float32
    return act_dtype if layout.dtype == "act" else INTEGER_DTYPES[layout.dtype]


def check_integer_dtype(param: torch.Tensor, loaded: torch.Tensor, layout, description: str) -> None:
    """An integer (packed) tensor must be stored as the format says: copy_ would cast floats silently."""
    if param.dtype in INTEGER_DTYPES.values() and loaded.dtype != param.dtype:
        raise WeightFormatError(f"is {loaded.dtype}, but {description} stores {layout.name} as {param.dtype}: "
                                f"the checkpoint does not hold the format config.json claims")


def check_dropped(layout, loaded: torch.Tensor, scheme, out: int, in_: int, what: str = "layer") -> None:
    """A tensor a scheme checks at load, then drops (TensorLayout.kept False): compressed-tensors'
    weight_shape must say [out, in_]; GPTQ's g_idx without act order and a symmetric checkpoint's
    qzeros must hold what config.json implies (tengyun/quantization/awq_gptq_packing.py)."""
    if layout.name == "weight_shape":
        if loaded.tolist() != [out, in_]:
            raise WeightFormatError(f"says the {what} is {loaded.tolist()}, but config.json makes it {[out, in_]}")
        return
    problem = dropped_tensor_problem(layout.name, loaded, scheme, in_)
    if problem:
        raise WeightFormatError(problem)


def materialize(module: torch.nn.Module, device: torch.device) -> None:
    """Give ``module``'s own meta parameters real (uninitialised) storage on ``device``, keeping
    their attributes (weight_loader, ...)."""
    for name, param in list(module._parameters.items()):
        if param is not None and param.is_meta:
            real = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=False)
            real.__dict__.update(param.__dict__)
            module._parameters[name] = real


class WeightShapeError(ValueError):
    """A checkpoint tensor whose shape disagrees with the parameter built from config.json."""

    def __init__(self, expected: tuple[int, ...], actual: tuple[int, ...]):
        self.expected = tuple(expected)
        self.actual = tuple(actual)
        super().__init__(f"expected shape {list(self.expected)} from config.json, got {list(self.actual)}")


class WeightFormatError(ValueError):
    """A checkpoint tensor of the right shape but the wrong kind (an integer tensor stored as
    floats, a weight_shape that disagrees): the message continues "checkpoint tensor X ..."."""


def check_shape(target: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(target.shape) != tuple(loaded.shape):
        raise WeightShapeError(tuple(target.shape), tuple(loaded.shape))


def default_weight_loader(param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
    check_shape(param.data, loaded_weight)
    param.data.copy_(loaded_weight)


def set_weight_loader(param: torch.nn.Parameter, loader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def drop_weight_loaders(module: torch.nn.Module) -> None:
    """Forget every parameter's weight_loader once the checkpoint is in. A layer's bound loader
    makes a cycle (parameter -> loader -> layer -> parameter) that Python's collector leaves
    alone where C++ also holds the tensor (a view of it, a kernel's handle): a dropped engine
    kept such weights for the life of the process."""
    for param in module.parameters():
        param.__dict__.pop("weight_loader", None)


def rank_slice_of_segments(loaded: torch.Tensor, sizes: list[int], tp_rank: int, tp_size: int) -> torch.Tensor:
    """A tensor whose dim 0 is several segments back to back (e.g. Qwen3.5's in_proj_qkv: q | k | v)
    -> this rank's 1/tp of each segment, concatenated: [sum(sizes) / tp, ...]."""
    if loaded.shape[0] != sum(sizes):
        raise WeightShapeError((sum(sizes),) + tuple(loaded.shape[1:]), tuple(loaded.shape))
    return torch.cat([part.narrow(0, tp_rank * (size // tp_size), size // tp_size)
                      for part, size in zip(loaded.split(sizes), sizes)])
