"""The measured side of benchmarks/quant.py: one system, one model file, one workload per process,
printing ``RESULT {json}``. Runs under Tengyun's python, llama-cpp-python's venv or vLLM's venv
and imports only the system it measures:

    VENV/bin/python benchmarks/quant_runs.py --system llamacpp --model M.gguf --workload W.jsonl

Every system decodes greedily (ignore_eos) and reports per request the time to its first token
(TTFT) and the gaps between its consecutive tokens (TPOT), plus the bytes it holds as weights:
Tengyun the tensors its layers keep (parameters and kernel-repacked weights, each storage
once), llama.cpp llama_model_size; RSS over load is resident memory after the run less before
the model loaded (weights, KV cache, runtime).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import read_workload  # noqa: E402

MiB = 2**20


def current_rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ----- Tengyun --------------------------------------------------------------------------------
def run_tengyun(args) -> dict:
    from tengyun import LLM

    prompts, output_len = read_workload(args.workload)
    before = current_rss()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
              **json.loads(args.engine_args))
    engine = llm.llm_engine
    _tengyun_requests(engine, [prompts[0][:8]], 4)  # warm-up
    result = _tengyun_requests(engine, prompts, output_len)
    held = held_weight_bytes(getattr(engine.executor, "model", None))
    return {**result, "weights_held_mib": held / MiB if held else None,
            "rss_over_load_mib": (current_rss() - before) / MiB}


def _tengyun_requests(engine, prompts: list[list[int]], output_len: int) -> dict:
    from tengyun import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    stamps: dict[str, list[float]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            produced = len(out.outputs[0].token_ids) if out.outputs else 0
            stamps[out.request_id] += [now] * (produced - len(stamps[out.request_id]))
    return timings(start, list(stamps.values()))


def held_weight_bytes(model) -> int | None:
    """Bytes of the tensors ``model``'s layers hold as weights, as the worker counts and logs them
    (Worker.weight_bytes): parameters and the kernels' prepared forms, oneDNN-packed weights and
    the small-batch kernel's PackedLinearWeight included, each storage once."""
    if model is None:
        return None
    from tengyun.worker.worker import weight_bytes

    return weight_bytes(model)


def timings(start: float, stamps: list[list[float]]) -> dict:
    """Per request the times its tokens came out -> TTFT and per-token gaps (ms), totals."""
    end = max(s[-1] for s in stamps)
    return {"elapsed_s": end - start, "output_tokens": sum(len(s) for s in stamps),
            "ttft_ms": [(s[0] - start) * 1e3 for s in stamps],
            "tpot_ms": [(b - a) * 1e3 for s in stamps for a, b in zip(s, s[1:])]}


# ----- llama.cpp ------------------------------------------------------------------------------
def run_llamacpp(args) -> dict:
    """llama.cpp's own batch API: every prompt one sequence, prompts prefilled n_batch tokens at a
    time, then one decode per step for all sequences, the argmax of each sequence's logits."""
    import llama_cpp

    prompts, output_len = read_workload(args.workload)
    before = current_rss()
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(args.model.encode(), llama_cpp.llama_model_default_params())
    params = llama_cpp.llama_context_default_params()
    per_seq = max(len(p) for p in prompts) + output_len + 8
    params.n_ctx, params.n_batch, params.n_ubatch = per_seq * len(prompts), 512, 512
    params.n_seq_max, params.n_threads, params.n_threads_batch = len(prompts), args.threads, args.threads
    ctx = llama_cpp.llama_init_from_model(model, params)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(512, 0, len(prompts))
    try:
        _llamacpp_requests(llama_cpp, ctx, batch, n_vocab, [prompts[0][:8]], 4)  # warm-up
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        result = _llamacpp_requests(llama_cpp, ctx, batch, n_vocab, prompts, output_len)
        result.update(weights_held_mib=llama_cpp.llama_model_size(model) / MiB,
                      rss_over_load_mib=(current_rss() - before) / MiB)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    return result


def _llamacpp_requests(llama_cpp, ctx, batch, n_vocab: int, prompts: list[list[int]], output_len: int) -> dict:
    import numpy as np

    def decode(entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """entries (token, position, sequence, wants logits) -> the argmax of each wanted row."""
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        batch.n_tokens = len(entries)
        if llama_cpp.llama_decode(ctx, batch):
            raise RuntimeError("llama_decode failed (KV cache full?)")
        rows = [i for i, entry in enumerate(entries) if entry[3]]
        return [int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())
                for i in rows]

    start = time.perf_counter()
    stamps: list[list[float]] = [[] for _ in prompts]
    pending = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
    last: dict[int, int] = {}
    for chunk_start in range(0, len(pending), 512):  # prefill
        chunk = pending[chunk_start:chunk_start + 512]
        for (_, _, seq, _), token in zip([e for e in chunk if e[3]], decode(chunk)):
            last[seq] = token
            stamps[seq].append(time.perf_counter())
    for step in range(1, output_len):
        seqs = sorted(last)
        tokens = decode([(last[s], len(prompts[s]) + step - 1, s, True) for s in seqs])
        now = time.perf_counter()
        for seq, token in zip(seqs, tokens):
            last[seq] = token
            stamps[seq].append(now)
    return timings(start, stamps)


# ----- vLLM -----------------------------------------------------------------------------------
def run_vllm(args) -> dict:
    """vLLM's LLM class; TTFT and TPOT from its per-request stats (first / last token stamps), so
    TPOT is each request's mean gap."""
    from vllm_launch import patch_version

    patch_version()
    from vllm import LLM, SamplingParams

    prompts, output_len = read_workload(args.workload)
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0, enforce_eager=True,
              disable_log_stats=False)
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=4), use_tqdm=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    result = {"elapsed_s": time.perf_counter() - start, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
    stats = [o.metrics for o in outs if getattr(o, "metrics", None) is not None]
    if stats and all(s.first_token_latency > 0 for s in stats):
        result["ttft_ms"] = [s.first_token_latency * 1e3 for s in stats]
        result["tpot_ms"] = [(s.last_token_ts - s.first_token_ts) * 1e3 / max(s.num_generation_tokens - 1, 1)
                             for s in stats]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", choices=("tengyun", "llamacpp", "vllm"), required=True)
    parser.add_argument("--model", required=True, help="an HF folder (Tengyun, vLLM) or a .gguf file")
    parser.add_argument("--workload", required=True, help="JSONL of prompt_token_ids (offline_throughput.py)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--engine-args", default="{}", help="JSON of extra Tengyun LLM(...) keywords")
    args = parser.parse_args()
    result = {"tengyun": run_tengyun, "llamacpp": run_llamacpp, "vllm": run_vllm}[args.system](args)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
