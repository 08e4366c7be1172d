"""Hermes / Qwen2.5 / Qwen3 tool calls: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`."""

from __future__ import annotations

import json

from tengyun.entrypoints.openai.tool_parsers.base import ParsedToolCall, ToolParser


class HermesToolParser(ToolParser):
    def parse_call(self, body: str) -> ParsedToolCall | None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models send the arguments JSON-encoded
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))

