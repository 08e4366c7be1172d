"""`tengyun serve` / `python -m tengyun.entrypoints.openai.api_server`: the OpenAI-compatible
HTTP server (FastAPI + uvicorn) in front of AsyncLLMEngine.

Life of the process:
    bind the port at once (/health 503) -> load weights and KV cache in a thread -> warm-up
    generation -> /health 200 -> ... -> SIGTERM: /health and new requests 503, in-flight ones
    finish (aborted after --shutdown-timeout) -> exit 0.  Engine loop died: exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import shlex
import sys
import threading
import time
from typing import Any, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, ProcessCollector, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from tengyun import __version__
from tengyun.config import EngineConfig
from tengyun.engine.async_engine import AsyncEngineBase, AsyncLLMEngine, EngineDeadError
from tengyun.engine.engine_process import EngineProcessClient, launch_for_server
from tengyun.entrypoints.openai.cli_args import (
    check_server_args, load_chat_template, make_arg_parser, resolve_api_key,
)
from tengyun.entrypoints.openai.device_metrics import DeviceCollector, DeviceSampler
from tengyun.entrypoints.openai.metrics import EngineMetrics, StatLogger
from tengyun.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
    RequestError, TokenizeRequest, TokenizeResponse,
)
from tengyun.entrypoints.openai.serving_chat import OpenAIServingChat
from tengyun.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tengyun.entrypoints.openai.middleware import GateMiddleware, RequestTooLarge, ResponseCounter, error_response
from tengyun.entrypoints.openai.openapi_doc import install_openapi
from tengyun.entrypoints.openai.request_limits import RequestLimits, default_max_request_bytes
from tengyun.entrypoints.openai.responses import respond, until_disconnect
from tengyun.entrypoints.openai.serving_engine import error_status, public_message
from tengyun.entrypoints.openai.tokenizer_worker import TokenizerWorker
from tengyun.entrypoints.openai.vllm_args import FrontendOptions, check_vllm_server_args
from tengyun.entrypoints.openai.vllm_routes import add_vllm_routes
from tengyun.generation_config import sampling_defaults
from tengyun.platforms import platform_class
from tengyun.platforms.startup import DeviceStartupError
from tengyun.sampling_params import RequestOutputKind, SamplingParams
from tengyun.tokenizer import get_tokenizer

logger = logging.getLogger("tengyun.server")

class ServerState:
    """Everything the routes share; the engine appears once loading and warm-up are done."""

    def __init__(self, config: EngineConfig, api_key: str | None = None, chat_template: str | None = None,
                 log_stats_interval: float | None = 10.0, shutdown_timeout: float = 30.0,
                 base_url: str | None = None, chat_options: dict[str, Any] | None = None,
                 limits: RequestLimits | None = None, metrics_options: dict[str, Any] | None = None,
                 frontend: FrontendOptions | None = None, device_metrics_interval: float | None = None,
                 engine_process: EngineProcessClient | None = None):
        self.config = config  # finalized: served_model_name and max_model_len are known
        self.limits = limits or RequestLimits(max_request_bytes=default_max_request_bytes(config.max_model_len),
                                              max_seqs_per_request=config.max_num_seqs)
        self.api_key = api_key
        self.chat_template = chat_template
        self.shutdown_timeout = shutdown_timeout
        self.base_url = base_url  # for the example curl line printed when ready
        self.chat_options = chat_options or {}  # enable_auto_tool_choice, tool_call_parser, reasoning_parser
        self.sampling_defaults = sampling_defaults(config)  # --generation-config; logged once when any
        self.engine_process = engine_process  # launched before the server started; else a thread here
        self.engine: AsyncEngineBase | None = None
        self.worker: TokenizerWorker | None = None
        self.frontend = frontend or FrontendOptions()
        self.generating = 0  # generation requests in flight: GET /load with --enable-server-load-tracking
        self.completion: OpenAIServingCompletion | None = None
        self.chat: OpenAIServingChat | None = None
        self.ready = False
        self.load_error: BaseException | None = None
        self.draining = False
        self.drain_deadline = 0.0
        self.aborted_in_flight = False
        self.in_flight = 0  # API requests between arrival and their last byte
        self.metrics = EngineMetrics(config, **(metrics_options or {}))  # vllm_aliases, show_hidden_for
        self.stat_logger = StatLogger(log_stats_interval) if log_stats_interval else None
        self._add_server_metrics()
        # --device-metrics-interval: device gauges sampled off the request path; None or 0: none
        self.device_sampler = DeviceSampler(platform_class(config.device_type)(), device_metrics_interval) \
            if device_metrics_interval else None
        if self.device_sampler:
            self.metrics.registry.register(DeviceCollector(self.device_sampler))

    def _add_server_metrics(self) -> None:
        """tengyun:server_ready (1 exactly when /health answers 200) and tengyun:http_responses_total
        by status class, for the alerting rules (`tengyun deploy alerts`)."""
        ready = Gauge("tengyun:server_ready", "1 when /health answers 200 (loaded, warm, not draining, engine "
                      "alive), else 0.", registry=self.metrics.registry)
        ready.set_function(lambda: float(self.unavailable_reason() is None))
        self.http_responses = Counter("tengyun:http_responses", "HTTP responses by status class (2xx, 4xx, 5xx).",
                                      ["status"], registry=self.metrics.registry)

    # ----- lifecycle ----------------------------------------------------------------------
    async def start_engine(self) -> None:
        try:
            logger.info("Loading %s (served as %r) ...", self.config.model_path, self.config.served_model_name)
            started = time.perf_counter()
            engine = await self._loaded_engine()
            tokenizer = await _in_daemon_thread(get_tokenizer, self.config, engine.tokenizer_class)  # own copy
            self.engine = engine
            await self._warm_up(engine, tokenizer)
            self.metrics.start_from(engine.latest_stats)  # warm-up tokens are not user traffic
            engine.add_step_listener(self.metrics.on_step)
            if self.stat_logger:
                self.stat_logger.start_from(engine.latest_stats)
                engine.add_step_listener(self.stat_logger.on_step)
            name = self.config.served_model_name
            self.worker = TokenizerWorker(tokenizer, self.limits.chat_template_timeout_s)
            self.completion = OpenAIServingCompletion(engine, self.worker, name, self.chat_template,
                                                      self.sampling_defaults, self.limits, self.frontend)
            self.chat = OpenAIServingChat(engine, self.worker, name, self.chat_template, self.sampling_defaults,
                                          self.limits, self.frontend, **self.chat_options)
            self.ready = True
            logger.info("Ready in %.1f s: serving %r", time.perf_counter() - started, name)
            if self.base_url:
                logger.info("Try it: %s", self.example_curl())
        except Exception as e:
            self.load_error = e
            logged = self.engine_process is not None and e is self.engine_process.start_error  # traceback there
            logger.error("Engine start failed: %s", e, exc_info=not isinstance(e, ValueError) and not logged)

    async def _loaded_engine(self) -> AsyncEngineBase:
        """The started engine once its model is loaded: the engine process launched before the
        server (it has been loading since), or an AsyncLLMEngine built in a thread here."""
        if self.engine_process is not None:
            self.engine_process.start()
            await self.engine_process.wait_ready()
            pid = self.engine_process.process.pid  # its memory and CPU, beside this process's process_*
            ProcessCollector(namespace="tengyun_engine", pid=lambda: pid, registry=self.metrics.registry)
            return self.engine_process
        engine = await _in_daemon_thread(AsyncLLMEngine.from_config, self.config)
        engine.start()
        return engine

    @staticmethod
    async def _warm_up(engine: AsyncEngineBase, tokenizer: Any) -> None:
        """One short generation through the whole path, so the first user request is not slow."""
        prompt = tokenizer.encode("Hello, warm-up.", add_special_tokens=False) or [0]
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        async for _ in engine.generate("warmup", prompt, params):
            pass

    async def log_stats_forever(self) -> None:
        while self.stat_logger:
            await asyncio.sleep(self.stat_logger.interval_s)
            self.stat_logger.log()

    def example_curl(self) -> str:
        body = {"model": self.config.served_model_name, "max_tokens": 64, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        auth = ' -H "Authorization: Bearer $TENGYUN_API_KEY"' if self.api_key else ""
        return (f"curl {self.base_url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
                f"-d {shlex.quote(json.dumps(body))}")

    def health_detail(self) -> dict:
        """GET /health/detail: what /health decides from, plus the engine's load and the devices'
        latest sample (the sampler's, never read here)."""
        reason = self.unavailable_reason()
        engine = self.engine
        stats = engine.latest_stats if engine is not None else None
        sample = self.device_sampler.latest if self.device_sampler else None
        return {
            "status": "ok" if reason is None else "unavailable", "reason": reason,
            "engine": {"state": _engine_state(self), "warmed_up": self.ready, "draining": self.draining,
                       "in_flight": self.in_flight,
                       **({"running": stats.num_running, "waiting": stats.num_waiting,
                           "kv_cache_usage": stats.kv_cache_usage, "kv_cache_blocks": stats.num_kv_blocks}
                          if stats is not None else {})},
            "device_type": self.config.device_type,
            "node": self.device_sampler.node if self.device_sampler else None,
            **(sample.as_json() if sample is not None else {"devices": None, "links": None}),
        }

    def begin_drain(self) -> None:
        self.draining = True
        self.drain_deadline = time.monotonic() + self.shutdown_timeout

    def exit_code(self) -> int | None:
        """Checked every 0.1 s by the server: None keeps serving, a number shuts down with it."""
        if self.load_error is not None:
            return 2 if isinstance(self.load_error, ValueError) else 1
        if self.engine is not None and self.engine.errored:
            return 1
        if self.draining:
            if self.in_flight == 0:
                return 0
            if time.monotonic() > self.drain_deadline:
                if not self.aborted_in_flight:
                    logger.warning("--shutdown-timeout passed: aborting %d in-flight request(s)", self.in_flight)
                    self.aborted_in_flight = True
                    if self.engine is not None:
                        self.engine.abort_all()
                elif time.monotonic() > self.drain_deadline + 5.0:
                    return 0
        return None

    def unavailable_reason(self) -> str | None:
        if self.engine is not None and self.engine.errored:
            return f"The engine is not running: {self.engine.dead_error}"
        if self.draining:
            return "The server is shutting down and accepts no new requests."
        if self.load_error is not None:
            return f"The engine failed to start: {self.load_error}"
        if not self.ready:
            return "The server is starting (loading the model, warming up); retry when /health returns 200."
        return None


def _engine_state(state: ServerState) -> str:
    """"loading" -> "warming_up" -> "running"; "failed" (never started) or "dead" (its loop died)."""
    if state.load_error is not None:
        return "failed"
    if state.engine is None:
        return "loading"
    if state.engine.errored:
        return "dead"
    return "running" if state.ready else "warming_up"


async def _in_daemon_thread(fn: Callable, *args: Any) -> Any:
    """Run fn in a daemon thread, so a SIGTERM during model loading does not wait for it."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(error: BaseException | None, result: Any) -> None:
        if not future.done():
            future.set_result(result) if error is None else future.set_exception(error)

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001
            loop.call_soon_threadsafe(settle, e, None)
        else:
            loop.call_soon_threadsafe(settle, None, result)

    threading.Thread(target=target, daemon=True, name=f"tengyun-{fn.__name__}").start()
    return await future


def build_app(state: ServerState, allowed_origins: list[str] | None = None, allowed_methods: list[str] | None = None,
              allowed_headers: list[str] | None = None, allow_credentials: bool = False,
              root_path: str | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        tasks = [asyncio.create_task(state.start_engine()), asyncio.create_task(state.log_stats_forever())]
        if state.device_sampler:
            state.device_sampler.start()
        try:
            yield
        finally:
            if state.device_sampler:
                state.device_sampler.stop()
            for task in tasks:
                task.cancel()
            if state.engine is not None:
                state.engine.shutdown()
            if state.worker is not None:
                state.worker.shutdown()

    no_docs = dict(docs_url=None, redoc_url=None, openapi_url=None) if state.frontend.disable_fastapi_docs else {}
    app = FastAPI(title="Tengyun OpenAI-compatible server", version=__version__, lifespan=lifespan, **no_docs)
    app.root_path = root_path or ""  # --root-path, as vLLM sets it: routes answer with and without the prefix
    app.state.server = state
    app.add_middleware(GateMiddleware, state=state)
    app.add_middleware(ResponseCounter, counter=state.http_responses)
    app.add_middleware(CORSMiddleware, allow_origins=allowed_origins or ["*"],
                       allow_methods=allowed_methods or ["*"], allow_headers=allowed_headers or ["*"],
                       allow_credentials=allow_credentials)  # outermost: preflights never need the key
    _add_error_handlers(app)
    _add_routes(app, state)
    add_vllm_routes(app, state)
    install_openapi(app, with_api_key=bool(state.api_key))
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"The request body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = str(first.get("msg", "Invalid request.")).removeprefix("Value error, ")
        if loc:
            message = f"{'.'.join(loc)}: {message}"
        elif first.get("type") in ("model_attributes_type", "dict_type", "missing"):
            message = f"The request body must be a JSON object: {message}"
        return error_response(400, message, loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, RequestTooLarge):  # FastAPI wraps errors met while reading the body
            return error_response(413, str(exc.__cause__))
        message = f"No route {request.method} {request.url.path}." if exc.status_code in (404, 405) else str(exc.detail)
        return error_response(exc.status_code, message)

    @app.exception_handler(RequestTooLarge)
    async def too_large(request: Request, exc: RequestTooLarge) -> JSONResponse:
        return error_response(413, str(exc))

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc.status, str(exc), exc.param)

    @app.exception_handler(ValueError)
    async def value_error(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(error_status(exc), str(exc))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("Internal error on %s", request.url.path)
        return error_response(500, public_message(exc))  # never the exception's text


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        reason = state.unavailable_reason()
        return Response(status_code=200) if reason is None else error_response(503, reason)

    @app.get("/health/detail")
    async def health_detail() -> JSONResponse:
        """Open like /health; the same status code, with what it is made of."""
        detail = state.health_detail()
        return JSONResponse(detail, status_code=200 if detail["reason"] is None else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict:
        # root: the name the model is served under, never the folder it was loaded or converted into
        card = ModelCard(id=state.config.served_model_name, root=state.config.served_model_name,
                         max_model_len=state.config.max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return respond(await until_disconnect(raw_request, state.completion.create_completion(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return respond(await until_disconnect(raw_request, state.chat.create_chat_completion(request)))

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> dict:
        serving = state.completion
        serving.check_model(request.model)
        if request.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
            text = await serving.render_chat(request.messages, request.add_generation_prompt,
                                             request.continue_final_message, request.chat_template,
                                             request.chat_template_kwargs, tools)
            add_special = bool(request.add_special_tokens)
        else:
            text = request.prompt
            add_special = request.add_special_tokens is not False
        tokens = await serving.worker.encode(text, add_special)
        token_strs = serving.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=serving.max_model_len, tokens=tokens,
                                token_strs=token_strs).model_dump()

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict:
        serving = state.completion
        serving.check_model(request.model)
        text = await serving.worker.run(serving.detokenize, request.tokens)  # a long list: off the event loop
        return DetokenizeResponse(prompt=text).model_dump()


class TengyunServer(uvicorn.Server):
    """uvicorn, with SIGTERM / SIGINT starting a drain instead of an immediate stop, and an exit
    code: 0 after a drain, 1 if the engine died, 2 if it could not start (configuration)."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self.exit_code = 0

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.state.draining or self.should_exit:  # a second signal: stop now
            self.should_exit = self.force_exit = True
            return
        logger.info("Received signal %d: no new requests; finishing %d in-flight request(s) within %.0f s",
                    sig, self.state.in_flight, self.state.shutdown_timeout)
        self.state.begin_drain()

    async def on_tick(self, counter: int) -> bool:
        should_exit = await super().on_tick(counter)
        code = self.state.exit_code()
        if code is not None:
            self.exit_code = code
            return True
        return should_exit


def run_server(args: argparse.Namespace) -> int:
    from tengyun.entrypoints.cli.engine_args import config_from_args

    check_server_args(args)
    check_vllm_server_args(args)
    config = config_from_args(args).finalize()  # fast checks first: bad flags never bind a port
    if config.headless:  # nodes 1..N-1 of a multi-node launch: this node's ranks, no engine, no port
        from tengyun.executor.multiproc_executor import run_headless

        return run_headless(config)
    engine_process = launch_for_server(config, platform_class(config.device_type).fork_safe,
                                       args.disable_frontend_multiprocessing)  # first: one thread here
    try:
        return _serve(args, config, engine_process)
    finally:
        if engine_process is not None:
            engine_process.shutdown()


def _serve(args: argparse.Namespace, config: EngineConfig, engine_process: EngineProcessClient | None) -> int:
    state = ServerState(
        config, api_key=resolve_api_key(args), chat_template=load_chat_template(args.chat_template),
        log_stats_interval=None if args.disable_log_stats else args.log_stats_interval,
        shutdown_timeout=args.shutdown_timeout,
        base_url=_base_url(args),
        chat_options=dict(enable_auto_tool_choice=args.enable_auto_tool_choice,
                          tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser),
        limits=RequestLimits.from_args(args, config.max_model_len, config.max_num_seqs),
        metrics_options=EngineMetrics.options_from_args(args),
        frontend=FrontendOptions.from_args(args),
        device_metrics_interval=args.device_metrics_interval,
        engine_process=engine_process,
    )
    app = build_app(state, args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials,
                    args.root_path)
    uvicorn_config = uvicorn.Config(
        app, host=args.host, port=args.port, uds=args.uds, log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log, timeout_graceful_shutdown=5, lifespan="on",
    )
    server = TengyunServer(uvicorn_config, state)
    logger.info("Tengyun %s starting on %s (/health turns 200 when the model is ready)", __version__,
                f"unix socket {args.uds}" if args.uds else f"http://{args.host}:{args.port}")
    asyncio.run(server.serve())
    if state.load_error is not None:
        print(f"error: {state.load_error}", file=sys.stderr)
    elif server.exit_code == 1:
        print(f"error: {state.engine.dead_error if state.engine else 'the engine stopped'}", file=sys.stderr)
    elif not server.started:
        return 1  # the port could not be bound; uvicorn logged why
    return server.exit_code


def _base_url(args: argparse.Namespace) -> str:
    """For the example curl line: where a client on this host reaches the server."""
    if args.uds:
        return f"--unix-socket {shlex.quote(args.uds)} http://localhost{args.root_path or ''}"
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    return f"http://{host}:{args.port}{args.root_path or ''}"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    parser = make_arg_parser(argparse.ArgumentParser(
        prog="python -m tengyun.entrypoints.openai.api_server", description="Tengyun OpenAI-compatible server."))
    args = parser.parse_args(argv)
    try:
        return run_server(args)
    except (ValueError, FileNotFoundError, DeviceStartupError) as e:  # configuration errors: what to change
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
