"""`tengyun plan MODEL ...`: weights, KV cache and concurrency per card, with the arithmetic.

The settings plan shares with `tengyun serve` are the engine's own flags, generated from the same
EngineConfig fields (same names, defaults, help), and resolved as the engine resolves them."""

from __future__ import annotations

import argparse
import json

# EngineConfig fields `tengyun plan` takes, as `tengyun serve` spells them.
ENGINE_SETTINGS = ("dtype", "kv_cache_dtype", "block_size", "max_model_len", "max_num_seqs",
                   "max_num_batched_tokens", "enable_chunked_prefill", "gpu_memory_utilization", "kv_cache_memory",
                   "num_gpu_blocks_override", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                   "enable_prefix_caching", "quantization", "speculative_config", "enable_expert_parallel",
                   "runner", "convert", "hf_overrides", "enable_lora", "max_loras", "max_lora_rank", "lora_dtype")
PLANNED_DEVICES = ("npu", "cuda", "cpu")


def add_parser(subparsers) -> None:
    from tengyun.config import EngineConfig
    from tengyun.entrypoints.cli.engine_args import add_dataclass_flags
    from tengyun.sizing.plan import Cards

    parser = subparsers.add_parser("plan", help="capacity plan: weights per card, KV cache tokens, max concurrency, "
                                                "whether --max-model-len fits, the smallest TP x PP")
    parser.add_argument("model", help="a Hugging Face folder, or its config.json alone (no weights needed), or a "
                                       ".gguf file (converted as the engine converts it)")
    parser.add_argument("--device", default=None, choices=PLANNED_DEVICES,
                        help="the platform planned for: what --dtype auto and --block-size default to there "
                             "(default: npu; cpu with --kv-cache-memory)")
    parser.add_argument("--device-memory", default=f"{Cards.memory // 2**30}GiB",
                        help="memory per card, e.g. 64GiB (Ascend 910B), 80GiB")
    add_dataclass_flags(parser, EngineConfig, only=ENGINE_SETTINGS)
    parser.add_argument("--activation-reserve", default=None, help="override the activation estimate, e.g. 2GiB")
    parser.add_argument("--devices-per-node", type=int, default=Cards.per_node,
                        help="TP stays within a node in the search")
    parser.add_argument("--profile-json", default=None, metavar="FILE",
                        help="a running server's GET /health/detail saved to a file: the plan says how its "
                             "activation estimate and weights compare with what that engine measured")
    parser.add_argument("--compare", nargs="+", default=None, metavar="LAYOUT",
                        help="plan these layouts of the cards side by side instead, e.g. tp8-pp4 dp4-tp8-ep "
                             "(dash-separated tpN, ppN, dpN, and ep for --enable-expert-parallel)")
    parser.add_argument("--json", action="store_true")


def plan_settings(args: argparse.Namespace, hf_config: dict, folder):
    """(ResolvedSizing, Cards) for parsed `tengyun plan` flags: the engine's settings checked by
    EngineConfig and resolved by the engine's own resolve (sizing.resolve_sizing) for --device,
    without the device being here; ``folder``: the model's (None: a config.json alone)."""
    from tengyun.config import EngineConfig, parse_size
    from tengyun.entrypoints.cli.engine_args import dataclass_kwargs
    from tengyun.model_spec import ModelSpec
    from tengyun.pooling_config import apply_hf_overrides
    from tengyun.sizing.plan import Cards
    from tengyun.sizing.resolve import resolve_sizing

    settings = EngineConfig(**dataclass_kwargs(EngineConfig, args, only=ENGINE_SETTINGS))  # validates the values
    settings.usage_context = "api_server"  # a plan is for `tengyun serve`: its default step budget
    hf_config.update(apply_hf_overrides(hf_config, settings.hf_overrides))  # the config the engine reads, in place
    device = args.device or ("cpu" if settings.kv_cache_memory is not None else "npu")
    sizing = resolve_sizing(settings, ModelSpec.from_hf_config(hf_config), device, folder)
    reserve = args.activation_reserve
    cards = Cards(memory=parse_size(args.device_memory, "--device-memory"), per_node=args.devices_per_node,
                  activation_reserve=parse_size(reserve, "--activation-reserve") if reserve else None)
    return sizing, cards


def _gguf_folder(gguf_file: str, quantization: str | None) -> str:
    """A .gguf -> the folder the engine converts it into (once, cached): kept quantised with
    --quantization gguf, else dequantized."""
    from tengyun.models.model_source import resolve_model

    return str(resolve_model(gguf_file, quantization=quantization).folder)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tengyun.ops.plan import plan_json, report_lines, smallest_fit
    from tengyun.sizing.checkpoint import read_model, read_quantization
    from tengyun.sizing.plan import make_plan

    model = _gguf_folder(args.model, args.quantization) if args.model.endswith(".gguf") else args.model
    hf_config, checkpoint_bytes, name = read_model(model)
    quant = read_quantization(model, hf_config, args.quantization)
    sizing, cards = plan_settings(args, hf_config, Path(model) if Path(model).is_dir() else None)
    if args.compare:
        return _compare(args, hf_config, sizing, cards, checkpoint_bytes, name, quant)
    plan = make_plan(hf_config, sizing, cards, checkpoint_bytes, name, quant)
    fit = smallest_fit(hf_config, sizing, cards, checkpoint_bytes, quant)
    profile = None
    if args.profile_json:
        from dataclasses import replace

        from tengyun.ops.plan_profile import compare, read_profile

        profile = compare(plan, read_profile(args.profile_json), lambda activation: make_plan(
            hf_config, sizing, replace(cards, activation_reserve=activation), checkpoint_bytes, name, quant))
    if args.json:
        print(json.dumps(plan_json(plan, fit) | ({"profile": profile} if profile else {}), indent=2))
    else:
        from tengyun.ops.plan_profile import profile_lines

        print("\n".join(report_lines(plan, fit) + (profile_lines(profile) if profile else [])))
    return 0 if plan.fits else 1


def _compare(args: argparse.Namespace, hf_config: dict, sizing, cards, checkpoint_bytes, name: str, quant) -> int:
    """--compare: one column per layout (ops/plan_compare.py); exit 0 when every layout fits."""
    from tengyun.model_spec import ModelSpec
    from tengyun.ops.plan_compare import comparison_lines, layout_plans

    plans = layout_plans(hf_config, sizing, args.compare, cards, checkpoint_bytes, name, quant)
    if args.json:
        from tengyun.ops.plan import plan_json

        print(json.dumps([plan_json(plan, None) for plan in plans], indent=2))
    else:
        moe = ModelSpec.from_hf_config(hf_config).moe
        print(f"Model {name}: the layouts side by side (--max-model-len {sizing.max_model_len:,}, "
              f"{cards.memory / 2**30:.0f} GiB cards)")
        print("\n".join(comparison_lines(plans, args.compare, moe.num_experts if moe else None)))
    return 0 if all(plan.fits for plan in plans) else 1
