"""Flags of `tengyun serve`: the engine's (shared with `tengyun generate`) plus the server's,
under vLLM's names."""

from __future__ import annotations

import argparse
import json
import logging
import os

from tengyun.entrypoints.cli.engine_args import add_engine_args
from tengyun.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from tengyun.entrypoints.openai.request_limits import add_request_limit_args
from tengyun.entrypoints.openai.tool_parsers import TOOL_PARSERS
from tengyun.entrypoints.openai.vllm_args import add_vllm_server_args
from tengyun.entrypoints.openai.vllm_metrics import add_metrics_args

API_KEY_ENV = "TENGYUN_API_KEY"
# Where the key comes from, first set wins: --api-key or --api-key-file (never both), then these.
API_KEY_ENVS = (API_KEY_ENV, "VLLM_API_KEY")  # VLLM_API_KEY: vLLM's documented variable
logger = logging.getLogger("tengyun.server")


def _list_arg(value: str) -> list[str]:
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


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="0.0.0.0", help="address to bind (default: all interfaces, as vLLM)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--api-key", default=None,
                       help=f"required as 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize; "
                            f"/health, /health/detail, /metrics and /version stay open. Visible in ps: prefer "
                            f"--api-key-file or ${API_KEY_ENV} (without --api-key: --api-key-file, else "
                            f"${API_KEY_ENV}, else $VLLM_API_KEY)")
    group.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="read the key from the first line of PATH (e.g. a mode 0600 file)")
    group.add_argument("--allowed-origins", type=_list_arg, default=["*"], help='CORS origins, e.g. ["*"]')
    group.add_argument("--allowed-methods", type=_list_arg, default=["*"])
    group.add_argument("--allowed-headers", type=_list_arg, default=["*"])
    group.add_argument("--allow-credentials", action="store_true",
                       help="CORS credentials; needs --allowed-origins listing the origins (not '*')")
    group.add_argument("--chat-template", default=None,
                       help="a Jinja chat template, or a file holding one, replacing the tokenizer's")
    group.add_argument("--disable-log-stats", action="store_true", help="no periodic stats log line")
    group.add_argument("--log-stats-interval", type=float, default=10.0, help="seconds between stats lines")
    group.add_argument("--device-metrics-interval", type=float, default=5.0, metavar="SECONDS",
                       help="seconds between device readings for the /metrics device gauges and /health/detail "
                            "(npu-smi, NVML / nvidia-smi, /proc; in a background thread); 0 turns them off")
    group.add_argument("--disable-log-requests", action="store_true", help="accepted for vLLM compatibility")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds SIGTERM waits for in-flight requests before aborting them")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='tool_choice "auto" (the default when a request has tools): the model decides, '
                            "--tool-call-parser reads its calls")
    group.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="format of the model's tool calls: hermes (Qwen2.5 / Qwen3 JSON in <tool_call>) or "
                            "qwen3_coder (Qwen3-Coder XML)")
    group.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="split <think>...</think> into reasoning_content: qwen3")
    group.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
    group.add_argument("--disable-uvicorn-access-log", action="store_true")


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_engine_args(parser)
    add_server_args(parser)
    add_metrics_args(parser)
    add_request_limit_args(parser)
    add_vllm_server_args(parser)
    return parser


def check_server_args(args: argparse.Namespace) -> None:
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser: add --tool-call-parser hermes "
                         "(Qwen2.5 / Qwen3) or qwen3_coder (Qwen3-Coder).")
    if args.api_key and args.api_key_file:
        raise ValueError("--api-key and --api-key-file both give the key: keep --api-key-file (the other one "
                         "shows the key in ps).")
    if args.device_metrics_interval < 0:
        raise ValueError(f"--device-metrics-interval {args.device_metrics_interval:g}: give seconds between device "
                         f"readings (default 5), or 0 to turn the device gauges off.")
    if args.allow_credentials and "*" in args.allowed_origins:
        # Starlette answers a credentialed request from any Origin by echoing it: every web page a
        # user visits could then call the API with the user's cookies.
        raise ValueError("--allow-credentials with --allowed-origins '*' lets any web site send credentialed "
                         "requests: list the origins, e.g. --allowed-origins '[\"https://app.example.com\"]', "
                         "or drop --allow-credentials.")


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """The key /v1/* requires, None for none: --api-key, else --api-key-file's first line, else
    $TENGYUN_API_KEY, else $VLLM_API_KEY (empty values count as unset)."""
    if args.api_key:
        logger.warning("--api-key puts the key on the command line, where any user on this host sees it in ps: "
                       "set %s (or VLLM_API_KEY) in the environment or pass --api-key-file PATH instead.",
                       API_KEY_ENV)
        return args.api_key
    if args.api_key_file:
        return read_api_key_file(args.api_key_file)
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
