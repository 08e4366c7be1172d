"""ToolParser: the `<tool_call>...</tool_call>` blocks shared by Qwen's formats; subclasses read one
block's body (JSON for hermes, XML for qwen3_coder), a call each.

    "Let me check.\\n<tool_call>\\nBODY\\n</tool_call>"  ->  content "Let me check.", calls [parse(BODY)]

Streaming parses the text so far with final=False: a block still open (and a partial
"<tool_call>" or trailing whitespace at the end) is held back, so each result's content extends
the previous one and its calls list only grows; a call is sent whole once its block closes. A
closed block whose body does not parse stays in the content as text (logged once, on the final
parse). A block cut off by max_tokens (still open at the end, body not parseable) and a start
tag cut off ("<tool_c") are markup, never content: they are dropped.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from tengyun.entrypoints.openai.reasoning_parsers.qwen3 import partial_suffix_len

logger = logging.getLogger("tengyun.tool_parser")


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class ToolParseResult:
    content: str
    calls: list[ParsedToolCall]


class ToolParser:
    start = "<tool_call>"
    end = "</tool_call>"

    def __init__(self, tools: list[dict[str, Any]] | None = None):
        # {"name": {"name", "description", "parameters"}} from the request's tools[].function
        self.functions = {t["function"]["name"]: t["function"] for t in tools or [] if "function" in t}

    def parse_call(self, body: str) -> ParsedToolCall | None:
        """One block's body -> a call, or None when it does not parse."""
        raise NotImplementedError

    def body_complete(self, body: str) -> bool:
        """Whether a block missing its end tag still holds a whole call (JSON that parses does)."""
        return True

    def parse(self, text: str, final: bool = True) -> ToolParseResult:
        content, calls, pos, dropped = [], [], 0, False
        while True:
            i = text.find(self.start, pos)
            if i == -1:
                tail = text[pos:]
                cut = partial_suffix_len(tail, self.start)
                if not final or calls or cut >= 2:  # "<t", "<tool_c": a call cut off by max_tokens
                    tail, dropped = tail[:len(tail) - cut], dropped or cut > 0
                content.append(tail)
                break
            content.append(text[pos:i])
            j = text.find(self.end, i + len(self.start))
            if j == -1 and not final:
                break  # the block is still being written
            stop = len(text) if j == -1 else j  # an unclosed block at the very end is read as is
            after = len(text) if j == -1 else j + len(self.end)
            body = text[i + len(self.start):stop]
            call = self.parse_call(body) if j != -1 or self.body_complete(body) else None
            if call is None and j == -1:
                logger.info("Dropped a tool call cut off before its end: %r", text[i:][:200])
                dropped = True
            elif call is None:
                if final:
                    logger.warning("A tool call does not parse; returning it as content: %r", text[i:after][:200])
                content.append(text[i:after])
            else:
                calls.append(call)
            pos = after
        joined = "".join(content)
        # Trailing whitespace waits for what follows; around calls it is only layout.
        return ToolParseResult(joined.rstrip() if calls or dropped or not final else joined, calls)
