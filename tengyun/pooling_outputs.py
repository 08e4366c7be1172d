"""What a pooling request returns, under vLLM 0.11's class names. The engine builds
PoolingRequestOutput with plain lists (it imports no torch); LLM.encode() hands ``data`` back as
a tensor, as vLLM does; embed(), classify() and score() wrap the lists in their typed outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

_O = TypeVar("_O")


@dataclass
class PoolingOutput:
    # One pooled row: [D] (LAST / MEAN / CLS), or one row per prompt token: [T, D] (ALL: encode, reward).
    # A nested list from the engine; a torch.Tensor from LLM.encode().
    data: Any


@dataclass
class PoolingRequestOutput(Generic[_O]):
    request_id: str
    outputs: _O
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (LAST pooling only)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]  # per label; after softmax / sigmoid unless the request turned activation off

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(output.request_id, EmbeddingOutput(_as_list(output.outputs.data)), output.prompt_token_ids,
                   output.finished, output.num_cached_tokens)


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return cls(output.request_id, ClassificationOutput(_as_list(output.outputs.data)), output.prompt_token_ids,
                   output.finished, output.num_cached_tokens)


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    pass


def _as_list(data: Any) -> list:
    return data.tolist() if hasattr(data, "tolist") else list(data)
