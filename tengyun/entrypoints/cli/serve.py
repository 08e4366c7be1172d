"""`tengyun serve [MODEL] [flags]`: the OpenAI-compatible server (see entrypoints/openai/)."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    from tengyun.entrypoints.openai.cli_args import make_arg_parser

    parser = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, "
                                                 "/v1/chat/completions, /health, /metrics, ...)")
    make_arg_parser(parser)


def run(args: argparse.Namespace) -> int:
    import sys

    from tengyun.entrypoints.openai.api_server import run_server
    from tengyun.platforms.startup import DeviceStartupError

    try:
        return run_server(args)
    except (FileNotFoundError, DeviceStartupError) as e:  # a MODEL path that does not exist; an unusable device
        print(f"error: {e}", file=sys.stderr)
        return 2
