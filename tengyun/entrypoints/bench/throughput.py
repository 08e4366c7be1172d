r"""`tengyun bench throughput`: the workload offline through the LLM class, all requests at once.

    tengyun bench throughput --model Qwen/Qwen2.5-Coder-0.5B-Instruct --dataset random \
        --input-len 128 --output-len 128 --num-prompts 64
    tengyun bench throughput --dataset shared-prefix --prefix-len 1024 --input-len 32 \
        --output-len 16 --num-prompts 32 --compare-prefix-caching

Sampling as `vllm bench throughput`: temperature 1.0, top_p 1.0, ignore_eos, max_tokens =
output length. With the shared-prefix workload one warm-up request carries the shared prefix
first, so with prefix caching on the measured requests find it cached (a hot system prompt).
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import time

from tengyun.entrypoints.bench.workload import (
    add_workload_args, build_requests, dataset_kind, shared_prefix_len,
)
from tengyun.entrypoints.cli.engine_args import add_engine_args, config_from_args
from tengyun.ops.bench import BenchRequest, RequestResult, compute_metrics, random_requests


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    add_workload_args(parser, seed=False)  # the engine's --seed seeds the prompts too
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--compare-prefix-caching", action="store_true",
                        help="run twice, prefix caching on then off, and compare TTFT")
    parser.add_argument("--output-json", default=None, help="write the results here")
    parser.add_argument("--disable-tqdm", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.compare_prefix_caching:
        runs = {"prefix caching on": _run_once(args, True), "prefix caching off": _run_once(args, False)}
    else:
        runs = {"": _run_once(args, args.enable_prefix_caching)}
    for label, result in runs.items():
        print(format_throughput(result, label))
    if args.compare_prefix_caching:
        on, off = runs["prefix caching on"], runs["prefix caching off"]
        print(f"TTFT mean, prefix caching off / on: {off['mean_ttft_ms']:.1f} ms / {on['mean_ttft_ms']:.1f} ms "
              f"= {off['mean_ttft_ms'] / max(on['mean_ttft_ms'], 1e-9):.2f}x lower with it on")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "func"}, "runs": runs}, f, indent=2,
                      default=str)
    return 0


def _run_once(args: argparse.Namespace, prefix_caching: bool) -> dict:
    from tengyun.entrypoints.llm import LLM
    from tengyun.sampling_params import SamplingParams

    config = config_from_args(args)
    config.enable_prefix_caching = prefix_caching
    llm = LLM.from_config(config)
    tokenizer = llm.get_tokenizer()
    requests = build_requests(args, tokenizer)
    params = [SamplingParams(temperature=args.temperature, top_p=1.0, ignore_eos=True, max_tokens=r.output_len)
              for r in requests]
    llm.generate([_prompt(r) for r in warm_up_requests(args, tokenizer, requests)],
                 SamplingParams(max_tokens=4, ignore_eos=True))
    start_stats = llm.llm_engine.get_stats()
    start = time.perf_counter()
    outputs = llm.generate([_prompt(r) for r in requests], params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - start
    stats = llm.llm_engine.get_stats()
    result = compute_metrics(results_from_outputs(outputs), elapsed)
    queries = stats.prefix_cache_queries - start_stats.prefix_cache_queries
    result.update({
        "enable_prefix_caching": prefix_caching,
        "prefix_cache_hit_rate":
            (stats.prefix_cache_hits - start_stats.prefix_cache_hits) / queries if queries else 0.0,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    })
    del llm, outputs
    gc.collect()
    return result


def warm_up_requests(args: argparse.Namespace, tokenizer, requests: list[BenchRequest]) -> list[BenchRequest]:
    """Two short random prompts; with a shared prefix, one prompt of that prefix and a suffix of
    its own, so the measured requests find the prefix cached when prefix caching is on."""
    special_ids = set(tokenizer.all_special_ids)
    prefix_len = shared_prefix_len(args) if dataset_kind(args) != "jsonl" else 0
    if prefix_len == 0:
        return random_requests(2, 8, 4, len(tokenizer), special_ids=special_ids, seed=args.seed + 1)
    own = random_requests(1, args.input_len, 4, len(tokenizer), special_ids=special_ids, seed=args.seed + 1)[0]
    return [BenchRequest(requests[0].prompt[:prefix_len] + own.prompt, prefix_len + own.prompt_len, 4)]


def results_from_outputs(outputs) -> list[RequestResult]:
    """Engine timestamps -> RequestResult (no per-chunk gaps offline, so no ITL)."""
    start = min(o.metrics.arrival_time for o in outputs)
    results = []
    for o in outputs:
        m = o.metrics
        results.append(RequestResult(
            success=True, prompt_len=len(o.prompt_token_ids), output_len=len(o.outputs[0].token_ids),
            ttft=m.first_token_time - m.arrival_time, latency=(m.finished_time or m.last_token_time) - m.arrival_time,
            start_time=m.arrival_time - start))
    return results


def _prompt(request: BenchRequest) -> dict:
    key = "prompt" if isinstance(request.prompt, str) else "prompt_token_ids"
    return {key: request.prompt}


def format_throughput(r: dict, label: str = "") -> str:
    """vLLM's throughput line, then the latency figures the LLM class can time."""
    head = f"[{label}] " if label else ""
    lines = [
        f"{head}Throughput: {r['request_throughput']:.2f} requests/s, {r['total_token_throughput']:.2f} total "
        f"tokens/s, {r['output_throughput']:.2f} output tokens/s",
        f"{head}Total num prompt tokens: {r['total_input_tokens']}, total num output tokens: "
        f"{r['total_output_tokens']}, elapsed {r['duration']:.2f} s, prefix cache hit rate "
        f"{100 * r['prefix_cache_hit_rate']:.1f}%, peak RSS {r['peak_rss_mib']:.0f} MiB",
    ]
    for name, short in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2E")):
        lines.append(f"{head}{short} ms: mean {r[f'mean_{name}_ms']:.1f}, median {r[f'median_{name}_ms']:.1f}, "
                     f"P90 {r[f'p90_{name}_ms']:.1f}, P99 {r[f'p99_{name}_ms']:.1f}")
    return "\n".join(lines)
