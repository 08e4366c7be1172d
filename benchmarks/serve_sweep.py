"""Served throughput and TTFT against concurrency: `tengyun serve`, `vllm serve` (vLLM's CPU
build) and llama.cpp's `llama-server` on the same model, all three driven by vLLM's own client
(`vllm bench serve`, /v1/completions), as issue 44's verification asks.

    .venv/bin/python benchmarks/serve_sweep.py --models smollm2,qwen2.5-coder --dtype bfloat16 \
        --concurrency 1,16,64 --num-prompts 256 --num-prompts-at 1:32 --repeats 2

Per model and repeat, each system starts in its documented set-up; Tengyun and vLLM serve every
concurrency in turn from one start, llama-server starts once per concurrency (its slots are the
concurrency). The order of the systems reverses per repeat (and per model) so machine drift hits
all of them:
- Tengyun: `tengyun serve FOLDER --dtype D --kv-cache-memory 1GiB`, its own thread choice (the
  cores it finds, timed at run time when other processes take some; `--tengyun-env
  OMP_NUM_THREADS=2` fixes the count instead: with libgomp's spinning barriers that count is the
  worst case on a busy machine, benchmarks/README.md "A busy core").
- vLLM: `vllm serve FOLDER --dtype D` through benchmarks/vllm_launch.py from the venv that
  benchmarks/compare sets up, with its recommended CPU environment (tcmalloc and libiomp5 in
  LD_PRELOAD, VLLM_CPU_KVCACHE_SPACE=1, threads bound); `--vllm-enforce-eager` skips its compile.
- llama.cpp: `llama-server` built once from the llama.cpp sources vendored in the llama-cpp-python
  sdist batch1_decode.py uses (benchmarks/llama_server.py: cmake, GGML_NATIVE or AVX-512 without
  AMX, cached under ~/.cache/tengyun/bench-venvs/llama-server-VERSION; ~15-20 min on 2 cores, run
  niced), on a bf16 (f32 for `--dtype float32`) GGUF that llama.cpp's convert_hf_to_gguf.py writes
  from the same HF folder (batch1_decode.gguf_file, cached under ~/.cache/tengyun/gguf), with
  `--parallel CONCURRENCY --ctx-size CONCURRENCY * --max-model-len --kv-unified --cont-batching
  --threads N --threads-batch N` (N = `--threads`). It is one process and exports none of vLLM's
  histograms, so its API CPU is all its CPU and its server timeline is empty. Its threads poll for
  work (its default `--poll 50`), so other jobs on the cores cost it most: 3.5 output tok/s at
  concurrency 1 in a smoke run at load 6-9, where a request on the free machine decoded at ~78.
- The client: `vllm bench serve --backend openai --dataset-name random` with the concurrency as
  its seed and the HF folder as its tokenizer, so every server gets the same prompt text at a
  concurrency and no run replays the prompts of an earlier one on the same server: both servers
  cache prefixes, and with one seed for all, the 256 prompts at 64 had 7 of their 8 blocks cached
  from the run at 16 (sweeps before 2026-12-06 10:36 did that; `prefix_cache` in each run's
  record counts the prompt tokens the server found cached, 0 now) (`--ignore-eos`,
  `--temperature 0`: greedy on every server, as the client no longer sends a temperature unless
  told; all requests at once up to the concurrency). llama-server re-tokenises the text with the
  GGUF's copy of the same vocabulary (128 prompt tokens in its log). The client runs through
  benchmarks/bench_serve_client.py, which adapts it to llama-server in two ways that apply to
  every server alike: one connection per request (llama-server closes each connection after a
  streamed response, and a reused one failed the next request), and a last chunk carrying both a
  choice and `usage` read as two, so output tokens come from the server's count, not from
  re-tokenising the text.
Between servers the sweep waits until the stopped one's processes are gone and the cores are quiet
(tree_sampler.wait_quiet), so no server starts, or times its thread check, beside the last one exiting.
Beside the client's numbers, each run records the CPU seconds of the server's API process (the
tree's root) and of every other process under it (engine, workers), read from /proc around the
client run, the server's own per-request timeline (queue / prefill / decode / TTFT means from
vLLM's histograms on /metrics, which Tengyun and vLLM export), and the CPU other processes took
meanwhile. Results: benchmarks/results/serve-sweep-STAMP.json, a PNG per model of output tok/s
and median TTFT against concurrency, a new dated section at the end of benchmarks/README.md (its
markers `compare:serve-sweep-STAMP`), and the lead slot of this machine type at the top of that
page (`compare:lead-served-amx`, `-zen5`, `-no-amx` or `-avx2`, serve_sweep_report.machine_type;
replaced). `--no-readme` prints both instead and keeps the JSON and PNGs in the work folder (smoke runs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
import llama_server  # noqa: E402
import serve_sweep_report as report_md  # noqa: E402
from batch1_decode import LLAMA_CPP_VERSION, compare_module, gguf_file  # noqa: E402
from offline_throughput import MODELS  # noqa: E402

from tengyun.entrypoints.bench import process_cpu  # noqa: E402
from tengyun.ops.bench_timeline import histogram_totals, timeline  # noqa: E402

compare = compare_module()
SERVED_NAME = "bench-model"
SYSTEMS = ("tengyun", "vllm", "llamacpp")
# Also runnable (--systems): Tengyun at vLLM's CPU API-server step budget, and at 1536 (where oneDNN's AMX
# rate per row jumps for SmolLM2's shapes), beside its own default (512 on CPU since 027e313;
# docs/operations.md "The step budget"), to attribute what that default changes.
# And both servers with 8 tokens a streamed chunk (--stream-interval, vLLM's flag; 1 is both defaults).
EXTRA_SYSTEMS = {"tengyun-2048": ["--max-num-batched-tokens", "2048"],
                 "tengyun-1536": ["--max-num-batched-tokens", "1536"],
                 "tengyun-si8": ["--stream-interval", "8"], "vllm-si8": ["--stream-interval", "8"]}
GGUF_TYPE = {"bfloat16": "bf16", "float32": "f32"}
CLIENT_KEYS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "output_throughput",
               "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms")


def server_command(system: str, ctx: dict, model: str, port: int, slots: int) -> tuple[list[str], dict[str, str]]:
    """`system`'s server on `model`; `slots`: the concurrency llama-server is started for."""
    folder = ctx["folders"][model]
    if system == "llamacpp":
        return llama_server.command(ctx["ggufs"][model], port, slots, ctx["max_model_len"], ctx["threads"],
                                    SERVED_NAME), {}
    common = [folder, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
              "--max-model-len", str(ctx["max_model_len"]), "--dtype", ctx["dtype"], "--disable-uvicorn-access-log"]
    if system.startswith("tengyun"):
        env = dict(item.split("=", 1) for item in ctx["tengyun_env"])
        return ([sys.executable, "-m", "tengyun.entrypoints.cli.main", "serve", *common, "--kv-cache-memory", "1GiB",
                 *EXTRA_SYSTEMS.get(system, [])], env)
    eager = ["--enforce-eager"] if ctx["vllm_enforce_eager"] else []
    return ([str(ctx["vllm_python"]), str(BENCH / "vllm_launch.py"), "serve", *common, *eager,
             *EXTRA_SYSTEMS.get(system, [])],
            compare.vllm_env(ctx["vllm_python"], ctx["threads"]))


