"""What one streamed completion chunk costs the API process: the response built (pydantic) and
encoded as a server-sent event, with model_dump + json.dumps (before 4b43d14) and with pydantic's
own model_dump_json (serving_engine.sse_model, now). Microseconds per chunk, best of 5 rounds.

    PYTHONPATH=$PWD python benchmarks/sse_chunk_encoding.py
"""

from __future__ import annotations

import platform
import time

from tengyun.entrypoints.openai.protocol import CompletionResponseChoice, CompletionStreamResponse
from tengyun.entrypoints.openai.serving_engine import sse, sse_model

CALLS = 20_000


def chunk() -> CompletionStreamResponse:
    """A mid-stream chunk as the server sends one per token: one choice, no logprobs, no usage."""
    return CompletionStreamResponse(id="cmpl-0123456789abcdef0123456789abcdef", created=1796530010, model="bench-model",
                                    choices=[CompletionResponseChoice(index=0, text=" world")])


WAYS = {
    "build only": chunk,
    "build + model_dump + json.dumps": lambda: sse(chunk().model_dump(exclude={"usage"})),
    "build + model_dump_json (sse_model)": lambda: sse_model(chunk(), {"usage"}),
}


def us_per_call(fn) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        best = min(best, (time.perf_counter() - start) / CALLS * 1e6)
    return best


def cpu() -> str:
    """The CPU's model name and whether it has AMX, from /proc/cpuinfo (the machine's name where absent)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    return f"{name or platform.machine()}, {'AMX' if ' amx_tile' in info else 'no AMX'}"


def main() -> None:
    print(f"{cpu()}, Python {platform.python_version()}, {CALLS} calls a round, one thread")
    print("| chunk | us per chunk |")
    print("|---|---|")
    for name, fn in WAYS.items():
        print(f"| {name} | {us_per_call(fn):.2f} |")


if __name__ == "__main__":
    main()
