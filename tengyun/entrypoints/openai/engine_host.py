"""EngineHost: the engine behind the routes, and what runs beside it in the server process.

    running():  start_engine() and the stats logger as tasks, the device sampler thread
    start_engine(): engine loaded (the engine process launched before the server, or
                    AsyncLLMEngine in a thread here; this process preloads its tokenizer
                    meanwhile) -> tokenizer -> warm-up generation ->
                    metrics and stats follow the engine -> the serving objects -> lifecycle.ready
    leaving running(): the tasks cancelled, the sampler stopped, engine and tokenizer worker shut down

Every step that can fail records it in the lifecycle (load_error), which turns it into /health
503 and the exit code; nothing here answers HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shlex
import threading
import time
from typing import Any, AsyncIterator, Callable

from prometheus_client import ProcessCollector

from tengyun.config import EngineConfig
from tengyun.engine.async_engine import AsyncEngineBase, AsyncLLMEngine
from tengyun.engine.engine_process import EngineProcessClient
from tengyun.entrypoints.openai.device_metrics import DeviceCollector, DeviceSampler
from tengyun.entrypoints.openai.metrics import EngineMetrics, StatLogger
from tengyun.entrypoints.openai.server_config import ServerConfig
from tengyun.entrypoints.openai.server_lifecycle import ServerLifecycle
from tengyun.entrypoints.openai.serving_chat import OpenAIServingChat
from tengyun.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tengyun.entrypoints.openai.serving_models import ServingModels
from tengyun.entrypoints.openai.serving_score import OpenAIServingScore
from tengyun.entrypoints.openai.tokenizer_worker import TokenizerWorker
from tengyun.generation_config import sampling_defaults
from tengyun.platforms import platform_class
from tengyun.pooling_params import PoolingParams
from tengyun.sampling_params import RequestOutputKind, SamplingParams
from tengyun.tokenizer import get_tokenizer, preload_tokenizer

logger = logging.getLogger("tengyun.server")


class EngineHost:
    def __init__(self, config: EngineConfig, server: ServerConfig, lifecycle: ServerLifecycle,
                 metrics: EngineMetrics, engine_process: EngineProcessClient | None = None,
                 models: ServingModels | None = None):
        self.config = config  # finalized: served_model_name and max_model_len are known
        self.server = server  # finalized: required_api_key and chat_template_text are read
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.scrape_registry = metrics.registry  # what /metrics serves (several API processes: all of theirs)
        self.engine_process = engine_process  # launched before the server started; else a thread here
        lifecycle.starting_note = getattr(engine_process, "waiting_for", None)  # replicas on other nodes
        self.limits = server.request_limits(config.max_model_len, config.max_num_seqs)
        # the base model and the LoRA adapters a request may name (--lora-modules checked by now)
        self.models = models or ServingModels.from_flags(config, server.lora_modules)
        self.frontend = server.frontend()
        self.sampling_defaults = sampling_defaults(config)  # --generation-config; logged once when any
        self.worker: TokenizerWorker | None = None
        self.completion: OpenAIServingCompletion | None = None
        self.chat: OpenAIServingChat | None = None
        self.pooling: OpenAIServingScore | None = None  # /v1/embeddings, /pooling, /classify, /score, /rerank
        self.stat_logger = None if server.disable_log_stats or not server.log_stats_interval \
            else StatLogger(server.log_stats_interval)
        # --device-metrics-interval: device gauges sampled off the request path; 0: none
        self.device_sampler = DeviceSampler(platform_class(config.device_type)(), server.device_metrics_interval) \
            if server.device_metrics_interval else None
        if self.device_sampler:
            metrics.registry.register(DeviceCollector(self.device_sampler))

    @property
    def engine(self) -> AsyncEngineBase | None:
        return self.lifecycle.engine

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The app's lifespan: the engine starts in the background while the port already answers."""
        tasks = [asyncio.create_task(self.start_engine()), asyncio.create_task(self.log_stats_forever())]
        if self.device_sampler:
            self.device_sampler.start()
        try:
            yield
        finally:
            if self.device_sampler:
                self.device_sampler.stop()
            for task in tasks:
                task.cancel()
            if self.engine is not None:
                self.engine.shutdown()
            if self.worker is not None:
                self.worker.shutdown()

    async def start_engine(self) -> None:
        try:
            logger.info("Loading %s (served as %r) ...", self.config.model_path, self.config.served_model_name)
            started = time.perf_counter()
            preload = self._tokenizer_preload()
            engine = await self._loaded_engine()
            tokenizer = await self._tokenizer(engine, preload)
            self.lifecycle.engine_started(engine)
            await self._warm_up(engine, tokenizer)
            self.metrics.start_from(engine.latest_stats)  # warm-up tokens are not user traffic
            engine.add_step_listener(self.metrics.on_step)
            if self.stat_logger:
                self.stat_logger.start_from(engine.latest_stats)
                engine.add_step_listener(self.stat_logger.on_step)
            self._start_serving(engine, tokenizer)
            self.lifecycle.ready = True
            logger.info("Ready in %.1f s: serving %r", time.perf_counter() - started, self.config.served_model_name)
            logger.info("Try it: %s", self.example_curl())
        except Exception as e:
            self.lifecycle.load_error = e
            logged = self.engine_process is not None and e is self.engine_process.start_error  # traceback there
            logger.error("Engine start failed: %s", e, exc_info=not isinstance(e, ValueError) and not logged)

    def _start_serving(self, engine: AsyncEngineBase, tokenizer: Any) -> None:
        """The objects the OpenAI routes call: completions and chat, sharing one tokenizer worker."""
        name, template = self.config.served_model_name, self.server.chat_template_text
        self.worker = TokenizerWorker(tokenizer, self.limits.chat_template_timeout_s)
        self.completion = OpenAIServingCompletion(engine, self.worker, name, template, self.sampling_defaults,
                                                  self.limits, self.frontend, models=self.models)
        self.chat = OpenAIServingChat(engine, self.worker, name, template, self.sampling_defaults, self.limits,
                                      self.frontend, models=self.models, **self.server.chat_options())
        self.pooling = OpenAIServingScore(engine, self.worker, name, template, self.sampling_defaults, self.limits,
                                          self.frontend)

    def _tokenizer_preload(self) -> asyncio.Future | None:
        """tokenizer.preload_tokenizer in a thread while the engine process loads (the API process
        is idle then; loading it after the engine was ready made Qwen2.5-Coder's server ready ~1 s
        later, 1.23 against 0.27 s median after the engine's ready, and that burst of CPU came
        just before the warm-up, where the thread tuner's start-up check measures). None with an
        engine in this process, whose own load loads its tokenizer."""
        if self.engine_process is None:
            return None
        return asyncio.ensure_future(_in_daemon_thread(preload_tokenizer, self.config))

    async def _tokenizer(self, engine: AsyncEngineBase, preload: asyncio.Future | None) -> Any:
        """This process's own tokenizer, of the class the engine's is: the preloaded one when the
        engine names its class, else loaded now (a first start: AutoTokenizer chose in the engine)."""
        preloaded = await preload if preload is not None else None
        if preloaded is not None and preloaded[0] == engine.tokenizer_class:
            logger.debug("Tokenizer: %s, loaded beside the engine's load", preloaded[0])
            return preloaded[1]
        return await _in_daemon_thread(get_tokenizer, self.config, engine.tokenizer_class)

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
        """One short generation (a pooling model: one pooling request) through the whole path, so the
        first user request is not slow."""
        prompt = (tokenizer.encode("Hello, warm-up.", add_special_tokens=False) if tokenizer else None) or [0]
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        if engine.config.pooling is not None:
            params = PoolingParams()
        for target in getattr(engine, "replicas", None) or [engine]:  # --data-parallel-size: each replica
            async for _ in target.generate("warmup", prompt, params):
                pass

    async def log_stats_forever(self) -> None:
        while self.stat_logger:
            await asyncio.sleep(self.stat_logger.interval_s)
            self.stat_logger.log()

    def example_curl(self) -> str:
        """The request logged when ready: `curl http://127.0.0.1:8000/v1/chat/completions ... -d '{...}'`."""
        body = {"model": self.config.served_model_name, "max_tokens": 64, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        auth = ' -H "Authorization: Bearer $TENGYUN_API_KEY"' if self.server.required_api_key else ""
        return (f"curl {self.server.base_url()}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
                f"-d {shlex.quote(json.dumps(body))}")


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
