"""Pipeline-parallel pieces of a model: each stage builds only its own decoder layers.

Layers of other stages are ``PPMissingLayer`` placeholders (no parameters), so module and
parameter names stay HF's (``model.layers.7.mlp...``) on every stage and the loader skips
checkpoint tensors that land in a placeholder.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tengyun.distributed.parallel_state import get_pp_rank, get_pp_size
from tengyun.model_spec import ModelSpec


class PPMissingLayer(nn.Identity):
    """A module another pipeline stage holds."""


def make_layers(spec: ModelSpec, factory: Callable[[int], nn.Module]) -> tuple[int, int, nn.ModuleList]:
    """(start, end, layers): this stage's layers[start:end] (spec.stage_layers) built by
    ``factory(index)``, the rest placeholders."""
    start, end = spec.stage_layers(get_pp_rank(), get_pp_size())
    layers = nn.ModuleList(factory(i) if start <= i < end else PPMissingLayer() for i in range(spec.num_layers))
    return start, end, layers


def missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Names of placeholder modules, each with a trailing dot: ("model.layers.2.", "lm_head.")."""
    return tuple(f"{name}." for name, module in model.named_modules() if isinstance(module, PPMissingLayer))


def intermediate_shapes(num_tokens: int, hidden_size: int) -> list[tuple[int, int]]:
    """Shapes a stage sends to the next: hidden states and residual, each [T, hidden]."""
    return [(num_tokens, hidden_size), (num_tokens, hidden_size)]


IntermediateTensors = list[torch.Tensor]  # [hidden, residual], each [T, hidden]
