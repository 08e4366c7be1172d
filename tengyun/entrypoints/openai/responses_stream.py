"""ResponseEventStream: the chat path's stream chunks -> the Responses API's typed SSE events,
in the order the OpenAI SDK's stream reader accumulates them, each with its sequence_number:

    response.created, response.in_progress
    per output item, in the order the answer holds them:
      reasoning      output_item.added, content_part.added, reasoning_text.delta ...,
                     reasoning_text.done, content_part.done, output_item.done
      message        output_item.added, content_part.added, output_text.delta ...,
                     output_text.done, content_part.done, output_item.done
      function_call  output_item.added, function_call_arguments.delta, function_call_arguments.done,
                     output_item.done
    response.completed (the whole response, its status "incomplete" when max_output_tokens cut it)

Every event travels as `event: TYPE` + `data: {...}`, as OpenAI and vLLM send them. The items the
events build are the final response's output, so streamed text equals the response's text.
"""

from __future__ import annotations

from typing import Any

from tengyun.entrypoints.openai.protocol import ChatCompletionLogProbsContent, ChatCompletionStreamResponse
from tengyun.entrypoints.openai.responses_protocol import (
    FunctionCallItem, OutputItem, OutputMessage, OutputText, ReasoningItem, ReasoningText, ResponsesResponse,
    TokenLogprob, TopLogprob,
)
from tengyun.entrypoints.openai.serving_engine import sse


class ResponseEventStream:
    def __init__(self, response: ResponsesResponse):
        self.response = response  # status in_progress; its output grows as items close
        self.sequence_number = 0
        self.open: ReasoningItem | OutputMessage | None = None  # the item whose deltas are flowing
        self.text = ""  # the open item's text so far
        self.logprobs: list[TokenLogprob] = []  # the open message's token logprobs so far (include asked)
        self.logprobs_sent = 0  # how many of them text delta events carried
        self.finish_reason: str | None = None
        self.usage: Any = None  # the chat stream's last chunk's usage

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\n{sse(payload)}"

    def start(self) -> list[str]:
        snapshot = self.response.model_dump()
        return [self.event("response.created", response=snapshot),
                self.event("response.in_progress", response=snapshot)]

    def chunk(self, chunk: ChatCompletionStreamResponse) -> list[str]:
        """The events one chat chunk makes (none for the role chunk)."""
        if chunk.usage is not None:
            self.usage = chunk.usage
        events: list[str] = []
        for choice in chunk.choices:
            delta = choice.delta
            if delta.reasoning_content:
                events += self._delta(ReasoningItem, delta.reasoning_content)
            logprobs = token_logprobs(choice.logprobs.content if choice.logprobs else None)
            # a token with no text yet (part of a UTF-8 character) still has its logprob: it goes
            # with the message's next text delta
            if delta.content or (logprobs and not delta.reasoning_content and not delta.tool_calls):
                events += self._delta(OutputMessage, delta.content or "", logprobs)
            for call in delta.tool_calls or []:
                events += self._function_call(call.id, call.function.name, call.function.arguments or "")
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
        return events

    def finish(self) -> list[str]:
        """Closes the open item; an answer with neither text nor calls still ends in a message item
        (as the whole answer's output does), so output[-1].content[0].text always reads."""
        events = self._close()
        if not any(isinstance(item, (OutputMessage, FunctionCallItem)) for item in self.response.output):
            events += self._delta(OutputMessage, "") + self._close()
        return events

    def completed(self, response: ResponsesResponse) -> str:
        return self.event("response.completed", response=response.model_dump())

    # ----- items -------------------------------------------------------------------------
    def _delta(self, kind: type, text: str, logprobs: list[TokenLogprob] | None = None) -> list[str]:
        events = []
        if not isinstance(self.open, kind):
            events += self._close()
            events += self._open(kind)
        self.text += text
        self.logprobs += logprobs or []
        if text:
            name = "reasoning_text" if kind is ReasoningItem else "output_text"
            extra = {} if kind is ReasoningItem else {"logprobs": delta_logprobs(self.logprobs[self.logprobs_sent:])}
            self.logprobs_sent = len(self.logprobs)
            events.append(self.event(f"response.{name}.delta", item_id=self.open.id, output_index=self._index,
                                     content_index=0, delta=text, **extra))
        return events

    @property
    def _index(self) -> int:
        return len(self.response.output)  # the open item goes there when it closes

    def _open(self, kind: type) -> list[str]:
        if kind is ReasoningItem:
            self.open, part = ReasoningItem(status="in_progress"), ReasoningText(text="")
        else:
            self.open, part = OutputMessage(status="in_progress"), OutputText(text="")
        self.text, self.logprobs, self.logprobs_sent = "", [], 0
        return [self.event("response.output_item.added", output_index=self._index, item=self.open.model_dump()),
                self.event("response.content_part.added", item_id=self.open.id, output_index=self._index,
                           content_index=0, part=part.model_dump())]

    def _close(self) -> list[str]:
        item = self.open
        if item is None:
            return []
        index, events = self._index, []
        if isinstance(item, ReasoningItem):
            part = ReasoningText(text=self.text)
            events.append(self.event("response.reasoning_text.done", item_id=item.id, output_index=index,
                                     content_index=0, text=self.text))
        else:
            part = OutputText(text=self.text, logprobs=self.logprobs)
            events.append(self.event("response.output_text.done", item_id=item.id, output_index=index,
                                     content_index=0, text=self.text, logprobs=delta_logprobs(self.logprobs)))
        item.content, item.status = [part], "completed"
        events.append(self.event("response.content_part.done", item_id=item.id, output_index=index,
                                 content_index=0, part=part.model_dump()))
        events.append(self.event("response.output_item.done", output_index=index, item=item.model_dump()))
        self.response.output.append(item)
        self.open, self.text, self.logprobs = None, "", []
        return events

    def _function_call(self, call_id: str, name: str, arguments: str) -> list[str]:
        """A tool call arrives whole from the chat path: its events go out together."""
        events = self._close()
        item, index = FunctionCallItem(call_id=call_id, name=name, arguments="", status="in_progress"), self._index
        events.append(self.event("response.output_item.added", output_index=index, item=item.model_dump()))
        events.append(self.event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                                 delta=arguments))
        events.append(self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                 name=name, arguments=arguments))
        item.arguments, item.status = arguments, "completed"
        events.append(self.event("response.output_item.done", output_index=index, item=item.model_dump()))
        self.response.output.append(item)
        return events


