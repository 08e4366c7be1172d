"""The HTTP side of one API server process: EngineHost (engine, tokenizer, metrics, lifecycle)
behind the OpenAI routes, served by DrainingServer (uvicorn) until it drains or the engine dies.

api_server.run_server imports this module only after forking the engine process: FastAPI,
pydantic's request models and uvicorn take ~0.45 s to import on 2 cores, which the engine
process's load then overlaps instead of waiting for.
"""

from __future__ import annotations

import asyncio
import logging

from tengyun import __version__
from tengyun.config import EngineConfig
from tengyun.engine.engine_process import EngineProcessClient
from tengyun.entrypoints.openai.data_parallel_metrics import engine_metrics
from tengyun.entrypoints.openai.draining_server import DrainingServer
from tengyun.entrypoints.openai.engine_host import EngineHost
from tengyun.entrypoints.openai.routes import build_app
from tengyun.entrypoints.openai.server_config import ServerConfig
from tengyun.entrypoints.openai.server_lifecycle import ServerLifecycle
from tengyun.entrypoints.openai.serving_models import ServingModels

logger = logging.getLogger("tengyun.server")


def build_host(config: EngineConfig, server: ServerConfig, engine_process: EngineProcessClient | None = None,
               models: ServingModels | None = None, host_class: type[EngineHost] = EngineHost) -> EngineHost:
    """The server's parts for a finalized EngineConfig; build_app(host) puts routes in front."""
    metrics = engine_metrics(config, vllm_aliases=not server.disable_vllm_metric_aliases,
                             show_hidden_for=server.show_hidden_metrics_for_version)
    return host_class(config, server, ServerLifecycle(server, metrics.registry), metrics, engine_process, models)


def serve_http(config: EngineConfig, server: ServerConfig, engine_process: EngineProcessClient | None,
               models: ServingModels) -> int:
    """Serve until stopped; the process's exit code (0 drained, 1 the engine died)."""
    host = build_host(config, server, engine_process, models)
    uvicorn_server = DrainingServer.for_app(build_app(host), server, host.lifecycle)
    logger.info("Tengyun %s starting on %s (/health turns 200 when the model is ready)", __version__,
                f"unix socket {server.uds}" if server.uds else f"http://{server.host}:{server.port}")
    asyncio.run(uvicorn_server.serve())
    return uvicorn_server.outcome()
