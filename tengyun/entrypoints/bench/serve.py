r"""`tengyun bench serve`: streaming load test of any OpenAI-compatible server (Tengyun, vLLM, ...).

    tengyun bench serve --base-url http://127.0.0.1:8000 --model MODEL --dataset random \
        --input-len 128 --output-len 128 --num-prompts 64 --max-concurrency 16 --ignore-eos \
        --goodput ttft:2000 tpot:200 --save-result

Each request streams (`stream_options.include_usage`, so token counts are the server's own);
TTFT is send -> first chunk, ITL the gaps between chunks, TPOT (E2E - TTFT) / (tokens - 1).
Random prompts go to /v1/completions as token ids, so every server sees the same prompt length.
After vLLM's report: the server's own per-request timeline from its /metrics (queue, prefill,
decode, TTFT means, and the client's TTFT beside it) and, with --server-pid, the CPU seconds of
each of the server's processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from tengyun.entrypoints.bench.server_observer import ServerObserver
from tengyun.entrypoints.bench.workload import add_workload_args, build_requests, load_tokenizer
from tengyun.ops.bench import (
    BenchRequest, RequestResult, arrival_gaps, compute_metrics, format_report, parse_goodput,
)

CHAT_ENDPOINTS = ("/v1/chat/completions",)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--host", default="127.0.0.1", help="used when --base-url is not given")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    parser.add_argument("--model", default=None, help="model name sent with each request and tokenizer source "
                                                      "(default: the first of the server's /v1/models)")
    parser.add_argument("--served-model-name", default=None, help="name sent with requests when it differs "
                                                                  "from --model")
    parser.add_argument("--tokenizer", default=None, help="tokenizer for the random prompts (default: --model)")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY "
                                                        "(default: $OPENAI_API_KEY if set)")
    add_workload_args(parser)
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals; inf (default) sends all at once")
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly --output-len tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (vLLM bench's default)")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                        help="SLOs for goodput: ttft:MS tpot:MS e2el:MS; a request counts when it meets all")
    parser.add_argument("--save-result", action="store_true", help="write the result JSON and a PNG of it")
    parser.add_argument("--result-dir", default=".")
    parser.add_argument("--result-filename", default=None,
                        help="default: tengyun-bench-<rate>qps-concurrency<N>-<model>-<date>.json")
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--ready-check-timeout-sec", type=float, default=0.0,
                        help="wait this long for the server's /v1/models to answer before starting")
    parser.add_argument("--server-pid", type=int, default=None,
                        help="the server's process id (same machine): report the CPU seconds of it and of "
                             "every process under it during the run")
    parser.add_argument("--no-server-timeline", action="store_true",
                        help="do not read the server's /metrics before and after the run (the per-request "
                             "queue / prefill / decode / TTFT means of vLLM's histograms)")


def request_payload(endpoint: str, model: str, request: BenchRequest, args: argparse.Namespace,
                    tokenizer: Any) -> dict:
    payload: dict[str, Any] = {"model": model, "max_tokens": request.output_len, "temperature": args.temperature,
                               "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        payload["ignore_eos"] = True
    if endpoint in CHAT_ENDPOINTS:
        text = request.prompt if isinstance(request.prompt, str) else tokenizer.decode(request.prompt)
        payload["messages"] = [{"role": "user", "content": text}]
    else:
        payload["prompt"] = request.prompt
    return payload


async def send_request(client, url: str, payload: dict, request: BenchRequest, run_start: float) -> RequestResult:
    """One streamed request. Every SSE chunk carrying a choice is a timing point (its text may be
    empty); the last chunk's usage gives the token counts."""
    result = RequestResult(success=False, prompt_len=request.prompt_len)
    sent = time.perf_counter()
    result.start_time = sent - run_start
    last = sent
    chunks = 0
    usage = None
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:500]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                message = json.loads(data)
                if "error" in message:
                    result.error = json.dumps(message["error"])[:500]
                    return result
                now = time.perf_counter()
                if message.get("choices"):
                    if chunks == 0:
                        result.ttft = now - sent
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
                if message.get("usage"):
                    usage = message["usage"]
    except Exception as e:  # noqa: BLE001 - any transport failure is a failed request, not a crash
        result.error = f"{e.__class__.__name__}: {e}"
        return result
    result.latency = last - sent
    if usage:
        result.prompt_len = usage.get("prompt_tokens", result.prompt_len)
        result.output_len = usage.get("completion_tokens", chunks)
    else:  # a server without include_usage: one token per chunk
        result.output_len = chunks
    result.success = chunks > 0
    if not result.success:
        result.error = "the stream ended without a token"
    return result