def output_items(reasoning: str | None, content: str | None, calls: list[tuple[str, str, str]],
                 logprobs: list[TokenLogprob] | None = None) -> list[OutputItem]:
    """A whole chat answer's parts -> output items: reasoning, the message (when it has text or no
    call was made; with the answer's token logprobs), then one function_call per call (call id,
    name, arguments)."""
    items: list[OutputItem] = []
    if reasoning:
        items.append(ReasoningItem(content=[ReasoningText(text=reasoning)]))
    if content or not calls:
        items.append(OutputMessage(content=[OutputText(text=content or "", logprobs=logprobs or [])]))
    items += [FunctionCallItem(call_id=call_id, name=name, arguments=arguments) for call_id, name, arguments in calls]
    return items


def token_logprobs(content: list[ChatCompletionLogProbsContent] | None) -> list[TokenLogprob]:
    """The chat path's per-token logprobs -> the Responses API's (same token, bytes and logprob,
    top_logprobs alike); vLLM floors a logprob at -9999.0 so that JSON holds no -inf."""
    return [TokenLogprob(token=c.token, bytes=c.bytes, logprob=max(c.logprob, -9999.0),
                         top_logprobs=[TopLogprob(token=t.token, bytes=t.bytes, logprob=max(t.logprob, -9999.0))
                                       for t in c.top_logprobs])
            for c in content or []]


def delta_logprobs(logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
    """A text delta event's logprobs: token and logprob, no bytes (the SDK's delta event form)."""
    return [{"token": lp.token, "logprob": lp.logprob,
             "top_logprobs": [{"token": t.token, "logprob": t.logprob} for t in lp.top_logprobs]} for lp in logprobs]
