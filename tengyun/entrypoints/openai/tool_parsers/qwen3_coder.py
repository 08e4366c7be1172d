"""Qwen3-Coder tool calls (XML), argument values typed by the tool's parameter schema:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>                      ->  get_weather({"city": "Paris", "days": 3})
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from tengyun.entrypoints.openai.tool_parsers.base import ParsedToolCall, ToolParser

_FUNCTION = re.compile(r"<function=([^>\n]+)>")
# A value ends at its </parameter>, or (models sometimes drop it) at the next parameter or </function>.
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.S)


class Qwen3CoderToolParser(ToolParser):
    def body_complete(self, body: str) -> bool:
        return "</function>" in body  # the lenient parse below would read a cut-off call as a whole one

    def parse_call(self, body: str) -> ParsedToolCall | None:
        match = _FUNCTION.search(body)
        if match is None:
            return None
        name = match.group(1).strip()
        rest = body[match.end():].split("</function>", 1)[0]
        schema = (self.functions.get(name, {}).get("parameters") or {}).get("properties") or {}
        args = {}
        for param in _PARAMETER.finditer(rest):
            key, value = param.group(1).strip(), param.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[key] = _typed(value, schema.get(key) or {})
        return ParsedToolCall(name, json.dumps(args, ensure_ascii=False))

def _typed(value: str, schema: dict[str, Any]) -> Any:
    """'3' as integer -> 3, 'true' as boolean -> True, '[1, 2]' as array -> [1, 2], ' f\n' in enum
    ["c", "f"] -> 'f'; strings stay as written."""
    kind = schema.get("type")
    if isinstance(schema.get("enum"), list):
        for option in schema["enum"]:
            if value.strip() == (option if isinstance(option, str) else json.dumps(option)):
                return option
    if isinstance(kind, list):  # ["integer", "null"]
        kind = next((k for k in kind if k != "null"), "string")
    if value.strip().lower() in ("null", "none") and kind != "string":
        return None
    if kind in (None, "string"):
        return value
    text = value.strip()
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            number = float(text)
            return int(number) if number.is_integer() and re.fullmatch(r"-?\d+", text) else number
        if kind == "boolean":
            return text.lower() == "true" if text.lower() in ("true", "false") else value
        return json.loads(text)
    except ValueError:
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return value