def client_command(ctx: dict, folder: str, port: int, concurrency: int, result: Path) -> list[str]:
    num_prompts = ctx["num_prompts_at"].get(concurrency, ctx["num_prompts"])
    return [str(ctx["vllm_python"]), str(BENCH / "bench_serve_client.py"), "--backend", "openai",
            "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", folder,
            "--served-model-name", SERVED_NAME, "--dataset-name", "random", "--random-input-len",
            str(ctx["input_len"]), "--random-output-len", str(ctx["output_len"]), "--ignore-eos",
            "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--seed", str(concurrency),
            "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", str(result.parent), "--result-filename", result.name]


def scrape(system: str, port: int) -> str:
    """The server's /metrics text; '' for llama-server, which exports none of vLLM's metrics."""
    import httpx

    if system == "llamacpp":
        return ""
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    except httpx.HTTPError:
        return ""


def prefix_cache(before: str, after: str) -> dict[str, float]:
    """{"hits", "queries"}: prompt tokens found cached / looked up during the run (vLLM's counters,
    summed over label sets)."""
    def total(text: str, name: str) -> float:
        return sum(float(m) for m in re.findall(rf"^vllm:prefix_cache_{name}_total(?:{{[^}}]*}})? (\S+)$", text, re.M))
    return {name: total(after, name) - total(before, name) for name in ("hits", "queries")}


