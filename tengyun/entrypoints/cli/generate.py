"""`tengyun generate PROMPT [MODEL] [flags]`: one offline chat turn, answer printed."""

from __future__ import annotations

import argparse

from tengyun.entrypoints.cli.engine_args import add_engine_args, config_from_args


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="answer one prompt offline (chat template applied)")
    parser.add_argument("prompt")
    add_engine_args(parser)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--raw", action="store_true", help="complete the prompt as-is, no chat template")


def run(args: argparse.Namespace) -> int:
    from tengyun.entrypoints.llm import LLM
    from tengyun.sampling_params import SamplingParams

    llm = LLM.from_config(config_from_args(args))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    if args.raw:
        output = llm.generate(args.prompt, params)[0]
    else:
        output = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    print(output.outputs[0].text)
    return 0
