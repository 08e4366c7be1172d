"""Reasoning parsers, by --reasoning-parser name: split a model's thinking from its answer."""

from __future__ import annotations

from tengyun.entrypoints.openai.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from tengyun.entrypoints.openai.reasoning_parsers.qwen3 import Qwen3ReasoningParser

# deepseek_r1: the same tags, the output starting inside the reasoning (as vLLM's parser reads R1)
REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser}


def get_reasoning_parser(name: str) -> type[Qwen3ReasoningParser]:
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is unknown; choose one of {sorted(REASONING_PARSERS)}.")
    return REASONING_PARSERS[name]