async def run_requests(base_url: str, endpoint: str, payloads: list[dict], requests: list[BenchRequest],
                       request_rate: float, max_concurrency: int | None, seed: int, api_key: str | None,
                       show_progress: bool) -> tuple[list[RequestResult], float]:
    """Send every request (Poisson arrivals at request_rate, at most max_concurrency in flight);
    returns the results in request order and the wall time of the run."""
    import httpx
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(requests), max_keepalive_connections=None)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = tqdm(total=len(requests), desc="requests", disable=not show_progress)
    url = base_url.rstrip("/") + endpoint
    async with httpx.AsyncClient(timeout=httpx.Timeout(6 * 3600.0), limits=limits, headers=headers) as client:
        async def one(payload: dict, request: BenchRequest, run_start: float) -> RequestResult:
            if gate is None:
                result = await send_request(client, url, payload, request, run_start)
            else:
                async with gate:
                    result = await send_request(client, url, payload, request, run_start)
            progress.update(1)
            return result

        run_start = time.perf_counter()
        tasks = []
        for gap, payload, request in zip(arrival_gaps(len(requests), request_rate, seed), payloads, requests):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(payload, request, run_start)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - run_start
    progress.close()
    return list(results), duration


def served_model(base_url: str, api_key: str | None, timeout_s: float) -> str:
    """The first model id of /v1/models, waiting up to timeout_s for the server to answer."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10)
            response.raise_for_status()
            return response.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            if time.monotonic() >= deadline:
                raise ValueError(f"{base_url}/v1/models did not answer with a model ({e}); is the server up? "
                                 f"Pass --base-url, or --ready-check-timeout-sec to wait for it.") from None
            time.sleep(1.0)


def run(args: argparse.Namespace) -> int:
    import os

    base_url = args.base_url or f"http://{args.host}:{args.port}"
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    slos = parse_goodput(args.goodput)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}.")
    name_on_server = served_model(base_url, api_key, args.ready_check_timeout_sec)
    model = args.model or name_on_server
    request_model = args.served_model_name or model
    tokenizer = load_tokenizer(args.tokenizer or model, args.trust_remote_code)
    requests = build_requests(args, tokenizer)
    payloads = [request_payload(args.endpoint, request_model, r, args, tokenizer) for r in requests]
    print(f"{len(requests)} requests to {base_url}{args.endpoint} (model {request_model!r}), "
          f"request rate {args.request_rate}, max concurrency {args.max_concurrency}", flush=True)
    observer = ServerObserver(base_url, api_key, args.server_pid, scrape=not args.no_server_timeline)
    observer.start()
    results, duration = asyncio.run(run_requests(
        base_url, args.endpoint, payloads, requests, args.request_rate, args.max_concurrency, args.seed, api_key,
        not args.disable_tqdm))
    metrics = compute_metrics(results, duration, slos)
    print(format_report(metrics, max_concurrency=args.max_concurrency, request_rate=args.request_rate))
    server_lines, server_record = observer.finish(metrics["completed"], metrics["mean_ttft_ms"], duration)
    print(server_lines)
    metrics.update(server_record)
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"first error: {errors[0]}")
    if args.save_result:
        save_result(args, request_model, metrics, results, slos)
    return 0 if not errors else 1


def save_result(args: argparse.Namespace, model: str, metrics: dict, results: list[RequestResult],
                slos: dict[str, float]) -> Path:
    from tengyun.ops.bench_plot import plot_results

    now = datetime.now()
    filename = args.result_filename or (
        f"tengyun-bench-{args.request_rate}qps-concurrency{args.max_concurrency}-"
        f"{Path(model).name}-{now:%Y%m%d-%H%M%S}.json")
    path = Path(args.result_dir) / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "date": now.strftime("%Y%m%d-%H%M%S"), "backend": "openai", "endpoint": args.endpoint, "model_id": model,
        "base_url": args.base_url, "dataset": args.dataset, "num_prompts": args.num_prompts,
        "input_len": args.input_len, "output_len": args.output_len, "prefix_len": args.prefix_len,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency, "ignore_eos": args.ignore_eos, "goodput": slos or None,
        **metrics,
        "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
        "e2els": [r.latency for r in results], "start_times": [r.start_time for r in results],
        "errors": [r.error for r in results],
    }
    path.write_text(json.dumps(record, indent=2))
    try:
        png = plot_results(results, path.with_suffix(".png"),
                           title=f"{Path(model).name}: {args.num_prompts} requests, rate {args.request_rate}, "
                                 f"concurrency {args.max_concurrency}")
    except ImportError as e:  # matplotlib is the optional `bench` extra
        print(f"saved {path}; no PNG of it: {e} (pip install 'tengyun[bench]', or pip install matplotlib)")
        return path
    print(f"saved {path} and {png}")
    return path
