"""`tengyun plan MODEL ...`: weights, KV cache and concurrency per card, with the arithmetic."""

from __future__ import annotations

import argparse
import json


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="capacity plan: weights per card, KV cache tokens, max concurrency, "
                                                "whether --max-model-len fits, the smallest TP x PP")
    parser.add_argument("model", help="a Hugging Face folder, or its config.json alone (no weights needed)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    parser.add_argument("--device-memory", default="64GiB", help="memory per card, e.g. 64GiB (Ascend 910B), 80GiB")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-memory", default=None,
                        help="KV budget per card given directly (as the engine's CPU flag): no weights taken off")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="auto", help="weights dtype (auto: the checkpoint's)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto: the model dtype")
    parser.add_argument("--activation-reserve", default=None, help="override the activation estimate, e.g. 2GiB")
    parser.add_argument("--devices-per-node", type=int, default=8, help="TP stays within a node in the search")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from tengyun.config import parse_size
    from tengyun.ops.plan import PlanRequest, make_plan, plan_json, read_model, report_lines, smallest_fit

    hf_config, checkpoint_bytes, name = read_model(args.model)
    for flag, value in (("--gpu-memory-utilization", args.gpu_memory_utilization),):
        if not 0 < value <= 1:
            raise ValueError(f"{flag} must be in (0, 1] (try 0.9); got {value}.")
    request = PlanRequest(
        tp=args.tensor_parallel_size, pp=args.pipeline_parallel_size,
        device_memory=parse_size(args.device_memory, "--device-memory"),
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=parse_size(args.kv_cache_memory, "--kv-cache-memory") if args.kv_cache_memory else None,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size, dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        activation_reserve=parse_size(args.activation_reserve, "--activation-reserve") if args.activation_reserve
        else None,
        devices_per_node=args.devices_per_node,
    )
    plan = make_plan(hf_config, request, checkpoint_bytes, name)
    fit = smallest_fit(hf_config, request, checkpoint_bytes)
    if args.json:
        print(json.dumps(plan_json(plan, fit), indent=2))
    else:
        print("\n".join(report_lines(plan, fit)))
    return 0 if plan.fits else 1
