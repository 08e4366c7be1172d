"""Batch-1 decode: one request of INPUT_LEN random token ids, OUTPUT_LEN greedy tokens
(ignore_eos), through Tengyun, llama.cpp (llama-cpp-python) and vLLM's CPU build, on the same
model and the same token ids, at float32 and at 16 bits (Tengyun and vLLM bfloat16; llama.cpp
bf16 and f16 GGUFs written from the same HF folder by llama.cpp's own convert_hf_to_gguf.py).

    python benchmarks/batch1_decode.py --model smollm2 --threads 2 --repeats 2

Set-up, once, under ${TENGYUN_CACHE_DIR:-~/.cache/tengyun}: bench-venvs/llama-cpp-python-VERSION
(pip builds llama.cpp from the PyPI sdist with Debian's g++ and cmake, GGML_NATIVE: ~15 min on
2 cores; on a CPU with AMX built for AVX-512 without it, -noamx, as its AMX backend crashes on
quantised files) and gguf/MODEL-TYPE.gguf (converted with the HF venv benchmarks/compare made and the
converter's own gguf-py). vLLM runs from benchmarks/compare's venv with its recommended CPU set-up.

Per run: a fresh process; TTFT (prompt in, first token out), decode tok/s over the other
OUTPUT_LEN - 1 tokens, output tok/s over the whole request, peak RSS. vLLM's LLM class gives
only the whole request's time. Systems alternate per repeat; the best repeat is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from offline_throughput import MODELS, read_workload, write_workload  # noqa: E402

LLAMA_CPP_VERSION = "0.3.36"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
RUNS = ("tengyun:float32", "tengyun:bfloat16", "llamacpp:f32", "llamacpp:bf16", "llamacpp:f16",
        "vllm:float32", "vllm:bfloat16")


def cache_root() -> Path:
    base = os.environ.get("TENGYUN_CACHE_DIR")
    return Path(base).expanduser() if base else Path.home() / ".cache" / "tengyun"


# ----- children: one system, one dtype, one request --------------------------------------------
def run_tengyun(args) -> dict:
    from tengyun import LLM, SamplingParams

    (prompt,), output_len = read_workload(args.workload)
    engine = LLM(args.folder, dtype=args.dtype, max_model_len=512, kv_cache_memory="256MiB").llm_engine
    greedy = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.add_request("warm-up", prompt[:8], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    start = time.perf_counter()
    engine.add_request("0", prompt, greedy)
    first, tokens = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = len(out.outputs[0].token_ids) if out.outputs else tokens
        if first is None and tokens:
            first = time.perf_counter()
    return _timings(start, first, time.perf_counter(), tokens)


def run_llamacpp(args) -> dict:
    from llama_cpp import Llama

    (prompt,), output_len = read_workload(args.workload)
    llm = Llama(model_path=args.gguf, n_ctx=512, n_threads=args.threads, n_threads_batch=args.threads,
                n_batch=512, verbose=False)
    list(zip(range(4), llm.generate(prompt[:8], temp=0.0)))  # warm-up
    llm.reset()
    start, first, tokens = time.perf_counter(), None, 0
    for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):  # greedy; never stops by itself
        tokens += 1
        first = first or time.perf_counter()
        if tokens == output_len:
            break
    return _timings(start, first, time.perf_counter(), tokens)


def run_vllm(args) -> dict:
    from vllm_launch import patch_version

    patch_version()
    from vllm import LLM, SamplingParams

    (prompt,), output_len = read_workload(args.workload)
    llm = LLM(model=args.folder, dtype=args.dtype, max_model_len=512, seed=0, enforce_eager=True)
    llm.generate([{"prompt_token_ids": prompt[:8]}], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True), use_tqdm=False)
    return _timings(start, None, time.perf_counter(), len(out[0].outputs[0].token_ids))


def _timings(start: float, first: float | None, end: float, tokens: int) -> dict:
    result = {"output_tokens": tokens, "elapsed_s": end - start, "output_tok_s": tokens / (end - start)}
    if first is not None and tokens > 1:
        result.update(ttft_ms=(first - start) * 1e3, decode_tok_s=(tokens - 1) / (end - first))
    return result


def child(args) -> None:
    result = {"tengyun": run_tengyun, "llamacpp": run_llamacpp, "vllm": run_vllm}[args.system](args)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result), flush=True)


# ----- set-up ---------------------------------------------------------------------------------
# llama.cpp 0.3.36 built GGML_NATIVE on a CPU with AMX compiles its AMX backend, which repacks Q8_0 /
# Q4_0 weights at load and then segfaults (exit -11) on this project's VMs; without AMX it runs and
# repacks them for AVX-512 instead. So on such CPUs the venv is built for the AVX-512 set explicitly.
AVX512_WITHOUT_AMX = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
                      " -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON")


def llama_cpp_python() -> Path:
    """The python of a venv holding llama-cpp-python LLAMA_CPP_VERSION built for this CPU (AVX-512
    without AMX where the CPU has AMX: see AVX512_WITHOUT_AMX), built on first use."""
    from tengyun.host.probe import cpu_flags  # the parent's venv: Tengyun's (children never build)

    amx = "amx_int8" in cpu_flags()  # ggml's AMX backend is its int8 one
    venv = cache_root() / "bench-venvs" / f"llama-cpp-python-{LLAMA_CPP_VERSION}{'-noamx' if amx else ''}"
    python = venv / "bin" / "python"
    if not python.exists() or subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True).returncode:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        isa = AVX512_WITHOUT_AMX if amx else "-DGGML_NATIVE=ON"
        env = {**os.environ, "CMAKE_ARGS": f"{isa} -DLLAMA_CURL=OFF"}
        print(f"building llama-cpp-python {LLAMA_CPP_VERSION} into {venv} (~15 min)", file=sys.stderr)
        subprocess.run([str(python), "-m", "pip", "install", "--no-cache-dir", "--no-binary", "llama-cpp-python",
                        f"llama-cpp-python=={LLAMA_CPP_VERSION}", "numpy"], env=env, check=True)
    return python


def gguf_file(model: str, folder: str, outtype: str, hf_python: Path) -> Path:
    """The HF folder as a GGUF of outtype (f32, bf16, f16), written by llama.cpp's converter."""
    target = cache_root() / "gguf" / f"{model}-{outtype}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    sdist = Path(tempfile.mkdtemp()) / "src"
    subprocess.run([str(hf_python), "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", str(sdist)], check=True, capture_output=True)
    subprocess.run(["tar", "xzf", next(sdist.glob("*.tar.gz")), "-C", str(sdist)], check=True)
    llama = next(sdist.glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
    subprocess.run([str(hf_python), "-m", "pip", "install", "-q", "sentencepiece", "pyyaml"], check=True)
    subprocess.run([str(hf_python), str(llama / "convert_hf_to_gguf.py"), str(_with_architectures(folder, sdist)),
                    "--outtype", outtype,
                    "--outfile", str(target)], check=True,
                   env={**os.environ, "PYTHONPATH": str(llama / "gguf-py")})  # the converter's own gguf-py
    return target


def _with_architectures(folder: str, scratch: Path) -> Path:
    """The folder as llama.cpp's converter reads it: config.json must name `architectures`, which
    the GGUF conversion Tengyun caches leaves out (transformers goes by model_type)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    if config.get("architectures"):
        return Path(folder)
    names = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    copy = scratch / "hf"
    copy.mkdir()
    for item in Path(folder).iterdir():
        (copy / item.name).symlink_to(item)
    (copy / "config.json").unlink()
    (copy / "config.json").write_text(json.dumps({**config, "architectures": [names[config["model_type"]]]}))
    return copy


def compare_module():
    """benchmarks/compare (a script without .py): its venv set-up and vLLM environment."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader("bench_compare", str(BENCH / "compare"))
    spec = importlib.util.spec_from_loader("bench_compare", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


# ----- parent ---------------------------------------------------------------------------------
def parent(args) -> None:
    from tengyun.models.model_source import resolve_model

    compare = compare_module()
    venvs = compare.setup()
    folder = str(resolve_model(MODELS[args.model], "auto").folder)
    runs = args.runs.split(",")
    commands: dict[str, tuple[list[str], dict[str, str]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workload = os.path.join(tmp, "workload.jsonl")
        write_workload(workload, folder, 1, args.input_len, args.output_len)
        base = [__file__, "--child", "--folder", folder, "--workload", workload, "--threads", str(args.threads)]
        quiet_env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        for run in runs:
            system, dtype = run.split(":")
            if system == "tengyun":
                commands[run] = ([sys.executable, *base, "--system", system, "--dtype", dtype], quiet_env)
            elif system == "llamacpp":
                gguf = gguf_file(args.model, folder, dtype, venvs["hf"])
                commands[run] = ([str(llama_cpp_python()), *base, "--system", system, "--gguf", str(gguf)],
                                 quiet_env)
            else:
                env = {**os.environ, **compare.vllm_env(venvs["vllm"], args.threads)}
                commands[run] = ([str(venvs["vllm"]), *base, "--system", system, "--dtype", dtype], env)
        results = _run_all(commands, runs, args.repeats)
    _print_table(args, results)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


def _run_all(commands, runs: list[str], repeats: int) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {run: [] for run in runs}
    for repeat in range(repeats):
        for run in runs if repeat % 2 == 0 else list(reversed(runs)):
            cmd, env = commands[run]
            load = os.getloadavg()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not lines:
                sys.exit(f"{run} failed:\n{proc.stderr[-3000:]}")
            result = {**json.loads(lines[-1][7:]), "load_before": [round(x, 2) for x in load]}
            results[run].append(result)
            print(f"[{run} repeat {repeat + 1}] {result}", file=sys.stderr, flush=True)
    return results


def _print_table(args, results: dict[str, list[dict]]) -> None:
    print(f"\nmodel={args.model} 1 request, in={args.input_len} out={args.output_len} greedy, "
          f"{args.threads} threads, best of {args.repeats}")
    print("| run | output tok/s | decode tok/s | TTFT ms | wall s | peak RSS MiB | load before |")
    print("|---|---|---|---|---|---|---|")
    for run, rows in results.items():
        best = max(rows, key=lambda r: r["output_tok_s"])
        decode = f"{best['decode_tok_s']:.1f}" if "decode_tok_s" in best else "-"
        ttft = f"{best['ttft_ms']:.0f}" if "ttft_ms" in best else "-"
        print(f"| {run} | {best['output_tok_s']:.1f} | {decode} | {ttft} | {best['elapsed_s']:.2f} | "
              f"{max(r['peak_rss_mib'] for r in rows):.0f} | {' '.join(map(str, best['load_before']))} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--runs", default=",".join(RUNS), help="comma list of SYSTEM:DTYPE, default: all")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=("tengyun", "llamacpp", "vllm"), help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--gguf", help=argparse.SUPPRESS)
    args = parser.parse_args()
    child(args) if args.child else parent(args)


if __name__ == "__main__":
    main()
