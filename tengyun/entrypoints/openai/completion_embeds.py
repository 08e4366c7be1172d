"""prompt_embeds on /v1/completions (--enable-prompt-embeds), as vLLM 0.11 reads them: base64 of a
torch.save()d float32 / bfloat16 / float16 tensor [seq_len, hidden_size] ([1, seq_len, hidden_size]
squeezed), or a list of them; each is one prompt, answered before the request's text or token-id
prompts. truncate_prompt_tokens keeps the last rows. Echo and prompt_logprobs are refused with
vLLM's words (an embeddings prompt has no tokens to show or score)."""

from __future__ import annotations

import asyncio

from tengyun.entrypoints.openai.protocol import CompletionRequest, RequestError
from tengyun.prompt_embeds import NOT_ENABLED, PromptEmbeds

FIELD = "prompt_embeds"


async def load_prompt_embeds(request: CompletionRequest, enabled: bool, hidden_size: int,
                             max_model_len: int) -> list[PromptEmbeds]:
    """The request's embeddings prompts, checked against the model; [] when it sends none.
    Raises RequestError (400) naming the field (or --enable-prompt-embeds when it is off)."""
    if not request.prompt_embeds:
        return []
    if not enabled:
        raise RequestError(NOT_ENABLED, FIELD)
    if request.echo:
        raise RequestError("Echo is unsupported with prompt embeds.", "echo")
    if request.prompt_logprobs is not None:
        raise RequestError("prompt_logprobs is not compatible with prompt embeds.", "prompt_logprobs")
    items = request.prompt_embeds if isinstance(request.prompt_embeds, list) else [request.prompt_embeds]
    try:
        embeds = await asyncio.to_thread(_decode_all, items)  # torch.load: off the event loop
        for item in embeds:
            item.check_against_model(enabled, hidden_size)
    except ValueError as e:
        raise RequestError(str(e), FIELD) from None
    keep = request.truncate_prompt_tokens
    if keep is None:
        return embeds
    keep = max_model_len if keep == -1 else keep
    return [PromptEmbeds(e.data[-keep:], e.dtype) for e in embeds]


def _decode_all(items: list[str]) -> list[PromptEmbeds]:
    from tengyun.prompt_embeds_codec import decode_base64  # torch: imported on the first such request

    return [decode_base64(item, FIELD) for item in items]
