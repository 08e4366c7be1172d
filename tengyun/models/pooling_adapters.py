"""A decoder turned into a pooling model (vLLM's as_embedding_model / as_seq_cls_model): the
*ForCausalLM class of the family, without its LM head, with a pooler over its last hidden states
and, to classify, a score layer [num_labels, hidden] (HF's name "score.weight").

Checkpoints it loads:
    Qwen3Model (Qwen3-Embedding)              names without "model." ("layers.0...", "norm.weight")
    Qwen3ForSequenceClassification            "model.*" and "score.weight"
    *ForCausalLM + classifier_from_token      the score rows are the LM head's rows of those tokens;
                                              is_original_qwen3_reranker: one row, "yes" minus "no"
                                              (sigmoid(l_yes - l_no) = softmax([l_no, l_yes])[1])
The LM head's tensors are skipped (a pipeline-missing layer); a tied model's head rows come from
the embedding, which stays loaded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tengyun.distributed.parallel_state import is_last_pp_rank
from tengyun.layers.pooler import Pooler
from tengyun.model_spec import ModelSpec
from tengyun.models.pipeline import PPMissingLayer
from tengyun.pooling_config import PoolingModel

_PREFIXES = ("model.", "lm_head.", "score.", "mtp.")  # names of a checkpoint saved with its head


def pooling_model_class(base: type, pooling: PoolingModel, from_token_ids: tuple[int, ...] | None) -> type:
    """A subclass of ``base`` (a *ForCausalLM) for ``pooling``; ``from_token_ids``: the token ids of
    classifier_from_token (None: the checkpoint has a score layer, or the model embeds)."""

    class PoolingAdapter(base):
        def __init__(self, spec: ModelSpec, max_position: int, dtype: torch.dtype):
            super().__init__(spec, max_position, dtype)
            self.head_tied = spec.tie_word_embeddings  # the LM head's rows are the embedding's
            self.tie_word_embeddings = False  # the head's rows, if any, are read into `score`
            self.lm_head = PPMissingLayer()
            last = is_last_pp_rank()
            if pooling.convert == "embed":
                self.pooler = Pooler(pooling, None) if last else None
                return
            # Replicated on every TP rank: [num_labels, hidden] is small, and the hidden states are whole.
            self.score = nn.Linear(spec.hidden_size, pooling.num_labels, bias=False, dtype=dtype) if last \
                else PPMissingLayer()
            self.pooler = Pooler(pooling, self.score) if last else None

        def compute_logits(self, hidden: torch.Tensor) -> None:
            raise RuntimeError("a pooling model has no LM head: it pools, it does not sample")

        def checkpoint_rename(self, name: str) -> str | None:
            """A bare decoder checkpoint (Qwen3Model) names its tensors without "model."."""
            parent = getattr(base, "checkpoint_rename", None)
            renamed = parent(self, name) if parent else name
            if renamed is None or renamed.startswith(_PREFIXES):
                return renamed
            return "model." + renamed

        def checkpoint_transform(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
            """The LM head's tensor (the embedding's, when tied) -> also the score rows of the tokens."""
            parent = getattr(base, "checkpoint_transform", None)
            parts = parent(self, name, tensor) if parent else None
            if from_token_ids is None or name != _head_source(self.head_tied):
                return parts
            ids = torch.tensor(from_token_ids, device=tensor.device)
            rows = tensor.index_select(0, ids)  # [len(tokens), hidden]
            if pooling.original_qwen3_reranker:
                rows = rows[1:2] - rows[0:1]  # [1, hidden]: "yes" minus "no"
            kept = [] if name.startswith("lm_head.") else (parts or [(name, tensor)])
            return [*kept, ("score.weight", rows)]

    PoolingAdapter.__name__ = PoolingAdapter.__qualname__ = f"{base.__name__}As{pooling.convert.capitalize()}"
    return PoolingAdapter


def _head_source(tied: bool) -> str:
    return "model.embed_tokens.weight" if tied else "lm_head.weight"


def classifier_token_ids(tokenizer: Any, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """classifier_from_token's tokens -> their ids; ValueError naming one the vocabulary lacks."""
    ids = []
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token):
            raise ValueError(f"--hf-overrides classifier_from_token: {token!r} is not a token of this model's "
                             f"vocabulary; name tokens of its tokenizer.")
        ids.append(int(token_id))
    return tuple(ids)
