"""MtpProposer: drafts from Qwen3.5's MTP head (models/qwen3_5_mtp.py) after each target step.

1. Catch-up: the head runs over every position the target computed this step, in the step's
   own batch layout and attention metadata, writing its KV there: position p reads the token
   at p + 1 (now known: a prompt token, an accepted draft or this step's sampled token) and the
   target's hidden state at p. Rows past a sequence's tokens (rejected drafts) read token 0;
   their KV is rewritten before any later step reads it.
2. Draft 1 of each sequence that sampled is the argmax at its last accepted position (L - 2,
   L = its tokens now): it predicts token L, after the sampled one.
3. Drafts 2..K: one decode step each at positions L - 1, L, ..., reading the previous draft and
   the head's previous output. Their KV goes into the blocks the sequence held during the step
   (all still unwritten by anyone else until the next step) and past them into scratch blocks
   after the engine's (``scratch_per_seq`` per batch row), so no block is allocated for drafts.
Drafts are greedy (point masses), which the verification rule (spec_decode/verify.py) assumes.

Tensor parallel: every TP rank of the last pipeline stage runs the head on its shard; TP rank 0
alone gets logits, so each draft's argmax is broadcast to the others before it is embedded. Those
ranks learn the step's new tokens from the sampling rank (``share_new_tokens``) for the catch-up.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tengyun.distributed.parallel_state import get_tp_size, tensor_model_parallel_broadcast
from tengyun.layers.attention.layer import Attention
from tengyun.layers.attention.metadata import AttentionMetadata, attention_metadata
from tengyun.layers.kernels import KernelBundle, bind_kernels
from tengyun.models.loader import load_weights
from tengyun.models.qwen3_5_mtp import Qwen3_5MultiTokenPredictor


class MtpProposer:
    def __init__(self, head: Qwen3_5MultiTokenPredictor, target: nn.Module, num_spec_tokens: int, block_size: int,
                 first_scratch_block: int, scratch_per_seq: int, device: torch.device):
        self.head, self.target = head, target
        self.num_spec_tokens, self.block_size = num_spec_tokens, block_size
        self.first_scratch_block, self.scratch_per_seq = first_scratch_block, scratch_per_seq
        self.device = device

    @staticmethod
    def load_head(config, target: nn.Module, kernels: KernelBundle, dtype: torch.dtype,
                  device: torch.device) -> Qwen3_5MultiTokenPredictor:
        """The head with its weights: ``mtp.*`` of the checkpoint (and, on a pipeline stage without
        the target's embedding, its own copy of it). Loaded before the KV cache is sized, so an
        accelerator's budget sees its memory in use."""
        with torch.device(device):
            head = Qwen3_5MultiTokenPredictor(config.model_spec, config.max_model_len, dtype, target).eval()
        load_weights(head, config.model_path, config.load_format, seed=config.seed + 1)
        bind_kernels(head, kernels)
        return head

    @classmethod
    def build(cls, config, head: Qwen3_5MultiTokenPredictor, target: nn.Module, num_blocks: int,
              kv_dtype: torch.dtype, device: torch.device) -> "MtpProposer":
        """The proposer with the head's own KV cache: the engine's ``num_blocks`` block ids, then
        scratch blocks for draft positions."""
        k, bs = config.speculative_config.num_speculative_tokens, config.block_size
        scratch_per_seq = -(-k // bs) + 1
        layers = [m for m in head.modules() if isinstance(m, Attention)]
        cache = torch.zeros(2, len(layers), num_blocks + config.max_num_seqs * scratch_per_seq, bs,
                            layers[0].num_kv_heads, layers[0].head_dim, dtype=kv_dtype, device=device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
        return cls(head, target, k, bs, num_blocks, scratch_per_seq, device)

    def propose(self, chunks: list[tuple[int, int, int, int]], positions: torch.Tensor, meta: AttentionMetadata,
                hidden: torch.Tensor, token_ids: dict[int, list[int]], tables: dict[int, list[int]],
                sampled: list[int]) -> dict[int, list[int]]:
        """chunks: (seq_id, first row, rows, first position) of this step's batch; hidden [T, H]
        the target's; token_ids: each sequence's tokens now; tables: the block tables it held in
        the step; sampled: the sequences that got tokens. -> {seq_id: K drafts}."""
        next_ids = np.zeros(len(positions), dtype=np.int64)
        anchors = []  # (seq_id, row of its last accepted position, that position + 1)
        for seq_id, row, n, start in chunks:
            known = token_ids[seq_id][start + 1:start + n + 1]
            next_ids[row:row + len(known)] = known
            if seq_id in sampled:
                last = len(token_ids[seq_id]) - 2  # the position whose output predicts the next token
                anchors.append((seq_id, row + last - start, last + 1))
        with attention_metadata(meta):
            out = self.head(self._embed(torch.from_numpy(next_ids).to(self.device)), hidden, positions)
        if not anchors:  # a step of prompt chunks only: the head's KV caught up, no drafts yet
            return {}
        rows = torch.tensor([a[1] for a in anchors], device=self.device)
        out, draft = out[rows], self._argmax(out[rows])
        drafts = [draft]
        for step in range(1, self.num_spec_tokens):
            pos = [a[2] + step - 1 for a in anchors]  # L - 1, L, ...
            with attention_metadata(self._decode_metadata([tables[a[0]] for a in anchors], pos)):
                out = self.head(self._embed(draft), out, torch.tensor(pos, device=self.device), step)
            draft = self._argmax(out)
            drafts.append(draft)
        columns = torch.stack(drafts, dim=1).tolist()  # [B, K]
        return {seq_id: row for (seq_id, _, _), row in zip(anchors, columns)}

    def share_new_tokens(self, seq_ids: list[int], new_tokens: dict[int, list[int]] | None) -> dict[int, list[int]]:
        """The step's new tokens of ``seq_ids`` (the sequences that sampled, in the same order on
        every rank), from TP rank 0 (``new_tokens``; None on the other TP ranks) to all TP ranks
        of this stage. Each sequence gains 1 .. K + 1 tokens: [S, K + 1], -1 past its count."""
        if get_tp_size() == 1 or not seq_ids:
            return new_tokens or {}
        table = torch.full((len(seq_ids), self.num_spec_tokens + 1), -1, dtype=torch.int64)
        if new_tokens is not None:
            for row, seq_id in enumerate(seq_ids):
                table[row, :len(new_tokens[seq_id])] = torch.tensor(new_tokens[seq_id])
        rows = tensor_model_parallel_broadcast(table.to(self.device)).tolist()
        return {seq_id: [t for t in row if t >= 0] for seq_id, row in zip(seq_ids, rows)}

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.embed(ids)

    def _argmax(self, out: torch.Tensor) -> torch.Tensor:
        """out [B, H] -> [B] greedy tokens, on every TP rank (logits exist on TP rank 0 only)."""
        logits = self.target.compute_logits(out)
        tokens = logits.argmax(dim=-1) if logits is not None else torch.empty(len(out), dtype=torch.int64,
                                                                                device=self.device)
        return tensor_model_parallel_broadcast(tokens)

    def _decode_metadata(self, tables: list[list[int]], positions: list[int]) -> AttentionMetadata:
        """One decode row per sequence at ``positions``; blocks past its table are its scratch ones."""
        bs = self.block_size
        width = max(p // bs + 1 for p in positions)
        rows = np.zeros((len(tables), width), dtype=np.int64)
        for i, table in enumerate(tables):
            scratch = self.first_scratch_block + i * self.scratch_per_seq
            full = table[:width] + [scratch + j for j in range(max(0, width - len(table)))]
            rows[i, :len(full)] = full[:width]
        pos = np.asarray(positions, dtype=np.int64)
        slots = rows[np.arange(len(tables)), pos // bs] * bs + pos % bs
        tensor = lambda a: torch.from_numpy(a).to(self.device)  # noqa: E731
        return AttentionMetadata(slot_mapping=tensor(slots), num_decode_tokens=len(tables),
                                 decode_block_tables=tensor(rows), decode_seq_lens=tensor(pos + 1))
