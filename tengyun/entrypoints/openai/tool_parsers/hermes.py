"""Hermes / Qwen2.5 / Qwen3 tool calls: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`."""

from __future__ import annotations

import json
from typing import Any

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

    def forced_tag(self, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        from tengyun.structured_output import import_xgrammar

        xgrammar = import_xgrammar()  # missing: a 400 that says how to install it, not a 500
        # Compact JSON (`{"a": 1}`): a small model cannot wander off into whitespace.
        body = str(xgrammar.Grammar.from_json_schema(json.dumps(parameters), any_whitespace=False))
        return {"type": "tag",
                "begin": f'{self.start}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ',
                "content": {"type": "grammar", "grammar": body},
                "end": f"}}\n{self.end}"}
