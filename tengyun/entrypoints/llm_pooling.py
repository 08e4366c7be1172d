"""LLM's pooling methods (a model built with runner="pooling"), shaped like vLLM 0.11's:

    llm = LLM(model="/models/Qwen3-Embedding-0.6B", runner="pooling")
    llm.embed(["What is the capital of China?"])[0].outputs.embedding      # list[float]
    llm.classify(["A great film"])[0].outputs.probs                          # list[float], one per label
    llm.score("query", ["doc 1", "doc 2"])[1].outputs.score                  # float
    llm.encode(["text"], pooling_task="encode")[0].outputs.data              # tensor [T, H], one row per token

score() of an embedding model is the cosine similarity of the two embeddings; of a classifier
(a cross-encoder such as Qwen3-Reranker) the first label of the pair's classification.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence as Seq

from tengyun.pooling_outputs import (
    ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput, ScoringOutput, ScoringRequestOutput,
)
from tengyun.pooling_params import PoolingParams

logger = logging.getLogger(__name__)

class LLMPoolingMixin:
    """Mixed into LLM: needs its llm_engine, _request_ids, _run and _drain."""

    def encode(self, prompts: Any, pooling_params: PoolingParams | Seq[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = False,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """Pooled outputs, ``data`` a tensor: pooling_task "encode" gives one row per prompt token;
        "embed", "classify", "reward" that task's output. None, as vLLM 0.11: "embed" where the
        model embeds, else "encode" (logged once: name the task, or call embed() / classify())."""
        import torch

        if pooling_task is None:
            model = self.llm_engine.config.pooling
            pooling_task = "embed" if model is not None and "embed" in model.tasks else "encode"
            logger.warning("LLM.encode without pooling_task runs pooling_task=%r; pass pooling_task, or call "
                           "embed() / classify() / reward().", pooling_task)
        outputs = self._pool(prompts, pooling_params, pooling_task, truncate_prompt_tokens, use_tqdm)
        for output in outputs:
            output.outputs.data = torch.tensor(output.outputs.data)
        return outputs

    def embed(self, prompts: Any, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = False,
              pooling_params: PoolingParams | Seq[PoolingParams] | None = None) -> list[EmbeddingRequestOutput]:
        outputs = self._pool(prompts, pooling_params, "embed", truncate_prompt_tokens, use_tqdm)
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def classify(self, prompts: Any, *, use_tqdm: bool = False,
                 pooling_params: PoolingParams | Seq[PoolingParams] | None = None) -> list[ClassificationRequestOutput]:
        outputs = self._pool(prompts, pooling_params, "classify", None, use_tqdm)
        return [ClassificationRequestOutput.from_base(output) for output in outputs]

    def reward(self, prompts: Any, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = False,
               pooling_params: PoolingParams | Seq[PoolingParams] | None = None) -> list[PoolingRequestOutput]:
        return self._pool(prompts, pooling_params, "reward", truncate_prompt_tokens, use_tqdm)

    def score(self, data_1: str | Seq[str], data_2: str | Seq[str], *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = False, pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """One score per pair: data_1 one text against each of data_2, or the i-th against the i-th."""
        pairs = score_pairs(data_1, data_2)
        model = self.llm_engine.config.pooling
        if model is None:
            raise ValueError("score() needs a pooling model: build the LLM with runner=\"pooling\".")
        if model.convert == "embed":
            texts = list(dict.fromkeys(t for pair in pairs for t in pair))
            embedded = self._pool(texts, pooling_params, "embed", truncate_prompt_tokens, use_tqdm)
            by_text = dict(zip(texts, embedded))
            return [_cosine_output(by_text[a], by_text[b]) for a, b in pairs]
        tokenizer = self.llm_engine.tokenizer
        prompts = [tokenizer(text=a, text_pair=b)["input_ids"] for a, b in pairs]
        outputs = self._pool(prompts, pooling_params, "score", truncate_prompt_tokens, use_tqdm)
        return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])), o.prompt_token_ids,
                                     o.finished, o.num_cached_tokens) for o in outputs]

    def _pool(self, prompts: Any, pooling_params: Any, task: str, truncate_prompt_tokens: int | None,
              use_tqdm: bool) -> list[PoolingRequestOutput]:
        from tengyun.entrypoints.llm import _as_prompt_list

        prompt_list = _as_prompt_list(prompts)
        params_list = _pooling_params_list(pooling_params, len(prompt_list), task, truncate_prompt_tokens)
        return self._run(self._add_all((prompt, params, None) for prompt, params in zip(prompt_list, params_list)),
                         use_tqdm)


def score_pairs(data_1: str | Seq[str], data_2: str | Seq[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against each of the others, or the i-th against the i-th."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second) or not second:
        raise ValueError(f"score takes one text_1 for every text_2, or as many of each: got {len(first)} and "
                         f"{len(second)}.")
    return list(zip(first, second))


def _pooling_params_list(params: Any, count: int, task: str, truncate: int | None) -> list[PoolingParams]:
    if params is None or isinstance(params, PoolingParams):
        params = [params or PoolingParams()] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"pooling_params has {len(params)} entries but there are {count} prompts.")
    extra = {"truncate_prompt_tokens": truncate} if truncate is not None else {}
    return [dataclasses.replace(p, task=task, **extra) for p in params]


def _cosine_output(a: PoolingRequestOutput, b: PoolingRequestOutput) -> ScoringRequestOutput:
    x, y = list(a.outputs.data), list(b.outputs.data)
    dot = sum(p * q for p, q in zip(x, y))
    norm = (sum(p * p for p in x) ** 0.5) * (sum(q * q for q in y) ** 0.5)
    return ScoringRequestOutput(f"{a.request_id}_{b.request_id}", ScoringOutput(dot / max(norm, 1e-12)),
                                a.prompt_token_ids + b.prompt_token_ids, True)
