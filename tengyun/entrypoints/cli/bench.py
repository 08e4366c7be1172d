"""`tengyun bench serve|throughput`: load-test a server, or measure offline throughput."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    from tengyun.entrypoints.bench import serve, throughput

    parser = subparsers.add_parser("bench", help="benchmarks: `bench serve` (any OpenAI-compatible server), "
                                                 "`bench throughput` (offline, LLM class)")
    modes = parser.add_subparsers(dest="bench_command", required=True)
    serve.add_cli_args(modes.add_parser(
        "serve", help="streaming load test: TTFT, TPOT, ITL, E2E latency, throughput, goodput",
        description=serve.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    throughput.add_cli_args(modes.add_parser(
        "throughput", help="offline throughput through the LLM class",
        description=throughput.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))


def run(args: argparse.Namespace) -> int:
    from tengyun.entrypoints.bench import serve, throughput

    return (serve if args.bench_command == "serve" else throughput).run(args)
