"""Tool-call parsers, by --tool-call-parser name: pull `<tool_call>` blocks out of a model's text."""

from __future__ import annotations

from tengyun.entrypoints.openai.tool_parsers.base import ParsedToolCall, ToolParser, ToolParseResult
from tengyun.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from tengyun.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "qwen3_coder": Qwen3CoderToolParser}


def get_tool_parser(name: str) -> type[ToolParser]:
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is unknown; choose one of {sorted(TOOL_PARSERS)}.")
    return TOOL_PARSERS[name]


__all__ = ["TOOL_PARSERS", "get_tool_parser", "ParsedToolCall", "ToolParser", "ToolParseResult",
           "HermesToolParser", "Qwen3CoderToolParser"]
