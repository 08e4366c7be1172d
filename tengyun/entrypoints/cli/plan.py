"""`tengyun plan MODEL ...`: weights, KV cache and concurrency per card, with the arithmetic.

The settings plan shares with `tengyun serve` are the engine's own flags, generated from the same
EngineConfig fields (same names, defaults, help), and resolved as the engine resolves them."""

from __future__ import annotations

import argparse
import json

# EngineConfig fields `tengyun plan` takes, as `tengyun serve` spells them.
ENGINE_SETTINGS = ("dtype", "kv_cache_dtype", "block_size", "max_model_len", "max_num_seqs",
                   "max_num_batched_tokens", "gpu_memory_utilization", "kv_cache_memory",
                   "tensor_parallel_size", "pipeline_parallel_size", "enable_prefix_caching", "quantization",
                   "speculative_config")
PLANNED_DEVICES = ("npu", "cuda", "cpu")


def add_parser(subparsers) -> None:
    from tengyun.config import EngineConfig
    from tengyun.entrypoints.cli.engine_args import add_dataclass_flags

    parser = subparsers.add_parser("plan", help="capacity plan: weights per card, KV cache tokens, max concurrency, "
                                                "whether --max-model-len fits, the smallest TP x PP")
    parser.add_argument("model", help="a Hugging Face folder, or its config.json alone (no weights needed), or a "
                                       ".gguf file (converted as the engine converts it)")
    parser.add_argument("--device", default=None, choices=PLANNED_DEVICES,
                        help="the platform planned for: what --dtype auto and --block-size default to there "
                             "(default: npu; cpu with --kv-cache-memory)")
    parser.add_argument("--device-memory", default="64GiB", help="memory per card, e.g. 64GiB (Ascend 910B), 80GiB")
    add_dataclass_flags(parser, EngineConfig, only=ENGINE_SETTINGS)
    parser.add_argument("--activation-reserve", default=None, help="override the activation estimate, e.g. 2GiB")
    parser.add_argument("--devices-per-node", type=int, default=8, help="TP stays within a node in the search")
    parser.add_argument("--json", action="store_true")


def plan_request(args: argparse.Namespace, hf_config: dict | None = None):
    """The PlanRequest for parsed `tengyun plan` flags; engine settings checked as EngineConfig checks
    them, block size and batched tokens defaulted as the engine on that device defaults them; with
    --speculative-config method mtp, the MTP head's layers of the model (``hf_config``, read from
    args.model) as the engine counts them."""
    from tengyun.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig, parse_size
    from tengyun.entrypoints.cli.engine_args import dataclass_kwargs
    from tengyun.ops.plan import PlanRequest
    from tengyun.platforms import platform_class

    settings = EngineConfig(**dataclass_kwargs(EngineConfig, args, only=ENGINE_SETTINGS))  # validates the values
    device = args.device or ("cpu" if settings.kv_cache_memory is not None else "npu")
    block_size = settings.block_size or platform_class(device).default_block_size
    if not isinstance(block_size, int):  # CUDA's depends on flash-attn on the serving machine
        block_size = 16
    return PlanRequest(
        tp=settings.tensor_parallel_size, pp=settings.pipeline_parallel_size,
        device_memory=parse_size(args.device_memory, "--device-memory"),
        gpu_memory_utilization=settings.gpu_memory_utilization, kv_cache_memory=settings.kv_cache_memory,
        max_model_len=settings.max_model_len, max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
        block_size=block_size, dtype=settings.dtype, kv_cache_dtype=settings.kv_cache_dtype, device=device,
        activation_reserve=parse_size(args.activation_reserve, "--activation-reserve") if args.activation_reserve
        else None,
        devices_per_node=args.devices_per_node, enable_prefix_caching=settings.enable_prefix_caching,
        mtp_layers=_mtp_layers(settings.speculative_config, hf_config, args.model),
    )


def _mtp_layers(speculative, hf_config: dict | None, model: str) -> int:
    """The MTP layers the engine would run for --speculative-config (0 unless method mtp)."""
    from pathlib import Path

    from tengyun.model_spec import ModelSpec, mtp_layers_for_speculation

    if speculative is None or speculative.method != "mtp" or hf_config is None:
        return 0
    path = Path(model)
    folder = path if path.is_dir() else None  # a config.json alone: its count only
    return mtp_layers_for_speculation(ModelSpec.from_hf_config(hf_config), folder, speculative.num_speculative_tokens)


def _gguf_folder(gguf_file: str, quantization: str | None) -> str:
    """A .gguf -> the folder the engine converts it into (once, cached): kept quantised with
    --quantization gguf, else dequantized."""
    from tengyun.models.model_source import resolve_model

    return str(resolve_model(gguf_file, quantization=quantization).folder)


def run(args: argparse.Namespace) -> int:
    from tengyun.ops.plan import make_plan, plan_json, read_model, read_quantization, report_lines, smallest_fit

    model = _gguf_folder(args.model, args.quantization) if args.model.endswith(".gguf") else args.model
    hf_config, checkpoint_bytes, name = read_model(model)
    quant = read_quantization(model, hf_config, args.quantization)
    request = plan_request(args, hf_config)
    plan = make_plan(hf_config, request, checkpoint_bytes, name, quant)
    fit = smallest_fit(hf_config, request, checkpoint_bytes, quant)
    if args.json:
        print(json.dumps(plan_json(plan, fit), indent=2))
    else:
        print("\n".join(report_lines(plan, fit)))
    return 0 if plan.fits else 1
