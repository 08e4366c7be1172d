"""Engine-side cost of one long answer: the step loop's time outside the model, and the token ids
the request's outputs carry, for each RequestOutputKind.

One request of --output-len tokens (ignore_eos, greedy) on the tests' tiny random-weight Llama
(64 hidden, 2 layers), --max-model-len 4096, so the model itself is cheap and what grows with
the answer shows: outputs that copy every token id and logprob so far cost O(L^2) over the answer.
With --serve, the same answer streamed by the OpenAI server (/v1/chat/completions, logprobs,
continuous usage stats): the server process's CPU time for it, engine thread and HTTP together.
With --per-step, no model: the time of one Request.make_output with L tokens (and 5 logprobs
each) already generated, for L = 2000, 8000, 32000: what a step costs the engine per request.

    OMP_NUM_THREADS=1 python benchmarks/long_answer_outputs.py [--output-len 2000] [--logprobs 5] [--serve | --per-step]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tengyun import SamplingParams
from tengyun.config import EngineConfig
from tengyun.engine.llm_engine import LLMEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import CORPUS, make_tiny_checkpoint  # noqa: E402 (the tests' tiny model and tokenizer)


def tiny_tokenizer(folder: Path) -> Path:
    """The tests' byte-level BPE tokenizer (tests/conftest.py tiny_tokenizer_dir), saved to folder."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                        bos_token="<|endoftext|>")
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tokenizer.save_pretrained(folder)
    return folder


def run(engine: LLMEngine, params: SamplingParams) -> dict[str, float]:
    """One request to the end: the step loop's CPU time (the machine is shared: CPU time moves less
    than wall time when other jobs run), the part spent in execute_model, and how many token ids
    all of the request's outputs carried together. Run with OMP_NUM_THREADS=1 so the model's
    CPU time is this thread's."""
    in_model = 0.0
    execute = engine.executor.execute_model

    def timed_execute(sched):
        nonlocal in_model
        start = time.thread_time()
        try:
            return execute(sched)
        finally:
            in_model += time.thread_time() - start

    engine.executor.execute_model = timed_execute
    engine.add_request("long", list(range(10, 42)), params)
    carried, num_outputs, generated_before = 0, 0, engine.generation_tokens
    start, start_cpu = time.perf_counter(), time.thread_time()
    while engine.has_unfinished_requests():
        for output in engine.step():
            num_outputs += 1
            carried += sum(len(c.token_ids) for c in output.outputs)
    cpu = time.thread_time() - start_cpu
    wall = time.perf_counter() - start
    engine.executor.execute_model = execute
    return {"wall_s": wall, "cpu_s": cpu, "model_s": in_model, "engine_s": cpu - in_model, "outputs": num_outputs,
            "carried_ids": carried, "tokens": engine.generation_tokens - generated_before}


def server_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve(folder: Path, output_len: int, logprobs: int | None, repeats: int) -> None:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "tengyun.entrypoints.openai.api_server", str(folder),
                               "--port", str(port), "--max-model-len", "4096", "--kv-cache-memory", "64MiB",
                               "--disable-uvicorn-access-log"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    body = dict(messages=[{"role": "user", "content": "Hi"}], temperature=0.0, max_tokens=output_len,
                ignore_eos=True, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
                logprobs=logprobs is not None, top_logprobs=logprobs or 0)
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        runs = []
        for _ in range(repeats):
            start, start_cpu = time.perf_counter(), server_cpu_s(server.pid)
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
                chunks = sum(1 for line in response.iter_lines() if line.startswith("data: {"))
            runs.append((server_cpu_s(server.pid) - start_cpu, time.perf_counter() - start, chunks))
        cpu, wall, chunks = min(runs)
        print(f"serve: one streamed chat answer of {output_len} tokens, {chunks} chunks: server CPU {cpu:.2f} s, "
              f"wall {wall:.2f} s (best of {repeats})")
    finally:
        server.terminate()
        server.wait(60)


def per_step() -> None:
    for length in (2000, 8000, 32000):
        for kind in _output_kinds():
            seconds = _make_output_time(length, SamplingParams(max_tokens=10**6, logprobs=5, stop=["abc"],
                                                               **_kind_arg(kind)))
            print(f"L {length:>6} {kind:<11} make_output {seconds * 1e6:7.1f} us a step")


def _make_output_time(length: int, params: SamplingParams, steps: int = 2000) -> float:
    """Seconds per Request.make_output of a request that has `length` tokens, one more each call."""
    import timeit

    from tengyun.engine.detokenizer import IncrementalDetokenizer
    from tengyun.engine.request import Request
    from tengyun.engine.sequence import Sequence
    from tengyun.outputs import Logprob, RequestMetrics

    class CharPerToken:  # a tokenizer that costs nothing: one "x" per token
        def decode(self, ids, **_):
            return "x" * len(ids)

    request = Request("r", None, [1, 2, 3], params, RequestMetrics(0.0))
    seq = Sequence(0, "r", 0, [1, 2, 3], params, 0)
    seq.token_ids += list(range(length))
    seq.output_logprobs = [{i: Logprob(-1.0, 1, "x")} for i in range(length)]
    detok = IncrementalDetokenizer(CharPerToken(), [1, 2, 3], params)
    detok.output_text = "x" * length
    request.seqs.append(seq)
    request.detokenizers.append(detok)

    def one_step():
        seq.token_ids.append(7)
        seq.output_logprobs.append({7: Logprob(-1.0, 1, "x")})
        detok.output_text += "x"
        return request.make_output()

    return timeit.timeit(one_step, number=steps) / steps


def _output_kinds() -> list[str]:
    try:
        from tengyun.sampling_params import RequestOutputKind  # noqa: F401
    except ImportError:  # before output kinds existed: every output was cumulative
        return ["CUMULATIVE"]
    return ["CUMULATIVE", "DELTA", "FINAL_ONLY"]


def _kind_arg(kind: str) -> dict:
    if _output_kinds() == ["CUMULATIVE"]:
        return {}
    from tengyun.sampling_params import RequestOutputKind

    return {"output_kind": RequestOutputKind[kind]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-len", type=int, default=2000)
    parser.add_argument("--logprobs", type=int, default=None, help="top logprobs per token (default: none)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve", action="store_true", help="time the streamed answer through the server")
    parser.add_argument("--per-step", action="store_true", help="time make_output alone at growing lengths")
    args = parser.parse_args()
    if args.per_step:
        return per_step()
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_checkpoint(Path(tmp) / "model", tiny_tokenizer(Path(tmp) / "tok"), "llama",
                                      max_position_embeddings=4096)
        if args.serve:
            return serve(folder, args.output_len, args.logprobs, args.repeats)
        engine = LLMEngine.from_config(EngineConfig(model=str(folder), max_model_len=4096,
                                                    kv_cache_memory="64MiB"))
        for kind in _output_kinds():
            params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                                    logprobs=args.logprobs, **_kind_arg(kind))
            runs = [run(engine, params) for _ in range(args.repeats)]
            best = min(runs, key=lambda r: r["engine_s"])
            print(f"{kind:<10} tokens {best['tokens']}, "
                  f"outputs {best['outputs']}, token ids carried {best['carried_ids']}, "
                  f"wall {best['wall_s']:.2f} s, CPU {best['cpu_s']:.2f} s, of which model {best['model_s']:.2f} s "
                  f"and engine outside the model {best['engine_s']:.3f} s (best of {args.repeats})")


if __name__ == "__main__":
    main()
