"""A Responses request's input -> the chat messages the chat path renders, as vLLM 0.11 builds
them: instructions first as the system message, then the previous response's conversation
(previous_response_id: its messages without their system message, then its output), then the
new input.

    "Hi"                                                   -> user "Hi"
    {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}  -> user "Hi"
    {"role": "developer", ...}                             -> system (templates know no developer)
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
                                                           -> assistant with tool_calls [c1]
    {"type": "function_call_output", "call_id": "c1", "output": "42"}  -> tool "42" (tool_call_id c1)
    {"type": "reasoning", ...}                             -> dropped (the template renders no thoughts)
"""

from __future__ import annotations

from typing import Any

from tengyun.entrypoints.openai.request_model import RequestError
from tengyun.entrypoints.openai.responses_protocol import (
    FunctionCallItem, OutputItem, OutputMessage, ResponsesRequest,
)

TEXT_PARTS = ("input_text", "output_text", "text")


def chat_messages(request: ResponsesRequest, previous: list[dict] | None,
                  previous_output: list[OutputItem] | None) -> list[dict]:
    """The whole conversation the model answers, as chat messages."""
    messages: list[dict] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if previous is not None:
        # the previous request's instructions do not carry over (OpenAI's rule, vLLM's too)
        messages.extend(previous[1:] if previous and previous[0]["role"] == "system" else previous)
        messages.extend(output_messages(previous_output or []))
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
    else:
        for i, item in enumerate(request.input):
            _add_item(messages, item, f"input[{i}]")
    return messages


def output_messages(output: list[OutputItem]) -> list[dict]:
    """A response's output items as the assistant turn(s) of the next request."""
    messages: list[dict] = []
    for item in output:
        if isinstance(item, OutputMessage):
            messages.append({"role": "assistant", "content": "".join(part.text for part in item.content)})
        elif isinstance(item, FunctionCallItem):
            _add_call(messages, item.call_id, item.name, item.arguments)
    return messages


def _add_item(messages: list[dict], item: dict[str, Any], where: str) -> None:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise RequestError(f"{where}.role must be user, assistant, system or developer, got {role!r}.",
                               f"{where}.role")
        messages.append({"role": "system" if role == "developer" else role,
                         "content": _text(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        call_id, name, arguments = (_string(item, key, where) for key in ("call_id", "name", "arguments"))
        _add_call(messages, call_id, name, arguments)
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                         "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
    elif kind == "reasoning":
        return
    else:
        raise RequestError(f"{where}: input item type {kind!r} is not supported; send messages, function_call "
                           f"or function_call_output items.", f"{where}.type")


def _add_call(messages: list[dict], call_id: str, name: str, arguments: str) -> None:
    """Consecutive calls join one assistant message, as a chat answer holds them."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
        last["tool_calls"].append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{where}.{key} must be a string.", f"{where}.{key}")
    return value


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts (input_text / output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of input_text parts.", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{j}]: content part type {kind!r} is not supported; this server "
                               f"reads text parts (input_text) only.", f"{where}[{j}].type")
        texts.append(part["text"])
    return "".join(texts)
