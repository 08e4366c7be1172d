"""The kernels a platform computes with, handed to the model's layers in one pass.

``Platform.kernels`` (tengyun/platforms/base.py) picks them once per worker; ``bind_kernels``
gives every layer that computes through a kernel its part, once the weights are loaded. Layers
never ask for a platform: until bound they compute with the PyTorch defaults (``F.linear``,
``TORCH_LAYER_OPS``, torch_sdpa, ``TorchGatedDeltaRule``), so a model built outside the worker
runs as HF's arithmetic does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from torch import nn

from tengyun.layers.attention.backend import AttentionBackend
from tengyun.layers.gated_delta_rule import GatedDeltaRuleKernel
from tengyun.layers.layer_ops import TorchLayerOps
from tengyun.layers.linear_kernel import DenseLinearKernel
from tengyun.layers.quant_kernels import QuantLinearKernel
from tengyun.quantization.scheme import LinearScheme


@dataclass(frozen=True)
class KernelBundle:
    attention: AttentionBackend  # paged attention of every Attention layer (layers/attention/)
    linear: DenseLinearKernel  # matmul of every linear layer and the LM head (linear_kernel.py)
    layer_ops: TorchLayerOps  # RMSNorm, rotary embedding, SiLU-and-mul (layer_ops.py)
    # Gated DeltaNet's recurrence (gated_delta_rule.py); None for a model without those layers.
    gated_delta_rule: GatedDeltaRuleKernel | None
    # Quantised linear layers: a kernel per scheme the checkpoint holds (quant_kernels.py);
    # a scheme missing here runs its plain-PyTorch reference.
    quant_linear: Mapping[LinearScheme, QuantLinearKernel] = field(default_factory=dict)
    # The sampler's last stage fused (layers/sampler.py, Sampler.bind_kernels): sample_rows(logits
    # [B, V], temperature [B] | None, u [B] float64 | None, greedy [B] bool | None) -> [B] int64;
    # None: the PyTorch ops.
    sample_rows: Callable | None = None
    # LoRA adapters' batched products (layers/lora/kernels.py), handed to LoRAManager's layers.
    lora: object | None = None
    # The experts of MoE layers (layers/moe/grouped.py: route, experts, prepare); None: PyTorch's
    # grouped matmul.
    moe: object | None = None


def bind_kernels(model: nn.Module, kernels: KernelBundle) -> None:
    """Each layer with a ``bind_kernels`` method takes its part of ``kernels``. Call once, after
    loading: a linear kernel may repack the loaded weight and free the original."""
    for module in model.modules():
        bind = getattr(module, "bind_kernels", None)
        if bind is not None:
            bind(kernels)
