"""ResponsesStore: the responses kept for GET /v1/responses/{id}, previous_response_id and
background runs, in memory, least recently used first out past `capacity`.

vLLM 0.11 keeps them in an unbounded dict, and only when VLLM_ENABLE_RESPONSES_API_STORE=1
(otherwise it ignores `store`). Here the store is bounded, so it is on by default (OpenAI's
default `store: true` works); VLLM_ENABLE_RESPONSES_API_STORE=0 (or its alias
TENGYUN_ENABLE_RESPONSES_API_STORE=0) turns it off: `store` is then ignored as in vLLM, and a
background request is a 400.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from dataclasses import dataclass

from tengyun.entrypoints.openai.responses_event_log import EventLog
from tengyun.entrypoints.openai.responses_protocol import ResponsesResponse

STORE_ENV = ("VLLM_ENABLE_RESPONSES_API_STORE", "TENGYUN_ENABLE_RESPONSES_API_STORE")
RESPONSES_STORE_CAPACITY = 1024  # responses kept; the oldest unread one goes first


def store_enabled() -> bool:
    """Off only when one of STORE_ENV says 0 / false."""
    return not any(os.environ.get(name, "").strip().lower() in ("0", "false") for name in STORE_ENV)


@dataclass
class StoredResponse:
    response: ResponsesResponse  # replaced as a background run moves on
    messages: list[dict]  # the chat messages the model answered (instructions first)
    task: asyncio.Task | None = None  # a background run, until it ends
    events: EventLog | None = None  # a background streamed run's events, for readers to follow


class ResponsesStore:
    def __init__(self, capacity: int = RESPONSES_STORE_CAPACITY, enabled: bool | None = None):
        self.capacity = capacity
        self.enabled = store_enabled() if enabled is None else enabled
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, entry: StoredResponse) -> None:
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def __len__(self) -> int:
        return len(self._entries)
