"""RequiredCallsParser: the answer to tool_choice "required", in vLLM 0.11's form. A JSON schema
(`required_calls_schema`) makes the whole output an array of calls, each naming one of the tools
and carrying arguments valid against that tool's parameters, so the format is the same whatever
--tool-call-parser is set (or none):

    '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}]'
        ->  content "", calls [get_weather({"city": "Paris", "days": 3})]
    '[{"name": "get_weather", "parameters": {"ci'   (max_tokens)  ->  content "", no call

Streaming holds everything back until the answer ends, then sends the calls whole, as the
named-call parser does.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from tengyun.entrypoints.openai.tool_parsers.base import ParsedToolCall, ToolParser, ToolParseResult

logger = logging.getLogger("tengyun.tool_parser")

NO_PARAMETERS = {"type": "object", "properties": {}}


def required_calls_schema(functions: list[dict[str, Any]], parallel_tool_calls: bool) -> dict[str, Any]:
    """The array schema of one or more calls (exactly one when parallel_tool_calls is false).
    Each tool's `$defs` move to the top level, where `$ref: "#/$defs/X"` resolves; two tools that
    define the same name differently cannot share it: a ValueError naming the definition."""
    defs: dict[str, Any] = {}
    alternatives = []
    for function in functions:
        parameters = dict(function.get("parameters") or NO_PARAMETERS)
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise ValueError(f"tools define '$defs/{name}' twice with different schemas; "
                                 "rename one of them.")
        alternatives.append({"properties": {"name": {"type": "string", "enum": [function["name"]]},
                                            "parameters": parameters},
                             "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": alternatives}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class RequiredCallsParser(ToolParser):
    def parse(self, text: str, final: bool = True) -> ToolParseResult:
        if not final:
            return ToolParseResult("", [])
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            items = None
        calls = [ParsedToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                 for item in items if _is_call(item)] if isinstance(items, list) else []
        if not calls:  # cut off by max_tokens (finish_reason "length" says so)
            logger.info("Dropped required tool calls that do not parse: %r", text[:200])
        return ToolParseResult("", calls)


def _is_call(item: Any) -> bool:
    return isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("parameters"), dict)
