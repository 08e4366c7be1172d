"""How many decoder layers each pipeline stage holds.

By default the stages are balanced by the weights a decode step reads, not by layer count: decode
is bound by memory traffic, and a step of many sequences reads every weight of a layer (an MoE
layer's experts too: a batch routes to most of them), while the last stage also reads the LM head
(vocab x hidden; 8 layers' worth on SmolLM2-135M, 0.15 on Qwen3.5-397B-A17B), the cost that left
an even split's last stage the bottleneck of an overlapped pipeline. Prefill pays the head only
for sampled rows. vLLM's ``VLLM_PP_LAYER_PARTITION`` ("19,11": layers per stage, first to last)
sets the split by hand, as does ``TENGYUN_PP_LAYER_PARTITION``; the same value is needed on every
node."""

from __future__ import annotations

import functools
import os

from tengyun.model_spec import ModelSpec
from tengyun.sizing.model_size import attention_params, linear_attention_params, mlp_params

PARTITION_ENV = ("VLLM_PP_LAYER_PARTITION", "TENGYUN_PP_LAYER_PARTITION")


def layer_cost(spec: ModelSpec, layer: int) -> int:
    """Weights a decode step reads through ``layer`` (tp = 1)."""
    mixer = attention_params(spec, 1) if spec.layer_is_attention(layer) else linear_attention_params(spec, 1)
    return mixer + mlp_params(spec, 1, layer)


@functools.lru_cache(maxsize=256)  # `tengyun plan`'s search asks for every pp
def balanced_partition(spec: ModelSpec, pp: int) -> tuple[int, ...]:
    """Layers per stage, each at least one, minimising the costliest stage (the pipeline's pace),
    with the LM head's cost on the last stage; ties keep later stages lighter."""
    costs = [layer_cost(spec, i) for i in range(spec.num_layers)]
    head = spec.vocab_size * spec.hidden_size
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    n = len(costs)
    # best[s][i]: the smallest possible max stage cost putting layers [0, i) on stages 0..s-1
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0
    for s in range(1, pp + 1):
        for i in range(s, n - (pp - s) + 1):
            extra = head if s == pp else 0
            for j in range(s - 1, i):
                stage = prefix[i] - prefix[j] + extra
                worst = max(best[s - 1][j], stage)
                if worst <= best[s][i]:  # <=: the latest cut, so earlier stages take the spare layers
                    best[s][i], cut[s][i] = worst, j
    counts, i = [], n
    for s in range(pp, 0, -1):
        j = cut[s][i]
        counts.append(i - j)
        i = j
    return tuple(reversed(counts))


def pp_layer_partition(spec: ModelSpec, pp: int) -> tuple[int, ...] | None:
    """Layers per stage for --pipeline-parallel-size ``pp`` (None: one stage): the environment's
    partition where set, else balanced_partition. ValueError names the variable when it is wrong."""
    if pp == 1:
        return None
    name = next((n for n in PARTITION_ENV if os.environ.get(n)), None)
    if name is None:
        return balanced_partition(spec, pp)
    text = os.environ[name]
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if len(counts) != pp or min(counts) < 1 or sum(counts) != spec.num_layers:
        example = ",".join(map(str, balanced_partition(spec, pp)))
        raise ValueError(f"{name}={text!r} must list {pp} positive layer counts, one per pipeline stage, that add up "
                         f"to num_hidden_layers {spec.num_layers} (e.g. {example}).")
    return counts
