"""`tengyun` command line: one subcommand module each."""

from __future__ import annotations

import importlib
import sys

from tengyun.entrypoints.cli.flexible_parser import FlexibleArgumentParser
from tengyun.logging_config import configure_logging
from tengyun.platforms.cpu.runtime import tcmalloc_preload
from tengyun.platforms.startup import DeviceStartupError

# name -> module exposing add_parser(subparsers) and run(args) -> int
SUBCOMMANDS = {
    "generate": "tengyun.entrypoints.cli.generate",
    "serve": "tengyun.entrypoints.cli.serve",
    "doctor": "tengyun.entrypoints.cli.doctor",
    "plan": "tengyun.entrypoints.cli.plan",
    "rank-table": "tengyun.entrypoints.cli.rank_table",
    "bench": "tengyun.entrypoints.cli.bench",
    "supervise": "tengyun.entrypoints.cli.supervise",
    "deploy": "tengyun.entrypoints.cli.deploy",
    "launch": "tengyun.entrypoints.cli.launch",
    "quantize": "tengyun.entrypoints.cli.quantize",
}


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    if argv is None and sys.argv[1:2] == ["serve"]:  # the process's own command line: it may re-execute
        tcmalloc_preload.reexec_or_exit(sys.argv[2:])
    parser = FlexibleArgumentParser(prog="tengyun", description="Tengyun LLM inference and serving.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    modules = {name: importlib.import_module(path) for name, path in SUBCOMMANDS.items()}
    for module in modules.values():
        module.add_parser(subparsers)
    args = parser.parse_args(argv)
    try:
        return modules[args.command].run(args) or 0
    except (ValueError, FileNotFoundError, DeviceStartupError) as e:  # bad settings, paths or device: say what
        # to change, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