def client_run(ctx: dict, system: str, server: subprocess.Popen, folder: str, port: int, concurrency: int,
               workdir: Path, tag: str) -> dict:
    """One `vllm bench serve` run against a ready server, with the server's CPU and timeline."""
    result = workdir / f"{tag}-c{concurrency}.json"
    cmd = client_command(ctx, folder, port, concurrency, result)
    record = {"concurrency": concurrency, "client_command": cmd, "load_before": compare.loadavg()}
    cpu_before, metrics_before = process_cpu.snapshot(server.pid), scrape(system, port)
    sampler = compare.TreeSampler(server.pid)
    client = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                                   "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"})
    sampler.add(client.pid)
    output = client.communicate()[0].decode(errors="replace")
    stats = sampler.stop()
    time.sleep(0.5)  # the last request's histograms are observed just after its last chunk
    share = process_cpu.run_share(cpu_before, process_cpu.snapshot(server.pid))
    metrics_after = scrape(system, port)
    record.update({"load_after": compare.loadavg(), "other_cpu_cores": stats["other_cpu_cores"],
                   "api_cpu_s": share[0].cpu_s, "engine_cpu_s": sum(p.cpu_s for p in share[1:]),
                   "server_cpu": [{"pid": p.pid, "command": p.command, "cpu_s": p.cpu_s} for p in share],
                   "server_timeline": timeline(histogram_totals(metrics_before), histogram_totals(metrics_after)),
                   "prefix_cache": prefix_cache(metrics_before, metrics_after)})
    if client.returncode or not result.exists():
        return {**record, "error": f"vllm bench serve exit {client.returncode}: {output[-1500:]}"}
    answer = json.loads(result.read_text())
    record.update({key: answer.get(key) for key in CLIENT_KEYS})
    errors = [e for e in answer.get("errors", []) if e]
    if errors:  # a failed request's reason, as the client saw it: {message: count}
        record["client_errors"] = {e[:300]: errors.count(e) for e in set(errors)}
    return record


def serve_system(system: str, ctx: dict, model: str, workdir: Path, repeat: int) -> list[dict]:
    """One record per concurrency: Tengyun and vLLM start once and serve every concurrency in
    turn; llama-server starts once per concurrency, with that many slots."""
    if system == "llamacpp":
        return [r for c in ctx["concurrency"] for r in serve_once(system, ctx, model, workdir, repeat, [c])]
    return serve_once(system, ctx, model, workdir, repeat, ctx["concurrency"])


