"""vLLM's server flags that a command line copied from a vLLM deployment carries. Each one works
(FrontendOptions), or is accepted with one log line where it means nothing here, or stops
start-up (exit 2) where it asks for something Tengyun does not do (multimodal inputs).
The flags themselves are ServerConfig's fields (server_config.py); these are their tables."""

from __future__ import annotations

import json
from dataclasses import dataclass

# flag -> why it changes nothing here (accepted, logged once)
NO_EFFECT = {
    "--enable-log-requests": "Tengyun does not log request contents",
    "--max-log-len": "Tengyun does not log request contents",
    "--swap-space": "a preempted sequence is recomputed, never swapped to host memory",
    "--disable-custom-all-reduce": "tensor parallelism uses torch.distributed's all-reduce",
}
MULTIMODAL = ["--limit-mm-per-prompt", "--mm-processor-kwargs", "--mm-processor-cache-gb",
              "--allowed-local-media-path", "--media-io-kwargs"]


@dataclass(frozen=True)
class FrontendOptions:
    """vLLM's behaviour switches for the HTTP front end."""

    enable_request_id_headers: bool = False  # X-Request-Id on every answer (the client's, or a new one)
    enable_server_load_tracking: bool = False  # GET /load counts in-flight generation requests
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N"
    disable_fastapi_docs: bool = False  # no /docs, /redoc, /openapi.json


FRONTEND_HELP = {  # FrontendOptions field -> its flag's help
    "enable_request_id_headers": "answer with X-Request-Id (the request's own, or a new one)",
    "enable_server_load_tracking": "GET /load returns the number of generation requests in flight",
    "enable_tokenizer_info_endpoint": "serve GET /tokenizer_info (the tokenizer's settings and template)",
    "enable_prompt_tokens_details": "usage.prompt_tokens_details.cached_tokens: prompt tokens from the prefix cache",
    "return_tokens_as_token_ids": 'logprob tokens as "token_id:N" (for tokens that are not valid text)',
    "disable_fastapi_docs": "no /docs, /redoc or /openapi.json",
}


def text_only(values: list[str] | tuple[str, ...]) -> bool:
    """--limit-mm-per-prompt '{"image": 0, "video": 0}' asks for text only: that is what runs here."""
    try:
        limits = json.loads(" ".join(values))
    except json.JSONDecodeError:
        return False
    return isinstance(limits, dict) and all(v == 0 for v in limits.values())
