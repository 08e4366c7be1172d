"""How much one request may ask of the server: body bytes, `n`, prompts, sequences, template
rendering time. Each limit is a flag (ServerConfig's "request limits" group, which checks them); a
request over one gets a 400 (413 for the body) naming the field and the flag, before anything is
tokenised or queued."""

from __future__ import annotations

from dataclasses import dataclass

from tengyun.entrypoints.openai.protocol import RequestError

BYTES_PER_TOKEN = 32  # JSON of a token's text, with room: a \uXXXX escape takes 6 bytes per character
MIN_REQUEST_BYTES = 1 << 20  # tool definitions and chat framing fit even with a tiny --max-model-len


def default_max_request_bytes(max_model_len: int) -> int:
    """A body larger than this cannot hold a prompt that fits --max-model-len: 32 bytes a token,
    at least 1 MiB. --max-model-len 32768 -> 1 MiB; 131072 -> 4 MiB."""
    return max(MIN_REQUEST_BYTES, BYTES_PER_TOKEN * max_model_len)


@dataclass(frozen=True)
class RequestLimits:
    max_request_bytes: int = MIN_REQUEST_BYTES
    max_n: int = 128
    max_prompts_per_request: int = 256
    max_seqs_per_request: int = 256  # n x prompts; default --max-num-seqs
    chat_template_timeout_s: float = 10.0
    trust_request_chat_template: bool = False


def check_sequence_counts(limits: RequestLimits, n: int, num_prompts: int) -> None:
    """n, the number of prompts and their product against the limits; RequestError names the field."""
    if n < 1:
        raise RequestError(f"n must be at least 1, got {n}.", "n")
    if n > limits.max_n:
        raise RequestError(f"n is {n} but this server allows at most {limits.max_n} (--max-n).", "n")
    if num_prompts > limits.max_prompts_per_request:
        raise RequestError(f"The request lists {num_prompts} prompts but this server allows at most "
                           f"{limits.max_prompts_per_request} (--max-prompts-per-request): send them in "
                           f"several requests.", "prompt")
    if n * num_prompts > limits.max_seqs_per_request:
        raise RequestError(f"n={n} over {num_prompts} prompts is {n * num_prompts} sequences but this server "
                           f"allows at most {limits.max_seqs_per_request} per request (--max-seqs-per-request): "
                           f"lower n or send fewer prompts.", "n")
