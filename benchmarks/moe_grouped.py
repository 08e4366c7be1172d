"""MoE experts on CPU: the per-expert loop (torch_loop, what fused_moe.py ran before) against
the grouped matmuls (torch_grouped_mm, the CPU's "moe" kernel), through a stack of FusedMoE layers of
a tiny-but-wide Qwen3-MoE shape (64 experts, top 8, hidden 1024, expert intermediate 384; random
weights, router logits random per call). Prints tokens per second through the stack for decode
batches of 1, 16 and 64 tokens and a 512-token prefill, the median of --repeats timed rounds per
cell, the two kernels alternating round by round on the same inputs.

``--engine``: the same shape as a whole model (4 decoder layers, every MLP an MoE block, random
weights saved to a temporary folder) served by LLM: output tok/s of greedy batch-1 and batch-16
decode (64 new tokens after an 8-token prompt) with the per-expert loop (the kernel choice forced
to torch_loop: its host reads keep decode graphs off) against the default (grouped, decode graphs
on where the platform records them).

``--quant w4a16|w8a16|w8a8``: the experts quantised (compressed-tensors' layout, random weights,
bound to the CPU's quantised kernels) and the loop they ran before (one kernel call per expert
with tokens, the counts read on the host: ``quant_grouped`` off) against the grouped path (one
compiled call per stack, csrc/moe_grouped.cpp). With ``--engine`` the model is quantised by
``tengyun quantize`` (w4a16 group 32, or w8a8) and the loop keeps decode graphs off. The order
alternates round by round.

    OMP_NUM_THREADS=2 python benchmarks/moe_grouped.py --dtype bfloat16
    OMP_NUM_THREADS=2 python benchmarks/moe_grouped.py --dtype bfloat16 --engine
    OMP_NUM_THREADS=2 python benchmarks/moe_grouped.py --dtype bfloat16 --quant w4a16
    OMP_NUM_THREADS=2 python benchmarks/moe_grouped.py --dtype bfloat16 --quant w4a16 --engine
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from tengyun.layers.fused_moe import FusedMoE
from tengyun.layers.moe.grouped import LoopMoe, TorchGroupedMoe

BATCHES = (("decode", 1), ("decode", 16), ("decode", 64), ("prefill", 512))


def _layers(args, dtype: torch.dtype) -> list[FusedMoE]:
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layer = FusedMoE(args.experts, args.top_k, args.hidden, args.intermediate, True, dtype)
        layer.w13_weight.data.normal_(0, 0.02)
        layer.w2_weight.data.normal_(0, 0.02)
        layers.append(layer)
    return layers


QUANT_SCHEMES = {"w4a16": (4, 32), "w8a16": (8, None), "w8a8": (8, None)}  # bits, group (None: per channel)


def _quantised_layers(args, dtype: torch.dtype) -> list[FusedMoE]:
    """args.layers FusedMoE layers whose experts hold ``args.quant``'s tensors (random weights,
    symmetric), loaded through the layer's loader and bound to the CPU platform's kernel."""
    from tengyun.layers.kernels import KernelBundle
    from tengyun.platforms.cpu.platform import CpuPlatform
    from tengyun.quantization.compressed_tensors import w8a8_scheme, weight_only_scheme
    from tengyun.quantization.packing import pack_int32, quantize_symmetric

    bits, group = QUANT_SCHEMES[args.quant]
    scheme = w8a8_scheme() if args.quant == "w8a8" else weight_only_scheme(bits, group, True)
    kernel = CpuPlatform().quant_linear_kernel(scheme, dtype)
    shapes = {"gate_proj": (args.intermediate, args.hidden), "up_proj": (args.intermediate, args.hidden),
              "down_proj": (args.hidden, args.intermediate)}
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layer = FusedMoE(args.experts, args.top_k, args.hidden, args.intermediate, True, dtype)
        layer.use_quant_scheme(scheme, "experts")
        for expert in range(args.experts):
            for proj, (out, in_) in shapes.items():
                q, scale = quantize_symmetric(torch.randn(out, in_) * 0.02, bits, group)
                tensors = ({"weight": q, "weight_scale": scale.to(dtype)} if args.quant == "w8a8" else
                           {"weight_packed": pack_int32(q, bits), "weight_scale": scale.to(dtype),
                            "weight_shape": torch.tensor([out, in_])})
                for leaf, tensor in tensors.items():
                    name, shard = FusedMoE.checkpoint_name_to_param(f"mlp.experts.{expert}.{proj}.{leaf}")
                    param = getattr(layer, name.rpartition(".")[2])
                    param.weight_loader(param, tensor, shard)
        layer.bind_kernels(KernelBundle(attention=None, linear=None, layer_ops=None, gated_delta_rule=None,
                                        quant_linear={scheme: kernel}))
        if not layer.quant_grouped:
            raise SystemExit(f"{type(kernel).__name__} has no grouped form here ({args.quant}, {args.dtype}): "
                             "the compiled CPU kernels must load (python -m tengyun.platforms.cpu.native --build)")
        layers.append(layer)
    print(f"quantised experts: {scheme.description}, kernel {type(kernel).__name__}")
    return layers


def _tok_per_s(layers: list[FusedMoE], x: torch.Tensor, logits: torch.Tensor, min_s: float) -> float:
    """Tokens per second through every layer, calls repeated for at least ``min_s``."""
    def stack():
        for layer in layers:
            layer(x, logits)

    stack()  # warm-up
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_s:
        stack()
        calls += 1
    return x.shape[0] * calls / (time.perf_counter() - start)


def _checkpoint(args, folder: str) -> str:
    """A random Qwen3-MoE of the benchmark's shape (every layer sparse), saved with a byte tokenizer."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8, num_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=args.intermediate, norm_topk_prob=True,
        max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).to(torch.float32).save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({chr(i): i for i in range(256)} | {"<unk>": 256}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<unk>").save_pretrained(folder)
    return folder


def _engine_rates(args) -> None:
    """Output tok/s through LLM with the loop (graphs off) and the grouped kernel (graphs on)."""
    import tempfile

    from tengyun import LLM, SamplingParams
    from tengyun.platforms.cpu.platform import CpuPlatform

    grouping = FusedMoE._groups_quantised

    folder = _checkpoint(args, tempfile.mkdtemp(prefix="moe_grouped_"))
    if args.quant:  # `tengyun quantize`'s folder: every projection, the experts included
        from tengyun.ops.quantize import quantize_folder

        folder = str(quantize_folder(folder, folder + "_" + args.quant, args.quant, 32).out_dir)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    engines = {}
    for name in ("loop", "grouped"):
        # as the layer ran before: per-expert loop, host reads, no decode graphs
        if args.quant:
            FusedMoE._groups_quantised = (lambda self: False) if name == "loop" else grouping
        elif name == "loop":
            CpuPlatform.moe_kernel = lambda self, dtype: LoopMoe()
        else:
            del CpuPlatform.moe_kernel
        engines[name] = LLM(folder, dtype=args.dtype, max_model_len=256, kv_cache_memory="64MiB", max_num_seqs=16)
        print(f"{name}: decode graphs {'on' if engines[name].llm_engine.executor.runner.decode_graphs else 'off'}")
    print("| step | sequences | loop tok/s | grouped tok/s | grouped / loop |")
    print("|---|---|---|---|---|")
    for batch in (1, 16):
        prompts = [[(7 * i + j) % 250 + 1 for j in range(8)] for i in range(batch)]
        rates: dict[str, list[float]] = {name: [] for name in engines}
        tokens = {}
        for round_ in range(args.repeats):
            for name, llm in (engines.items() if round_ % 2 == 0 else reversed(engines.items())):
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                rates[name].append(batch * 64 / (time.perf_counter() - start))
                tokens[name] = [o.outputs[0].token_ids for o in outputs]
        loop, grouped = statistics.median(rates["loop"]), statistics.median(rates["grouped"])
        same = "same tokens" if tokens["loop"] == tokens["grouped"] else "TOKENS DIFFER"
        print(f"| decode (engine) | {batch} | {loop:.1f} | {grouped:.1f} | {grouped / loop:.2f}x ({same}) |",
              flush=True)


def _cpu() -> str:
    name = platform.processor() or "cpu"
    flags: set[str] = set()
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(isa)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--min-s", type=float, default=1.0, help="seconds per timed round")
    parser.add_argument("--engine", action="store_true", help="whole-model decode through LLM instead")
    parser.add_argument("--quant", choices=sorted(QUANT_SCHEMES),
                        help="quantised experts: loop vs grouped (with --engine: w4a16 or w8a8 only)")
    args = parser.parse_args()
    print(f"{_cpu()}, torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"{args.layers} layers x {args.experts} experts top {args.top_k}, hidden {args.hidden}, "
          f"expert intermediate {args.intermediate}; load average before: {os.getloadavg()[0]:.2f}")
    if args.engine:
        _engine_rates(args)
    elif args.quant:
        _quantised_rates(args)
    else:
        _layer_rates(args)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


def _layer_rates(args) -> None:
    dtype = getattr(torch, args.dtype)
    layers = _layers(args, dtype)
    kernels = {"loop": LoopMoe(), "grouped": TorchGroupedMoe()}
    print("| step | tokens | loop tok/s | grouped tok/s | grouped / loop |")
    print("|---|---|---|---|---|")
    for step, tokens in BATCHES:
        x = torch.randn(tokens, args.hidden, dtype=dtype)
        logits = torch.randn(tokens, args.experts, dtype=dtype)
        rates: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(args.repeats):
            for name, kernel in kernels.items():
                for layer in layers:
                    layer.moe_kernel = kernel
                rates[name].append(_tok_per_s(layers, x, logits, args.min_s))
        loop, grouped = statistics.median(rates["loop"]), statistics.median(rates["grouped"])
        print(f"| {step} | {tokens} | {loop:.1f} | {grouped:.1f} | {grouped / loop:.2f}x |", flush=True)



def _quantised_rates(args) -> None:
    """The same quantised layers with quant_grouped off (the per-expert loop) and on, alternating
    which goes first each round."""
    dtype = getattr(torch, args.dtype)
    layers = _quantised_layers(args, dtype)
    print("| step | tokens | loop tok/s | grouped tok/s | grouped / loop |")
    print("|---|---|---|---|---|")
    for step, tokens in BATCHES:
        x = torch.randn(tokens, args.hidden, dtype=dtype)
        logits = torch.randn(tokens, args.experts, dtype=dtype)
        rates: dict[str, list[float]] = {"loop": [], "grouped": []}
        for round_ in range(args.repeats):
            for name in (("loop", "grouped") if round_ % 2 == 0 else ("grouped", "loop")):
                for layer in layers:
                    layer.quant_grouped = name == "grouped"
                rates[name].append(_tok_per_s(layers, x, logits, args.min_s))
        loop, grouped = statistics.median(rates["loop"]), statistics.median(rates["grouped"])
        print(f"| {step} | {tokens} | {loop:.1f} | {grouped:.1f} | {grouped / loop:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
