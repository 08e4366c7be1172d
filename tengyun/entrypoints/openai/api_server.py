"""`tengyun serve` / `python -m tengyun.entrypoints.openai.api_server`: the OpenAI-compatible
HTTP server (FastAPI + uvicorn) in front of AsyncLLMEngine. This module only wires the parts:

    ServerConfig + EngineConfig (flags, cli_args.py) -> the engine process, forked
      -> http_server.py (imported after the fork): EngineMetrics (one registry) -> ServerLifecycle
      -> EngineHost (engine_host.py) -> the app (routes.py) -> DrainingServer (draining_server.py)

Life of the process:
    bind the port at once (/health 503) -> load weights and KV cache in a thread -> warm-up
    generation -> /health 200 -> ... -> SIGTERM: /health and new requests 503, in-flight ones
    finish (aborted after --shutdown-timeout) -> exit 0.  Engine loop died: exit 1.

--api-server-count N above 1: a supervisor runs N such processes on the port in front of one
engine process (api_server_pool.py, pooled_api_server.py). --headless: this node's ranks of a
multi-node launch (headless_server.py), or with --data-parallel-size its replicas for another
node's API server (headless_replica_node.py); no OpenAI API here either way.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # its own command line: re-execute under tcmalloc before the server's imports
    # (~0.7 s on 2 cores), which the re-executed process would otherwise make a second time
    from tengyun.platforms.cpu.runtime.tcmalloc_preload import reexec_or_exit

    reexec_or_exit(sys.argv[1:])

import argparse

from tengyun.engine.engine_process import launch_for_server
from tengyun.entrypoints.cli.flexible_parser import FlexibleArgumentParser
from tengyun.entrypoints.openai.cli_args import make_arg_parser, server_config_from_args
from tengyun.entrypoints.openai.serving_models import ServingModels
from tengyun.logging_config import configure_logging
from tengyun.platforms import platform_class
from tengyun.platforms.cpu.runtime.tcmalloc_preload import log_allocator
from tengyun.platforms.startup import DeviceStartupError


def run_server(args: argparse.Namespace) -> int:
    from tengyun.entrypoints.cli.engine_args import config_from_args

    server = server_config_from_args(args)
    # finalize first (fast checks): bad flags never bind a port
    config = config_from_args(args, usage_context="api_server").finalize()
    server.finalize()  # reads --api-key-file and --chat-template: before the engine starts loading
    log_allocator(config.device)
    models = ServingModels.from_flags(config, server.lora_modules)  # --lora-modules' adapters checked
    if server.api_server_count > 1:  # a supervisor forks the engine process and N API processes
        from tengyun.entrypoints.openai.api_server_pool import run_api_server_pool

        return run_api_server_pool(config, server, models)
    if config.headless and config.data_parallel_size > 1:  # replicas for another node's API server, /health, /metrics
        from tengyun.entrypoints.openai.headless_replica_node import run_headless_replica_node

        return run_headless_replica_node(config, server)
    if config.headless:  # nodes 1..N-1 of a multi-node launch: this node's ranks and /health, /metrics
        from tengyun.entrypoints.openai.headless_server import run_headless_node

        return run_headless_node(config, server)
    engine_process = launch_for_server(config, platform_class(config.device_type).fork_safe,
                                       server.disable_frontend_multiprocessing)  # first: one thread here
    try:
        from tengyun.entrypoints.openai.http_server import serve_http  # after the fork: its load overlaps this import

        return serve_http(config, server, engine_process, models)
    finally:
        if engine_process is not None:
            engine_process.shutdown()


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    parser = make_arg_parser(FlexibleArgumentParser(
        prog="python -m tengyun.entrypoints.openai.api_server", description="Tengyun OpenAI-compatible server."))
    args = parser.parse_args(argv)
    try:
        return run_server(args)
    except (ValueError, FileNotFoundError, DeviceStartupError) as e:  # configuration errors: what to change
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
