"""ChoiceOutputParser: one chat choice's text -> reasoning, content and tool calls, whole or as
deltas while it streams.

    text --reasoning parser--> (reasoning, rest) --tool parser--> (content, tool calls)

Both parsers read the text generated so far and hold back what may still change (a partial tag,
an open tool-call block), so the streamed deltas concatenate to exactly the whole-text result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tengyun.entrypoints.openai.reasoning_parsers.qwen3 import Qwen3ReasoningParser
from tengyun.entrypoints.openai.tool_parsers.base import ParsedToolCall, ToolParser


@dataclass
class ParsedOutput:
    reasoning: str | None
    content: str
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


class ChoiceOutputParser:
    def __init__(self, reasoning_parser: Qwen3ReasoningParser | None = None, tool_parser: ToolParser | None = None,
                 in_reasoning: bool = False):
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.in_reasoning = in_reasoning  # the prompt ended inside <think>
        self._sent = ParsedOutput("", "")  # what deltas already carried
        self._text = ""  # what add() received, while a parser reads it (unused without parsers)

    def parse(self, text: str, final: bool = True, streaming: bool = False) -> ParsedOutput:
        reasoning, rest = None, text
        if self.reasoning_parser is not None:
            reasoning, rest = self.reasoning_parser.parse(text, self.in_reasoning, final,
                                                          allow_missing_start=not streaming)
        if self.tool_parser is None:
            return ParsedOutput(reasoning, rest)
        result = self.tool_parser.parse(rest, final)
        return ParsedOutput(reasoning, result.content, result.calls)

    def delta(self, text: str, finished: bool) -> ParsedOutput:
        """What the text so far adds to the deltas already sent: (reasoning delta or None,
        content delta, calls not yet sent)."""
        now = self.parse(text, final=finished, streaming=True)
        sent = self._sent
        reasoning = (now.reasoning or "")[len(sent.reasoning or ""):]
        out = ParsedOutput(reasoning or None, now.content[len(sent.content):], now.tool_calls[len(sent.tool_calls):])
        sent.reasoning, sent.content = now.reasoning or "", now.content
        sent.tool_calls.extend(out.tool_calls)
        return out

    def add(self, new_text: str, finished: bool) -> ParsedOutput:
        """delta() fed the text's new part only (the engine's DELTA outputs). Without parsers the
        new text is the content delta as it is, so no step reads the text that came before."""
        if self.reasoning_parser is None and self.tool_parser is None:
            return ParsedOutput(None, new_text)
        self._text += new_text
        return self.delta(self._text, finished)
