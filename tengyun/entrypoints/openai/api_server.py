"""`tengyun serve` / `python -m tengyun.entrypoints.openai.api_server`: the OpenAI-compatible
HTTP server (FastAPI + uvicorn) in front of AsyncLLMEngine. This module only wires the parts:

    ServerConfig + EngineConfig (flags, cli_args.py)
      -> EngineMetrics (one registry) -> ServerLifecycle (server_lifecycle.py)
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
import asyncio
import logging

from tengyun import __version__
from tengyun.config import EngineConfig
from tengyun.engine.engine_process import EngineProcessClient, launch_for_server
from tengyun.entrypoints.cli.flexible_parser import FlexibleArgumentParser
from tengyun.entrypoints.openai.cli_args import make_arg_parser, server_config_from_args
from tengyun.entrypoints.openai.draining_server import DrainingServer
from tengyun.entrypoints.openai.engine_host import EngineHost
from tengyun.entrypoints.openai.data_parallel_metrics import engine_metrics
from tengyun.entrypoints.openai.routes import build_app
from tengyun.entrypoints.openai.server_config import ServerConfig
from tengyun.entrypoints.openai.server_lifecycle import ServerLifecycle
from tengyun.entrypoints.openai.serving_models import ServingModels
from tengyun.platforms import platform_class
from tengyun.platforms.cpu.runtime.tcmalloc_preload import log_allocator
from tengyun.platforms.startup import DeviceStartupError

logger = logging.getLogger("tengyun.server")


def build_host(config: EngineConfig, server: ServerConfig, engine_process: EngineProcessClient | None = None,
               models: ServingModels | None = None, host_class: type[EngineHost] = EngineHost) -> EngineHost:
    """The server's parts for a finalized EngineConfig; build_app(host) puts routes in front."""
    metrics = engine_metrics(config, vllm_aliases=not server.disable_vllm_metric_aliases,
                             show_hidden_for=server.show_hidden_metrics_for_version)
    return host_class(config, server, ServerLifecycle(server, metrics.registry), metrics, engine_process, models)


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
        return _serve(config, server, engine_process, models)
    finally:
        if engine_process is not None:
            engine_process.shutdown()


def _serve(config: EngineConfig, server: ServerConfig, engine_process: EngineProcessClient | None,
           models: ServingModels) -> int:
    host = build_host(config, server, engine_process, models)
    uvicorn_server = DrainingServer.for_app(build_app(host), server, host.lifecycle)
    logger.info("Tengyun %s starting on %s (/health turns 200 when the model is ready)", __version__,
                f"unix socket {server.uds}" if server.uds else f"http://{server.host}:{server.port}")
    asyncio.run(uvicorn_server.serve())
    return uvicorn_server.outcome()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
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
