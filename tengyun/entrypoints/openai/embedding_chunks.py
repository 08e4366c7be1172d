"""vLLM's chunked processing of long /v1/embeddings inputs (--pooler-config
'{"enable_chunked_processing": true, "max_embed_len": N}'): an input longer than one chunk is
split into chunks, each chunk is pooled as a request of its own (all of them batched by the
scheduler), and the input's embedding is the chunks' outputs averaged, weighted by their tokens:

    1,000 tokens, chunks of 512 -> [0:512] e0, [512:1000] e1 -> (512 e0 + 488 e1) / 1000

as vLLM 0.11 aggregates them (each chunk's output as the pooler returns it, normalized or not; the
average is not normalized again). With MEAN pooling this is the mean of the chunks' token states.
A chunk is min(--max-model-len, max_position_embeddings) tokens; an input is taken up to
max_embed_len tokens (without it: --max-model-len, so nothing is split).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tengyun.entrypoints.openai.request_model import RequestError
from tengyun.pooling_outputs import PoolingOutput, PoolingRequestOutput
from tengyun.pooling_params import PoolingParams


def chunks_of(token_ids: list[int], size: int) -> list[list[int]]:
    """[1, 2, 3, 4, 5], 2 -> [[1, 2], [3, 4], [5]]"""
    return [token_ids[i:i + size] for i in range(0, len(token_ids), size)]


def check_embed_length(n_tokens: int, max_embed_len: int | None, max_model_len: int) -> None:
    """vLLM's refusal of an input over the longest the server takes (its words)."""
    limit, what = (max_embed_len, "maximum embedding input length") if max_embed_len else \
        (max_model_len, "maximum context length")
    if n_tokens > limit:
        raise RequestError(f"This model's {what} is {limit} tokens. However, you requested {n_tokens} tokens in the "
                           f"input for embedding generation. Please reduce the length of the input.", "input")


async def embed_in_chunks(serving: Any, request_id: str, token_lists: list[list[int]], params: PoolingParams,
                          field: str) -> list[PoolingRequestOutput]:
    """One output per input of ``token_lists``, in order. ``serving``: the OpenAIServingPooling whose
    run_token_lists pools the chunks."""
    config = serving.engine.config
    size = min(config.max_model_len, config.model_spec.max_position_embeddings)
    pieces, owners = [], []  # chunk token ids; the input each chunk belongs to
    for index, ids in enumerate(token_lists):
        check_embed_length(len(ids), config.pooling.max_embed_len, config.max_model_len)
        for piece in chunks_of(ids, size):
            pieces.append(piece)
            owners.append(index)
    outputs = await serving.run_token_lists(request_id, pieces, [params] * len(pieces), field)
    sums: dict[int, np.ndarray] = {}
    for owner, piece, output in zip(owners, pieces, outputs):
        weighted = np.asarray(output.outputs.data, dtype=np.float64) * len(piece)
        sums[owner] = weighted if owner not in sums else sums[owner] + weighted
    return [PoolingRequestOutput(f"{request_id}-{i}", PoolingOutput((sums[i] / len(ids)).tolist()), list(ids))
            for i, ids in enumerate(token_lists)]
