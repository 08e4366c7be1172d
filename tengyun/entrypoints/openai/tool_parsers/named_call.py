"""NamedCallParser: the answer to a tool_choice that names a function, as vLLM 0.11 builds it. The
grammar (the function's parameters schema) makes the whole output that call's arguments JSON, so
the model writes only `{"city": "Paris", "days": 3}` (15 tokens on SmolLM2) and never the
`<tool_call>` wrapper around it (63); the server builds the call from the name it was given.

    '{"city": "Paris", "days": 3}'   ->  content "", calls [get_weather({"city": "Paris", "days": 3})]
    '{"city": "Par'  (max_tokens)    ->  content "", no call (arguments that do not parse are dropped)

Streaming holds everything back until the answer ends, then sends the call whole, as the
other tool parsers send a call once its block closes.
"""

from __future__ import annotations

import json
import logging

from tengyun.entrypoints.openai.tool_parsers.base import ParsedToolCall, ToolParser, ToolParseResult

logger = logging.getLogger("tengyun.tool_parser")


class NamedCallParser(ToolParser):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def parse(self, text: str, final: bool = True) -> ToolParseResult:
        if not final:
            return ToolParseResult("", [])
        arguments = text.strip()
        try:
            whole = isinstance(json.loads(arguments), dict)
        except json.JSONDecodeError:
            whole = False
        if not whole:  # cut off by max_tokens (finish_reason "length" says so)
            logger.info("Dropped the arguments of a named call to %s that do not parse: %r", self.name,
                        arguments[:200])
            return ToolParseResult("", [])
        return ToolParseResult("", [ParsedToolCall(self.name, arguments)])
