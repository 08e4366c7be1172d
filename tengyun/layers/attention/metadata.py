"""The per-step attention context: set by the model runner, read by every Attention layer.

The batch is laid out with single-token sequences ("decodes") first, then multi-token
chunks ("prefills"): query tokens [0, num_decode_tokens) are one per decode sequence.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunk:
    query_start: int  # first query token of this chunk in the flat batch
    query_len: int
    context_len: int  # tokens already in the cache before this chunk (0 = fresh prompt)
    block_table: torch.Tensor  # [num_blocks] int64, enough blocks for context_len + query_len
    state_slot: int = -1  # hybrid models: the sequence's recurrent-state slot


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block * block_size + offset) per token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64 (padded with 0)
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] int64, including the new token
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode_state_slots: torch.Tensor | None = None  # [num_decodes] int64, hybrid models only
    # Context length decodes attend over when it must be static (graph replay: every row's
    # table padded to max_blocks); None: the longest decode's length, computed per step.
    decode_max_len: int | None = None
    # Backend-owned scratch computed once per step and shared by all layers (e.g. masks).
    backend_state: dict = field(default_factory=dict)


_CURRENT: AttentionMetadata | None = None


def get_attention_metadata() -> AttentionMetadata:
    assert _CURRENT is not None, "attention called outside a model-runner step"
    return _CURRENT


@contextlib.contextmanager
def attention_metadata(meta: AttentionMetadata):
    global _CURRENT
    _CURRENT = meta
    try:
        yield meta
    finally:
        _CURRENT = None
