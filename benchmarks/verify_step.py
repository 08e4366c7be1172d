"""A speculative verify step (last token + K drafts per sequence) on CPU: its short chunks through
the paged kernel (cpu_paged, each block read in place once for the K + 1 query tokens) vs through
the gathered-K/V SDPA path every chunk took before (``MAX_PAGED_QUERY = MAX_PAGED_SEQ_LEN = 0``).

    python benchmarks/verify_step.py --part attention   # one layer's attention, synthetic cache
    python benchmarks/verify_step.py --part step        # engine steps, n-gram K = 4, code editing

attention: Qwen2.5-0.5B's shapes (14 query heads, 2 KV heads, head dim 64), batch 1 and 8
sequences of --context cached tokens each verifying K = 4 drafts, bf16 and fp32 caches; median of
--repeats calls (the step's metadata built once, as a step's layers share it), the two paths
alternating, on --threads threads (default 1).
step: Qwen2.5-Coder-0.5B-Instruct, benchmarks/spec_decode.py's code-editing prompts and n-gram
config, batch 1 and 8; one engine per path, stepped in turn on the same requests (step i of each
verifies the same tokens), medians over the steps after every prompt is done that verify drafts.
The machine may be shared: compare the two columns of one run, not runs with each other.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tengyun.platforms.cpu.kernels import attention as cpu_paged  # noqa: E402
from tengyun.layers.attention.metadata import AttentionMetadata, PrefillChunk  # noqa: E402
from tengyun.platforms.attention_backends import get_attention_backend  # noqa: E402

K = 4
DEFAULT_LIMITS = {name: getattr(cpu_paged, name) for name in (
    "MAX_PAGED_QUERY", "MAX_PAGED_SEQ_LEN", "FLOAT32_MAX_PAGED_SEQ_LEN", "AMX_BF16_MAX_PAGED_QUERY",
    "AMX_BF16_MAX_PAGED_SEQ_LEN")}


def paths(paged: bool) -> None:
    """paged: short chunks in the kernel (the default); else every chunk through SDPA (before)."""
    for name, value in DEFAULT_LIMITS.items():
        setattr(cpu_paged, name, value if paged else 0)


def attention_case(batch: int, context: int, dtype: torch.dtype, block_size: int = 16):
    """(q, k, v, caches, meta) of one layer's verify step: each sequence 1 + K query tokens after
    ``context`` cached ones, in its own shuffled blocks."""
    heads, kv_heads, dim = 14, 2, 64
    per_seq = -(-(context + 1 + K) // block_size)
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(batch * per_seq + 1, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq)
    chunks = [PrefillChunk(b * (1 + K), 1 + K, context, tables[b]) for b in range(batch)]
    tokens = batch * (1 + K)
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
    meta = lambda: AttentionMetadata(slot_mapping=torch.zeros(tokens, dtype=torch.int64),  # noqa: E731
                                     num_decode_tokens=0, prefills=chunks)
    return q, k, torch.randn_like(k), k_cache, v_cache, meta


def time_attention(args) -> None:
    backend = get_attention_backend("cpu_paged")
    print("| dtype | batch | context | SDPA over gathered K/V (before) ms | paged kernel ms | speed-up |")
    print("|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        for batch in (1, 8):
            q, k, v, k_cache, v_cache, meta = attention_case(batch, args.context, dtype)
            times = {True: [], False: []}
            metas = {paged: meta() for paged in (False, True)}  # per-step state built once, as the layers share it
            for _ in range(args.repeats):
                for paged in (False, True):
                    paths(paged)
                    start = time.perf_counter()
                    backend.forward(q, k, v, k_cache, v_cache, metas[paged], 64 ** -0.5)
                    times[paged].append(time.perf_counter() - start)
            before, after = (statistics.median(times[p]) * 1e3 for p in (False, True))
            print(f"| {str(dtype)[6:]} | {batch} | {args.context} | {before:.3f} | {after:.3f} | "
                  f"{before / after:.2f}x |")


def paired_verify_steps(folder: str, requests: list[dict], dtype: str) -> tuple[list, list, bool]:
    """Two engines (before, after) fed the same requests, stepped in turn (the order alternating),
    so step i of each is the same verify of the same tokens and both meet the same machine load.
    -> (ms of each step where every sequence is past its prompt and drafts were verified, before
    and after), and whether the greedy outputs are the same."""
    from spec_decode import MAX_MODEL_LEN, NGRAM

    from tengyun import LLM, SamplingParams

    engines = {}
    for paged in (False, True):
        llm = LLM(folder, dtype=dtype, max_model_len=MAX_MODEL_LEN, kv_cache_memory="1GiB", speculative_config=NGRAM)
        paths(paged)
        llm.generate([requests[0]["prompt_token_ids"][-64:]], SamplingParams(temperature=0.0, max_tokens=16))
        for i, request in enumerate(requests):
            llm.llm_engine.add_request(str(i), request["prompt_token_ids"],
                                       SamplingParams(temperature=0.0, max_tokens=request["max_tokens"]))
        engines[paged] = llm.llm_engine
    times = {False: [], True: []}
    outputs = {False: {}, True: {}}
    started = {False: set(), True: set()}
    step = 0
    while engines[True].has_unfinished_requests():
        took = {}
        for paged in ((False, True) if step % 2 == 0 else (True, False)):
            engine, drafts = engines[paged], engines[paged].get_stats().spec_decode.num_drafts
            decoding = len(started[paged]) == len(requests)  # every prompt done: a pure verify / decode step
            paths(paged)
            begin = time.perf_counter()
            for out in engine.step():
                started[paged].add(out.request_id)
                if out.finished:
                    outputs[paged][out.request_id] = list(out.outputs[0].token_ids)
            if decoding and engine.get_stats().spec_decode.num_drafts > drafts:
                took[paged] = (time.perf_counter() - begin) * 1e3
        if len(took) == 2:
            for paged in took:
                times[paged].append(took[paged])
        step += 1
    for engine in engines.values():
        engine.shutdown()
    return times[False], times[True], outputs[False] == outputs[True]


def time_steps(args) -> None:
    from spec_decode import MODEL, code_edit_prompts

    from tengyun.models.model_source import resolve_model

    folder = str(resolve_model(MODEL, "auto").folder)
    print("| dtype | batch | verify steps | gathered SDPA (before) ms/step | paged kernel ms/step | "
          "median per-step speed-up | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for batch in (1, 8):
        requests = code_edit_prompts(folder, batch, args.max_tokens)
        before, after, same = paired_verify_steps(folder, requests, args.dtype)
        ratio = statistics.median(b / a for b, a in zip(before, after))
        print(f"| {args.dtype} | {batch} | {len(before)} | {statistics.median(before):.1f} | "
              f"{statistics.median(after):.1f} | {ratio:.2f}x | {same} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("attention", "step"), default="attention")
    parser.add_argument("--context", type=int, default=700, help="attention: cached tokens per sequence")
    parser.add_argument("--dtype", default="bfloat16", help="step: the engine's dtype")
    parser.add_argument("--max-tokens", type=int, default=128, help="step: cap on each request's max_tokens")
    parser.add_argument("--repeats", type=int, default=21, help="attention: calls per case")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: steady figures on a shared machine, where waiting OpenMP "
                             "threads get descheduled)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    try:
        get_attention_backend("cpu_paged")
    except RuntimeError as error:
        sys.exit(f"{error}")
    time_attention(args) if args.part == "attention" else time_steps(args)


if __name__ == "__main__":
    main()
