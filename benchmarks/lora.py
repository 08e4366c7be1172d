"""LoRA's throughput cost on CPU: 32 requests spread over 4 adapters against the same 32 on the
base model (one engine, --max-loras 4, rank 16 adapters on every q/k/v/o/gate/up/down, made with
PEFT on the embedded SmolLM2-135M-Instruct, random non-zero B), output tokens per second, the
median of --repeats rounds alternating base and LoRA (each LoRA form of --forms in turn, the
order reversed every other round); then the batched products alone at SmolLM2's four LoRA layer
shapes over its 30 layers (a decode step of 32 tokens, a 2,048-token prefill): a loop over
requests against every form of layers/lora/kernels.py (--products-only for these alone).

    OMP_NUM_THREADS=2 python benchmarks/lora.py --dtype float32 --max-tokens 32
    # on a shared machine: one thread, CPU seconds, the forms side by side
    OMP_NUM_THREADS=1 python benchmarks/lora.py --max-tokens 32 --repeats 5 --cpu-time \
        --forms segmented grouped --skip-products
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tengyun import LLM, LoRARequest, SamplingParams
from tengyun.layers.lora.batch import LoRABatch
from tengyun.layers.lora.kernels import TORCH_LORA_KERNELS
from tengyun.models.model_source import resolve_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: Path, folder: Path, count: int, rank: int) -> list[LoRARequest]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    loras = []
    for i in range(count):
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                               LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
        model.save_pretrained(folder / f"adapter{i}")
        loras.append(LoRARequest(f"adapter{i}", i + 1, str(folder / f"adapter{i}")))
    return loras


def engine_rounds(args, loras: list[LoRARequest]) -> dict[str, list[float]]:
    """tok/s per round: "base", then one entry per LoRA form of --forms (the platform's choice when
    none is named), each round running them in turn, the order reversed every other round."""
    llm = LLM(enable_lora=True, max_loras=len(loras), max_lora_rank=args.rank, dtype=args.dtype,
              max_model_len=512, enable_prefix_caching=False)
    layers = llm.llm_engine.executor.lora.layers.values()  # the in-process worker's LoRA linears
    prompts = [[(17 * i + 31 * j) % 40000 + 100 for j in range(args.prompt_len)] for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    per_request = [loras[i % len(loras)] for i in range(args.requests)]
    llm.generate(prompts[:4], params, lora_request=per_request[:4])  # warm-up: every adapter read once
    chosen = next(iter(layers)).lora.kernel
    forms = {name: TORCH_LORA_KERNELS[name]() for name in args.forms} if args.forms else {chosen.name: chosen}
    runs = [("base", None, None)] + [(f"lora {name}", per_request, kernel) for name, kernel in forms.items()]
    rates: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for round_ in range(args.repeats):
        for name, loras_for, kernel in runs if round_ % 2 == 0 else runs[::-1]:
            for linear in layers:
                linear.lora.kernel = kernel or chosen
            started = args.clock()
            outputs = llm.generate(prompts, params, lora_request=loras_for, use_tqdm=False)
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outputs) / (args.clock() - started))
    return rates


SHAPES = {  # SmolLM2-135M's LoRA layers: (in, each slice's output columns)
    "qkv": (576, [(0, 576), (576, 768), (768, 960)]), "o": (576, [(0, 576)]),
    "gate_up": (576, [(0, 1536), (1536, 3072)]), "down": (1536, [(0, 576)]),
}


def product_rounds(args, dtype: torch.dtype, tokens: int) -> dict[str, dict[str, float]]:
    """Milliseconds per step of the LoRA products alone, per SmolLM2 layer kind summed over its 30
    layers (each layer its own slots, as a step reads them: cold caches) and in all, for ``tokens``
    tokens over 32 requests on 4 adapters; the forms interleaved, their order rotated every round."""
    torch.manual_seed(0)
    per_request, num_layers = tokens // 32, 30
    token_slots = torch.arange(32).repeat_interleave(per_request) % args.adapters
    batch = LoRABatch.build(token_slots, args.adapters)
    layers = []
    for name, (in_, columns) in SHAPES.items():
        rows, out = len(columns) * args.rank, columns[-1][1]
        b = torch.zeros(num_layers, args.adapters, rows, out, dtype=dtype)
        for s, (start, end) in enumerate(columns):  # block-diagonal, as layer.py stores a fused layer
            b[:, :, s * args.rank:(s + 1) * args.rank, start:end].normal_()
        a = torch.randn(num_layers, args.adapters, rows, in_, dtype=dtype)
        x, y = torch.randn(len(token_slots), in_, dtype=dtype), torch.zeros(len(token_slots), out, dtype=dtype)
        layers += [(name, a[i], b[i], x, y, columns if len(columns) > 1 else None) for i in range(num_layers)]

    def loop(x, y, a, b, batch, columns):  # one pair of matmuls per request
        for r in range(32):
            rows_ = slice(r * per_request, (r + 1) * per_request)
            y[rows_] += (x[rows_] @ a[r % args.adapters].t()) @ b[r % args.adapters]
        return y

    forms = {"per-request loop": loop}
    forms.update({name: cls().add for name, cls in TORCH_LORA_KERNELS.items() if name != "gathered" or tokens <= 32})
    samples = {name: {kind: [] for kind in [*SHAPES, "all"]} for name in forms}
    names = list(forms)
    for round_ in range(args.repeats * 3 + 1):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            spent = dict.fromkeys(SHAPES, 0.0)
            for kind, a, b, x, y, columns in layers:
                started = time.perf_counter()
                forms[name](x, y, a, b, batch, columns)
                spent[kind] += time.perf_counter() - started
            if round_:  # the first round warms up
                for kind, seconds in spent.items():
                    samples[name][kind].append(seconds * 1e3)
                samples[name]["all"].append(sum(spent.values()) * 1e3)
    return {name: {kind: statistics.median(v) for kind, v in kinds.items()} for name, kinds in samples.items()}


def engine_report(args) -> None:
    with tempfile.TemporaryDirectory() as folder:
        loras = make_adapters(resolve_model(None).folder, Path(folder), args.adapters, args.rank)
        rates = engine_rounds(args, loras)
    base_rounds = rates.pop("base")
    base = statistics.median(base_rounds)
    print(f"{args.requests} requests x {args.max_tokens} tokens over {args.adapters} adapters, median of "
          f"{args.repeats} rounds; base {base:.1f} tok/s (rounds {[round(r) for r in base_rounds]})")
    for name, rounds in rates.items():
        rate = statistics.median(rounds)
        paired = statistics.median(1 - r / b for r, b in zip(rounds, base_rounds))  # each round against its own base
        print(f"  {name}: {rate:.1f} tok/s, {(1 - rate / base) * 100:.1f}% slower than the base "
              f"(rounds {[round(r) for r in rounds]}; median per round {paired * 100:.1f}%)")
    print(f"# load average {os.getloadavg()[0]:.2f} after the engine rounds")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--forms", nargs="*", choices=list(TORCH_LORA_KERNELS),
                        help="LoRA forms to run in the engine, interleaved with the base model (default: the "
                             "platform's choice)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="tokens per CPU second of this process (time.process_time) instead of per wall "
                             "second: steadier on a shared machine, meaningful with OMP_NUM_THREADS=1")
    parser.add_argument("--skip-products", action="store_true", help="only the engine rounds")
    parser.add_argument("--products-only", action="store_true", help="only the products alone")
    args = parser.parse_args()
    args.clock = time.process_time if args.cpu_time else time.perf_counter
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, {args.dtype}, {'CPU' if args.cpu_time else 'wall'} time, "
          f"load average {os.getloadavg()[0]:.2f} at the start")
    if not args.products_only:
        engine_report(args)
    if args.skip_products:
        return
    for tokens in (32, 32 * args.prompt_len):
        times = product_rounds(args, getattr(torch, args.dtype), tokens)
        print(f"LoRA products alone, {tokens} tokens, ms per step (120 layers; qkv / o / gate_up / down):")
        for name, kinds in times.items():
            print(f"  {name}: {kinds['all']:.2f} (" + " / ".join(f"{kinds[k]:.2f}" for k in SHAPES) + ")")
    print(f"# load average {os.getloadavg()[0]:.2f} at the end")

if __name__ == "__main__":
    main()
