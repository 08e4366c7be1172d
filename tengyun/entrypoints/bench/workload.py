"""Workload flags shared by `bench serve` and `bench throughput` (vLLM's names and aliases), and
the request list they describe."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tengyun.ops.bench import BenchRequest, jsonl_requests, random_requests

SHARED_PREFIX_DEFAULT_LEN = 1024


def add_workload_args(parser: argparse.ArgumentParser, seed: bool = True) -> None:
    """seed=False where the parser already has --seed (the engine flags): both use it."""
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset", "--dataset-name", dest="dataset", default="random",
                       help="random (random token ids), shared-prefix (random prompts behind one long shared "
                            "prefix), or a .jsonl file with one {\"prompt\": ...} per line (also: "
                            "--dataset-name custom --dataset-path FILE)")
    group.add_argument("--dataset-path", default=None, help="the JSONL file, with --dataset-name jsonl|custom")
    group.add_argument("--num-prompts", type=int, default=1000)
    group.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=1024,
                       help="prompt tokens (after the shared prefix, if any)")
    group.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=128,
                       help="max_tokens of each request (exact with --ignore-eos)")
    group.add_argument("--prefix-len", "--random-prefix-len", dest="prefix_len", type=int, default=None,
                       help=f"tokens of the prefix every prompt shares (random: 0, shared-prefix: "
                            f"{SHARED_PREFIX_DEFAULT_LEN})")
    group.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float, default=0.0,
                       help="input/output lengths uniform in [len * (1 - r), len * (1 + r)]")
    if seed:
        group.add_argument("--seed", type=int, default=0, help="seed of the random prompts and arrivals")


def dataset_kind(args: argparse.Namespace) -> str:
    """'random', 'shared-prefix' or 'jsonl'."""
    if args.dataset in ("random", "shared-prefix"):
        return args.dataset
    if args.dataset in ("jsonl", "custom"):
        if not args.dataset_path:
            raise ValueError(f"--dataset-name {args.dataset} needs --dataset-path FILE.jsonl.")
        return "jsonl"
    if Path(args.dataset).suffix == ".jsonl":
        return "jsonl"
    raise ValueError(f"--dataset {args.dataset!r}: use random, shared-prefix or a path to a .jsonl file.")


def jsonl_path(args: argparse.Namespace) -> Path:
    return Path(args.dataset_path if args.dataset in ("jsonl", "custom") else args.dataset)


def build_requests(args: argparse.Namespace, tokenizer: Any) -> list[BenchRequest]:
    for flag, value in (("--num-prompts", args.num_prompts), ("--output-len", args.output_len)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}.")
    if not 0 <= args.range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {args.range_ratio}.")
    kind = dataset_kind(args)
    if kind == "jsonl":
        path = jsonl_path(args)
        if not path.is_file():
            raise FileNotFoundError(f"--dataset {path}: no such file")
        return jsonl_requests(path, args.num_prompts, args.output_len,
                              lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    prefix_len = shared_prefix_len(args)
    if args.input_len < 1 or prefix_len < 0:
        raise ValueError(f"--input-len must be at least 1 and --prefix-len at least 0, got "
                         f"{args.input_len} and {prefix_len}.")
    return random_requests(args.num_prompts, args.input_len, args.output_len, len(tokenizer),
                           prefix_len=prefix_len, range_ratio=args.range_ratio,
                           special_ids=set(tokenizer.all_special_ids), seed=args.seed)


def shared_prefix_len(args: argparse.Namespace) -> int:
    if args.prefix_len is not None:
        return args.prefix_len
    return SHARED_PREFIX_DEFAULT_LEN if dataset_kind(args) == "shared-prefix" else 0


def load_tokenizer(name: str, trust_remote_code: bool = False) -> Any:
    """A tokenizer for an HF folder, a .gguf file or an embedded model id (as `tengyun serve`
    resolves MODEL), else whatever transformers finds under that name."""
    from transformers import AutoTokenizer

    try:
        from tengyun.models.model_source import resolve_model

        folder = resolve_model(name, "dummy").tokenizer_folder
    except (ValueError, FileNotFoundError):
        folder = name
    return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
