"""vLLM's server flags that a command line copied from a vLLM deployment carries. Each one works
(FrontendOptions), or is accepted with one log line where it means nothing here, or stops
start-up (exit 2) where it asks for something Tengyun does not do (LoRA, multimodal inputs)."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass

logger = logging.getLogger("tengyun.server")

# flag -> why it changes nothing here (accepted, logged once)
NO_EFFECT = {
    "--enable-log-requests": "Tengyun does not log request contents",
    "--max-log-len": "Tengyun does not log request contents",
    "--swap-space": "a preempted sequence is recomputed, never swapped to host memory",
    "--disable-custom-all-reduce": "tensor parallelism uses torch.distributed's all-reduce",
}
NO_EFFECT_SWITCHES = {"--enable-log-requests", "--disable-custom-all-reduce"}
LORA = ["--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank", "--max-cpu-loras",
        "--fully-sharded-loras", "--lora-dtype"]
LORA_SWITCHES = {"--enable-lora", "--fully-sharded-loras"}
MULTIMODAL = ["--limit-mm-per-prompt", "--mm-processor-kwargs", "--mm-processor-cache-gb",
              "--allowed-local-media-path", "--media-io-kwargs"]
RUNNERS = ("auto", "generate", "pooling", "draft")


@dataclass(frozen=True)
class FrontendOptions:
    """vLLM's behaviour switches for the HTTP front end."""

    enable_request_id_headers: bool = False  # X-Request-Id on every answer (the client's, or a new one)
    enable_server_load_tracking: bool = False  # GET /load counts in-flight generation requests
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N"
    disable_fastapi_docs: bool = False  # no /docs, /redoc, /openapi.json

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "FrontendOptions":
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})


def add_vllm_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM compatibility")
    group.add_argument("--root-path", default=None,
                       help="the path prefix a proxy serves this server under: routes answer with and without it")
    group.add_argument("--uds", default=None, metavar="PATH",
                       help="listen on this Unix socket instead of --host/--port")
    group.add_argument("--runner", default="auto", choices=RUNNERS,
                       help="auto / generate (what Tengyun runs); pooling and draft are refused")
    group.add_argument("--disable-frontend-multiprocessing", action="store_true",
                       help="run the engine loop in a thread of the server process instead of a process of "
                            "its own (the two then share one GIL: slower under load)")
    for name in FrontendOptions.__dataclass_fields__:
        group.add_argument("--" + name.replace("_", "-"), action="store_true", help=_help(name))
    for flag in NO_EFFECT:
        kind = dict(action="store_true") if flag in NO_EFFECT_SWITCHES else dict(default=None)
        group.add_argument(flag, help=f"accepted; no effect: {NO_EFFECT[flag]}", **kind)
    for flag in LORA + MULTIMODAL:
        kind = dict(action="store_true") if flag in LORA_SWITCHES else dict(default=None, nargs="+")
        group.add_argument(flag, help="refused: " + ("LoRA" if flag in LORA else "multimodal input") +
                           " is not supported", **kind)


def _help(name: str) -> str:
    return {"enable_request_id_headers": "answer with X-Request-Id (the request's own, or a new one)",
            "enable_server_load_tracking": "GET /load returns the number of generation requests in flight",
            "enable_tokenizer_info_endpoint": "serve GET /tokenizer_info (the tokenizer's settings and template)",
            "enable_prompt_tokens_details": "usage.prompt_tokens_details.cached_tokens: prompt tokens from the "
                                            "prefix cache",
            "return_tokens_as_token_ids": 'logprob tokens as "token_id:N" (for tokens that are not valid text)',
            "disable_fastapi_docs": "no /docs, /redoc or /openapi.json"}[name]


def check_vllm_server_args(args: argparse.Namespace) -> None:
    """Refused flags raise ValueError naming them (exit 2); flags without effect log one line."""
    if args.runner in ("pooling", "draft"):
        raise ValueError(f"--runner {args.runner}: Tengyun runs generative models only; use --runner generate "
                         f"(or auto).")
    for flag in LORA:
        if _given(args, flag):
            raise ValueError(f"{flag}: LoRA adapters are not supported by Tengyun; serve a checkpoint with the "
                             f"adapter merged into its weights, and drop {flag}.")
    for flag in MULTIMODAL:
        if _given(args, flag) and not (flag == "--limit-mm-per-prompt" and _text_only(args.limit_mm_per_prompt)):
            raise ValueError(f"{flag}: multimodal inputs are not supported by Tengyun (text only); drop {flag}.")
    for flag, why in NO_EFFECT.items():
        if _given(args, flag):
            logger.info("%s accepted for vLLM compatibility; it has no effect here: %s.", flag, why)


def _given(args: argparse.Namespace, flag: str) -> bool:
    value = getattr(args, flag.lstrip("-").replace("-", "_"))
    return value not in (None, False)


def _text_only(values: list[str]) -> bool:
    """--limit-mm-per-prompt '{"image": 0, "video": 0}' asks for text only: that is what runs here."""
    try:
        limits = json.loads(" ".join(values))
    except json.JSONDecodeError:
        return False
    return isinstance(limits, dict) and all(v == 0 for v in limits.values())
