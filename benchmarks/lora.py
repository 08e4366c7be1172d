"""LoRA's throughput cost on CPU: 32 requests spread over 4 adapters against the same 32 on the
base model (one engine, --max-loras 4, rank 16 adapters on every q/k/v/o/gate/up/down, made with
PEFT on the embedded SmolLM2-135M-Instruct, random non-zero B), output tokens per second, the
median of --repeats rounds alternating base and LoRA (each LoRA form of --forms in turn, the
order reversed every other round); then the batched product alone at SmolLM2's gate_up shape: a
loop over requests against every form of layers/lora/kernels.py.

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


def product_rounds(args, dtype: torch.dtype, tokens: int) -> dict[str, float]:
    """Milliseconds per call of the LoRA product of SmolLM2's gate_up (576 -> 2 x 1536, 2 slices)
    for ``tokens`` tokens over 32 requests on 4 adapters."""
    torch.manual_seed(0)
    slots, rows, in_, out = 4, 2 * args.rank, 576, 3072
    a, b = torch.randn(slots, rows, in_, dtype=dtype), torch.randn(slots, rows, out, dtype=dtype)
    per_request = tokens // 32
    token_slots = torch.arange(32).repeat_interleave(per_request) % slots
    x = torch.randn(len(token_slots), in_, dtype=dtype)
    batch = LoRABatch.build(token_slots, slots)

    def loop():  # one pair of matmuls per request
        out_ = x.new_zeros(len(token_slots), out)
        for r in range(32):
            rows_ = slice(r * per_request, (r + 1) * per_request)
            out_[rows_] = (x[rows_] @ a[r % slots].t()) @ b[r % slots]
        return out_

    kernels = {name: cls() for name, cls in TORCH_LORA_KERNELS.items()}
    forms = {"per-request loop": loop}
    forms.update({name: (lambda k=kernel: k.add(x, x.new_zeros(len(x), out), a, b, batch))
                  for name, kernel in kernels.items()})
    times = {}
    for name, run in forms.items():
        run()
        samples = []
        for _ in range(args.repeats * 5):
            started = time.perf_counter()
            run()
            samples.append((time.perf_counter() - started) * 1e3)
        times[name] = statistics.median(samples)
    return times


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
    args = parser.parse_args()
    args.clock = time.process_time if args.cpu_time else time.perf_counter
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, {args.dtype}, {'CPU' if args.cpu_time else 'wall'} time, "
          f"load average {os.getloadavg()[0]:.2f} at the start")
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
    print(f"# load average {os.getloadavg()[0]:.2f} at the end")
    if args.skip_products:
        return
    for tokens in (32, 32 * args.prompt_len):
        times = product_rounds(args, getattr(torch, args.dtype), tokens)
        print(f"gate_up LoRA product, {tokens} tokens: " + ", ".join(f"{k} {v:.3f} ms" for k, v in times.items()))


if __name__ == "__main__":
    main()
