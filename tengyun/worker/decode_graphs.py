"""Decode steps replayed from captured graphs (CUDA graphs, unless --enforce-eager).

A step whose sequences all decode one token each, n of them, runs at the smallest captured
batch size B >= n: its inputs are copied into static buffers, rows n..B-1 are padding, and
the graph captured for B is replayed. Padding rows are a one-token sequence at position 0
whose block table is all ``pad_block`` and whose state slot is ``pad_slot``: one KV block and
one recurrent-state slot allocated beyond what the scheduler hands out, so padding never
touches a real sequence's cache. Attention reads a static context of max_blocks * block_size
tokens (``AttentionMetadata.decode_max_len``), masked per row by its length.

What is captured is the model's forward only; logits and sampling run eagerly after it.
Capturing is the platform's (``Platform.capture_graph``): it runs the forward once to record
it and returns a function that replays it and returns its output tensor (CUDA graphs; on CPU a
TorchScript trace, platforms/cpu/runtime/graphs.py), or None for a size it cannot record, which then
runs eager. ``Platform.graph_batch_limit`` caps the sizes (CPU: the rows its compiled linears take).
"""

from __future__ import annotations

import bisect
import logging
from typing import Callable

import torch
from torch import nn

from tengyun.layers.attention.metadata import AttentionMetadata, attention_metadata

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """vLLM's batch sizes: 1, 2, 4, then every multiple of 8, up to max_batch (included)."""
    sizes = [s for s in [1, 2, 4] + list(range(8, max_batch + 1, 8)) if s <= max_batch]
    return sizes if sizes[-1] == max_batch else sizes + [max_batch]


def written_state(model: nn.Module) -> list[torch.Tensor]:
    """The tensors a forward writes in place: those the worker binds to modules as plain
    attributes (KV caches, Gated DeltaNet's conv and recurrent state), never parameters or
    buffers (which live in a module's own dicts, not among its attributes)."""
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and value.numel():
                found.setdefault(id(value), value)
    return list(found.values())


class DecodeGraphs:
    def __init__(self, model: nn.Module, capture: Callable[..., Callable[[], torch.Tensor] | None],
                 max_batch: int, max_blocks: int, block_size: int, pad_block: int, pad_slot: int,
                 device: torch.device):
        self.model = model
        self.sizes = capture_sizes(max_batch)
        self.max_len = max_blocks * block_size
        self.pad_block, self.pad_slot, self.block_size = pad_block, pad_slot, block_size
        b = self.sizes[-1]
        # Static inputs, [b] or [b, max_blocks]; a replay reads whatever they hold.
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(b, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((b,), pad_block * block_size, dtype=torch.int64, device=device)
        self.block_tables = torch.full((b, max_blocks), pad_block, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(b, dtype=torch.int64, device=device)
        self.state_slots = torch.full((b,), pad_slot, dtype=torch.int64, device=device)
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}
        state = written_state(model)
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: later captures reuse its memory
                replay = capture(lambda size=size: self._forward(size), state, first=size == self.sizes[-1])
                if replay is not None:  # None: the platform cannot record this size; it runs eager
                    self.replays[size] = replay
        self.sizes = sorted(self.replays)
        self.steps = {size: 0 for size in self.sizes}  # replays per size (tests, logs)
        logger.info("Captured decode graphs for batch sizes %s (context %d tokens)", self.sizes, self.max_len)

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:size], num_decode_tokens=size,
                                 decode_block_tables=self.block_tables[:size], decode_seq_lens=self.seq_lens[:size],
                                 decode_state_slots=self.state_slots[:size], decode_max_len=self.max_len)
        with attention_metadata(meta):
            return self.model(self.input_ids[:size], self.positions[:size], None)

    def fits(self, meta: AttentionMetadata) -> bool:
        """Decodes only, no more than the largest captured batch."""
        return not meta.prefills and bool(self.sizes) and 0 < meta.num_decode_tokens <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A decode-only step of n sequences -> hidden states [n, hidden] (a view of the static output)."""
        n = meta.num_decode_tokens
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        tables = meta.decode_block_tables  # [n, blocks of the longest], blocks <= max_blocks
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:size].fill_(self.pad_block)
        self.block_tables[:n, : tables.shape[1]].copy_(tables)
        self.seq_lens[:n].copy_(meta.decode_seq_lens)
        if meta.decode_state_slots is not None:
            self.state_slots[:n].copy_(meta.decode_state_slots)
        # Rows n..size-1: padding (see the module docstring).
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[n:size].fill_(self.pad_block * self.block_size)
        self.seq_lens[n:size].fill_(1)
        self.state_slots[n:size].fill_(self.pad_slot)
        self.steps[size] += 1
        return self.replays[size]()[:n]
