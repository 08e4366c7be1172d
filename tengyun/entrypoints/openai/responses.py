"""How a route answers a serving handler's result: JSON, an SSE stream, or nothing when the
client left before the answer was ready (its engine requests are aborted then)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tengyun.entrypoints.openai.serving_engine import SSE_HEADERS


async def until_disconnect(raw_request: Request, work: Any) -> Any:
    """Await `work`, cancelling it (which aborts its engine requests) if the client leaves first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)  # client closed the request; nobody reads this
    return task.result()


def respond(result: Any) -> Response:
    if hasattr(result, "__aiter__"):
        return StreamingResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)
    if isinstance(result, Response):
        return result
    return JSONResponse(result.model_dump())