def serve_once(system: str, ctx: dict, model: str, workdir: Path, repeat: int, concurrency: list[int]) -> list[dict]:
    """Start `system` on `model`, run each of `concurrency`, stop it."""
    folder, port = ctx["folders"][model], compare.free_port()
    cmd, env = server_command(system, ctx, model, port, slots=max(concurrency))
    base = {"system": system, "model": model, "repeat": repeat, "command": cmd, "env": env}
    tag = f"{system}-{model}-r{repeat}" + (f"-np{concurrency[0]}" if system == "llamacpp" else "")
    log_path = workdir / f"{tag}.log"
    started = time.monotonic()
    with open(log_path, "wb") as log_file:
        server = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                  cwd=REPO, start_new_session=True)
        try:
            if not compare.wait_healthy(server, port, timeout_s=900):
                return [{**base, "concurrency": c, "error": f"server not ready: {compare._tail(log_path)}"}
                        for c in concurrency]
            ready_s = time.monotonic() - started
            records = []
            for c in concurrency:
                compare.log(f"   {system} {model} concurrency {c}, load {compare.loadavg()}")
                records.append({**base, "ready_s": ready_s,
                                **client_run(ctx, system, server, folder, port, c, workdir, tag)})
            return records
        finally:
            compare.stop_tree(server)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2", help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma list of {', '.join([*SYSTEMS, *EXTRA_SYSTEMS])}")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--num-prompts-at", default="", help="per-concurrency overrides, e.g. 1:32")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="vLLM's bound threads and llama-server's --threads")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--max-model-len", type=int, default=512, help="per sequence (llama-server: per slot)")
    parser.add_argument("--vllm-enforce-eager", action="store_true", help="vLLM without its compile step")
    parser.add_argument("--tengyun-env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="the Tengyun server's environment; default none: its own thread choice, timed at run "
                             "time (OMP_NUM_THREADS=N fixes the count and turns that off)")
    parser.add_argument("--no-readme", action="store_true",
                        help="print the sections instead of writing them; the JSON and PNGs stay in the work folder")
    args = parser.parse_args()
    args.models, args.systems = args.models.split(","), args.systems.split(",")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    unknown = sorted(set(args.systems) - set(SYSTEMS) - set(EXTRA_SYSTEMS))
    if unknown:
        parser.error(f"--systems: unknown {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    return args


def llamacpp_setup(args, folders: dict[str, str], hf_python: Path) -> tuple[dict[str, Path], str]:
    """The bf16 / f32 GGUF of each model's folder (batch1_decode's converter) and llama-server's
    version line; built and converted once, cached (llama_server.py)."""
    ggufs = {m: gguf_file(m, folders[m], GGUF_TYPE[args.dtype], hf_python) for m in args.models}
    out = subprocess.run([str(llama_server.binary()), "--version"], capture_output=True, text=True)
    version = next((line for line in (out.stdout + out.stderr).splitlines() if line.startswith("version")), "?")
    return ggufs, f"llama-server {version.removeprefix('version: ')} (llama-cpp-python {LLAMA_CPP_VERSION}'s sources)"


def write_sections(report: dict, no_readme: bool) -> None:
    """The dated section (a new one per run, appended to the log) and the lead slot of this
    machine type (replaced)."""
    dated = report_md.render(report, compare.markers(f"serve-sweep-{report['stamp']}"))
    lead_slot = f"lead-served-{report_md.machine_type(report['machine'])}"
    lead = report_md.render_lead(report, compare.markers(lead_slot))
    if no_readme:
        print(lead + "\n\n" + dated)
        return
    compare.write_readme(dated, f"serve-sweep-{report['stamp']}")
    compare.write_readme(lead, lead_slot)


def main() -> None:
    args = parse_args()
    from tengyun.models.model_source import resolve_model

    pythons = compare.setup()
    folders = {m: str(resolve_model(MODELS[m], "auto").folder) for m in args.models}
    ctx = {**vars(args), "vllm_python": pythons["vllm"], "folders": folders,
           "num_prompts_at": {int(k): int(n) for k, n in (item.split(":") for item in args.num_prompts_at.split(",")
                                                          if item)}}
    versions = compare.versions(pythons)
    if "llamacpp" in args.systems:
        ctx["ggufs"], versions["llamacpp"] = llamacpp_setup(args, folders, pythons["hf"])
    workdir = Path(tempfile.mkdtemp(prefix="tengyun-serve-sweep-"))
    now = datetime.datetime.now()
    stamp = now.strftime("%Y%m%d-%H%M")
    report = {"date": now.strftime("%Y-%m-%d %H:%M"), "stamp": stamp, "args": vars(args),
              "command": "benchmarks/serve_sweep.py " + " ".join(sys.argv[1:]), "machine": compare.machine(),
              "versions": versions, "load_start": compare.loadavg(), "runs": [],
              "results_file": f"serve-sweep-{stamp}.json", "plots": {}}
    for repeat in range(args.repeats):
        for i, model in enumerate(args.models):
            order = args.systems if (i + repeat) % 2 == 0 else list(reversed(args.systems))
            for system in order:
                compare.log(f"repeat {repeat}: {system} serve on {model}")
                report["runs"] += serve_system(system, ctx, model, workdir, repeat)
    report["load_end"] = compare.loadavg()
    results = workdir if args.no_readme else BENCH / "results"  # a trial run leaves the repository as it was
    results.mkdir(exist_ok=True)
    for model in args.models:
        name = f"serve-sweep-{stamp}-{model}.png"
        report_md.plot([r for r in report["runs"] if r["model"] == model], model, args.concurrency, results / name)
        report["plots"][model] = name
    (results / report["results_file"]).write_text(json.dumps(report, indent=2, default=str))
    write_sections(report, args.no_readme)
    compare.log(f"wrote {results / report['results_file']}; work files in {workdir}")


if __name__ == "__main__":
    main()
