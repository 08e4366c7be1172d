"""ServerConfig: every setting of the HTTP server, under vLLM's flag names, validated in
__post_init__; finalize() reads what the flags point at (the API key, the chat template).

Its flags are generated from the fields by entrypoints/cli/engine_args.py, as EngineConfig's are:
`host: str = setting("0.0.0.0", ...)` is `--host`, `Annotated[..., Flag(...)]` adds a parse,
metavar or nargs. `tengyun serve` takes EngineConfig's flags, then these (cli_args.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
from dataclasses import dataclass, field
from typing import Annotated, Any

from tengyun.config import setting
from tengyun.entrypoints.cli.engine_args import Flag
from tengyun.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from tengyun.entrypoints.openai.request_limits import RequestLimits, default_max_request_bytes
from tengyun.entrypoints.openai.tool_parsers import TOOL_PARSERS
from tengyun.entrypoints.openai.vllm_args import (
    FRONTEND_HELP, MULTIMODAL, NO_EFFECT, FrontendOptions, text_only,
)
from tengyun.entrypoints.openai.vllm_metrics import minor_version
from tengyun.lora.modules import parse_lora_modules

API_KEY_ENV = "TENGYUN_API_KEY"
# Where the key comes from, first set wins: --api-key or --api-key-file (never both), then these.
API_KEY_ENVS = (API_KEY_ENV, "VLLM_API_KEY")  # VLLM_API_KEY: vLLM's documented variable
SERVER, METRICS, LIMITS, VLLM = "server", "metrics", "request limits", "vLLM compatibility"  # --help groups
MULTIMODAL_HELP = "refused: multimodal input is not supported"
logger = logging.getLogger("tengyun.server")


def list_arg(value: str) -> list[str]:
    """'["a", "b"]' (vLLM's JSON form) or 'a,b' -> ["a", "b"]."""
    value = value.strip()
    if value.startswith("["):
        try:
            items = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError('expected a JSON list of strings such as ["*"]')
        return items
    return [item.strip() for item in value.split(",") if item.strip()]


StrList = Annotated[tuple[str, ...], Flag(parse=list_arg)]
Refused = Annotated[tuple[str, ...] | None, Flag(nargs="+")]  # vLLM's list flags that Tengyun refuses


def _no_effect(flag: str) -> str:
    return f"accepted; no effect: {NO_EFFECT[flag]}"


@dataclass
class ServerConfig:
    # ----- server ---------------------------------------------------------------------------
    host: str = setting("0.0.0.0", group=SERVER, help="address to bind (default: all interfaces, as vLLM)")
    port: int = setting(8000, group=SERVER, help="")
    api_key: str | None = setting(
        None, group=SERVER, help=f"required as 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize; "
        f"/health, /health/detail, /metrics and /version stay open. Visible in ps: prefer --api-key-file or "
        f"${API_KEY_ENV} (without --api-key: --api-key-file, else ${API_KEY_ENV}, else $VLLM_API_KEY)")
    api_key_file: Annotated[str | None, Flag(metavar="PATH")] = setting(
        None, group=SERVER, help="read the key from the first line of PATH (e.g. a mode 0600 file)")
    allowed_origins: StrList = setting(("*",), group=SERVER, help='CORS origins, e.g. ["*"]')
    allowed_methods: StrList = setting(("*",), group=SERVER, help="")
    allowed_headers: StrList = setting(("*",), group=SERVER, help="")
    allow_credentials: bool = setting(
        False, group=SERVER, help="CORS credentials; needs --allowed-origins listing the origins (not '*')")
    chat_template: str | None = setting(
        None, group=SERVER, help="a Jinja chat template, or a file holding one, replacing the tokenizer's")
    disable_log_stats: bool = setting(False, group=SERVER, help="no periodic stats log line")
    log_stats_interval: float = setting(10.0, group=SERVER, help="seconds between stats lines")
    device_metrics_interval: Annotated[float, Flag(metavar="SECONDS")] = setting(
        5.0, group=SERVER, help="seconds between device readings for the /metrics device gauges and "
        "/health/detail (npu-smi, NVML / nvidia-smi, /proc; in a background thread); 0 turns them off")
    disable_log_requests: bool = setting(False, group=SERVER, help="accepted for vLLM compatibility")
    shutdown_timeout: float = setting(
        30.0, group=SERVER, help="seconds SIGTERM waits for in-flight requests before aborting them")
    enable_auto_tool_choice: bool = setting(
        False, group=SERVER, help='tool_choice "auto" (the default when a request has tools): the model decides, '
        "--tool-call-parser reads its calls")
    tool_call_parser: str | None = setting(
        None, group=SERVER, choices=tuple(sorted(TOOL_PARSERS)), help="format of the model's tool calls: hermes "
        "(Qwen2.5 / Qwen3 JSON in <tool_call>) or qwen3_coder (Qwen3-Coder XML)")
    reasoning_parser: str | None = setting(
        None, group=SERVER, choices=tuple(sorted(REASONING_PARSERS)),
        help="split <think>...</think> into reasoning_content: qwen3")
    api_server_count: int = setting(
        1, aliases=("-asc",), group=SERVER, help="API server processes in front of the one engine process, "
        "all accepting on --port (or --uds): tokenisation, HTTP and streaming spread over N cores "
        "(docs/production.md)")
    uvicorn_log_level: str = setting(
        "info", group=SERVER, choices=("critical", "error", "warning", "info", "debug", "trace"), help="")
    disable_uvicorn_access_log: bool = setting(False, group=SERVER, help="")
    # ----- metrics (vllm_metrics.py) ----------------------------------------------------------
    disable_vllm_metric_aliases: bool = setting(
        False, group=METRICS, help="export /metrics under tengyun: names only, without their vllm: twins")
    show_hidden_metrics_for_version: Annotated[tuple[int, int] | None, Flag(parse=minor_version, metavar="X.Y")] = \
        setting(None, group=METRICS, help="also export the deprecated vllm: names that vLLM X.Y still exported "
                "(0.10: gpu_cache_usage_perc, gpu_prefix_cache_queries/hits, time_per_output_token_seconds; "
                "0.11: time_per_output_token_seconds)")
    # ----- request limits (request_limits.py); 0 for the two with a computed default: that default
    max_request_bytes: int | None = setting(
        None, group=LIMITS, help="largest request body accepted (413 above it; default: 32 bytes per token of "
        "--max-model-len, at least 1 MiB)")
    max_n: int = setting(128, group=LIMITS, help="largest `n` a request may ask for (default 128)")
    max_prompts_per_request: int = setting(
        256, group=LIMITS, help="most prompts one /v1/completions request may list (default 256)")
    max_seqs_per_request: int | None = setting(
        None, group=LIMITS, help="most sequences (n x prompts) one request may start (default: --max-num-seqs)")
    chat_template_timeout: float = setting(
        10.0, group=LIMITS, help="seconds a chat template may take to render before the request gets a 400")
    trust_request_chat_template: bool = setting(
        False, group=LIMITS, help="accept `chat_template` in requests (refused by default, as vLLM: a template "
        "is code)")
    # ----- vLLM compatibility (vllm_args.py) ----------------------------------------------------
    root_path: str | None = setting(
        None, group=VLLM, help="the path prefix a proxy serves this server under: routes answer with and "
        "without it")
    uds: Annotated[str | None, Flag(metavar="PATH")] = setting(
        None, group=VLLM, help="listen on this Unix socket instead of --host/--port")
    disable_frontend_multiprocessing: bool = setting(
        False, group=VLLM, help="run the engine loop in a thread of the server process instead of a process of "
        "its own (the two then share one GIL: slower under load)")
    enable_request_id_headers: bool = setting(False, group=VLLM, help=FRONTEND_HELP["enable_request_id_headers"])
    enable_server_load_tracking: bool = setting(
        False, group=VLLM, help=FRONTEND_HELP["enable_server_load_tracking"])
    enable_tokenizer_info_endpoint: bool = setting(
        False, group=VLLM, help=FRONTEND_HELP["enable_tokenizer_info_endpoint"])
    enable_prompt_tokens_details: bool = setting(
        False, group=VLLM, help=FRONTEND_HELP["enable_prompt_tokens_details"])
    return_tokens_as_token_ids: bool = setting(False, group=VLLM, help=FRONTEND_HELP["return_tokens_as_token_ids"])
    disable_fastapi_docs: bool = setting(False, group=VLLM, help=FRONTEND_HELP["disable_fastapi_docs"])
    enable_log_requests: bool = setting(False, group=VLLM, help=_no_effect("--enable-log-requests"))
    max_log_len: str | None = setting(None, group=VLLM, help=_no_effect("--max-log-len"))
    swap_space: str | None = setting(None, group=VLLM, help=_no_effect("--swap-space"))
    disable_custom_all_reduce: bool = setting(False, group=VLLM, help=_no_effect("--disable-custom-all-reduce"))
    lora_modules: Annotated[tuple[str, ...] | None, Flag(nargs="+", metavar="NAME=PATH")] = setting(
        None, group=VLLM, help='LoRA adapters served from start-up (with --enable-lora): name=path, or JSON '
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; a request picks one by its "model" (docs/lora.md)')
    limit_mm_per_prompt: Refused = setting(None, group=VLLM, help=MULTIMODAL_HELP)
    mm_processor_kwargs: Refused = setting(None, group=VLLM, help=MULTIMODAL_HELP)
    mm_processor_cache_gb: Refused = setting(None, group=VLLM, help=MULTIMODAL_HELP)
    allowed_local_media_path: Refused = setting(None, group=VLLM, help=MULTIMODAL_HELP)
    media_io_kwargs: Refused = setting(None, group=VLLM, help=MULTIMODAL_HELP)
    # ----- resolved by finalize() -----------------------------------------------------------------
    required_api_key: str | None = field(default=None, init=False)  # what /v1/* requires; None: no key
    chat_template_text: str | None = field(default=None, init=False)  # None: the tokenizer's template

    def __post_init__(self) -> None:
        for name, value in vars(self).items():  # flags give lists, the dataclass keeps tuples
            if isinstance(value, list):
                setattr(self, name, tuple(value))
        self._check_server()
        self._check_vllm()
        self._check_limits()

    def _check_server(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser: add --tool-call-parser hermes "
                             "(Qwen2.5 / Qwen3) or qwen3_coder (Qwen3-Coder).")
        if self.api_key and self.api_key_file:
            raise ValueError("--api-key and --api-key-file both give the key: keep --api-key-file (the other one "
                             "shows the key in ps).")
        if self.device_metrics_interval < 0:
            raise ValueError(f"--device-metrics-interval {self.device_metrics_interval:g}: give seconds between "
                             f"device readings (default 5), or 0 to turn the device gauges off.")
        if self.api_server_count < 1:
            raise ValueError(f"--api-server-count {self.api_server_count}: give 1 or more API server processes.")
        if self.api_server_count > 1 and self.disable_frontend_multiprocessing:
            raise ValueError("--api-server-count above 1 needs the engine in a process of its own: drop "
                             "--disable-frontend-multiprocessing or use --api-server-count 1.")
        if self.allow_credentials and "*" in self.allowed_origins:
            # Starlette answers a credentialed request from any Origin by echoing it: every web page a
            # user visits could then call the API with the user's cookies.
            raise ValueError("--allow-credentials with --allowed-origins '*' lets any web site send credentialed "
                             "requests: list the origins, e.g. --allowed-origins '[\"https://app.example.com\"]', "
                             "or drop --allow-credentials.")

    def _check_vllm(self) -> None:
        """Refused vLLM flags raise ValueError naming them (exit 2)."""
        parse_lora_modules(self.lora_modules)  # a malformed entry stops start-up here
        for flag in MULTIMODAL:
            if self.given(flag) and not (flag == "--limit-mm-per-prompt" and text_only(self.limit_mm_per_prompt)):
                raise ValueError(f"{flag}: multimodal inputs are not supported by Tengyun (text only); drop {flag}.")

    def _check_limits(self) -> None:
        # --max-request-bytes and --max-seqs-per-request: None or 0 -> the default request_limits() computes
        for flag, value in (("--max-request-bytes", self.max_request_bytes or 1), ("--max-n", self.max_n),
                            ("--max-prompts-per-request", self.max_prompts_per_request),
                            ("--max-seqs-per-request", self.max_seqs_per_request or 1),
                            ("--chat-template-timeout", self.chat_template_timeout)):
            if value <= 0:
                raise ValueError(f"{flag} must be positive, got {value}.")

    def given(self, flag: str) -> bool:
        """Whether ``flag`` ("--max-loras") was set: neither None nor an unset switch."""
        return getattr(self, flag.lstrip("-").replace("-", "_")) not in (None, False)

    def finalize(self) -> "ServerConfig":
        """Read the key and the template the flags point at; log the vLLM flags that do nothing here."""
        self.required_api_key = resolve_api_key(self)
        self.chat_template_text = load_chat_template(self.chat_template)
        for flag, why in NO_EFFECT.items():
            if self.given(flag):
                logger.info("%s accepted for vLLM compatibility; it has no effect here: %s.", flag, why)
        return self

    # ----- what the server's parts take -------------------------------------------------------------
    def request_limits(self, max_model_len: int, max_num_seqs: int) -> RequestLimits:
        """The per-request limits; the two unset ones follow the engine's --max-model-len and --max-num-seqs."""
        return RequestLimits(max_request_bytes=self.max_request_bytes or default_max_request_bytes(max_model_len),
                             max_n=self.max_n, max_prompts_per_request=self.max_prompts_per_request,
                             max_seqs_per_request=self.max_seqs_per_request or max_num_seqs,
                             chat_template_timeout_s=self.chat_template_timeout,
                             trust_request_chat_template=self.trust_request_chat_template)

    def frontend(self) -> FrontendOptions:
        return FrontendOptions(**{name: getattr(self, name) for name in FrontendOptions.__dataclass_fields__})

    def chat_options(self) -> dict[str, Any]:
        """OpenAIServingChat's keyword arguments."""
        return dict(enable_auto_tool_choice=self.enable_auto_tool_choice, tool_call_parser=self.tool_call_parser,
                    reasoning_parser=self.reasoning_parser)

    def base_url(self) -> str:
        """For the example curl line: where a client on this host reaches the server."""
        if self.uds:
            return f"--unix-socket {shlex.quote(self.uds)} http://localhost{self.root_path or ''}"
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}{self.root_path or ''}"


def resolve_api_key(server: ServerConfig) -> str | None:
    """The key /v1/* requires, None for none: --api-key, else --api-key-file's first line, else
    $TENGYUN_API_KEY, else $VLLM_API_KEY (empty values count as unset)."""
    if server.api_key:
        logger.warning("--api-key puts the key on the command line, where any user on this host sees it in ps: "
                       "set %s (or VLLM_API_KEY) in the environment or pass --api-key-file PATH instead.",
                       API_KEY_ENV)
        return server.api_key
    if server.api_key_file:
        return read_api_key_file(server.api_key_file)
    return next((os.environ[name] for name in API_KEY_ENVS if os.environ.get(name)), None)


def read_api_key_file(path: str) -> str:
    """The first line of ``path``, stripped of surrounding whitespace; it must not be empty."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file {path}: cannot read it ({e}); pass a readable file whose first line "
                         f"is the key.") from None
    if not key:
        raise ValueError(f"--api-key-file {path}: the first line is empty; write the key on it.")
    return key


def load_chat_template(value: str | None) -> str | None:
    """--chat-template is a path when such a file exists, else the template itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template.")
    return value
