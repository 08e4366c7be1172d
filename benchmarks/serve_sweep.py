"""Served throughput and TTFT against concurrency: `tengyun serve` and `vllm serve` (vLLM's CPU
build) on the same folder, both driven by vLLM's own client (`vllm bench serve`), as issue 44's
verification asks.

    .venv/bin/python benchmarks/serve_sweep.py --models smollm2,qwen2.5-coder --dtype bfloat16 \
        --concurrency 1,16,64 --num-prompts 256 --num-prompts-at 1:32 --repeats 2

Per model and repeat, each system starts once in its documented set-up and serves every
concurrency in turn; the order of the systems alternates per repeat (and per model) so machine
drift hits both:
- Tengyun: `tengyun serve FOLDER --dtype D --kv-cache-memory 1GiB`, its own thread choice (the
  cores it finds, timed at run time when other processes take some; `--tengyun-env
  OMP_NUM_THREADS=2` fixes the count instead: with libgomp's spinning barriers that count is the
  worst case on a busy machine, benchmarks/README.md "A busy core").
- vLLM: `vllm serve FOLDER --dtype D` through benchmarks/vllm_launch.py from the venv that
  benchmarks/compare sets up, with its recommended CPU environment (tcmalloc and libiomp5 in
  LD_PRELOAD, VLLM_CPU_KVCACHE_SPACE=1, threads bound); `--vllm-enforce-eager` skips its compile.
- The client: `vllm bench serve --backend openai --dataset-name random` with the same seed, so
  both servers get the same prompts (`--ignore-eos`, greedy, all requests at once up to the
  concurrency).
Beside the client's numbers, each run records the CPU seconds of the server's API process (the
tree's root) and of every other process under it (engine, workers), read from /proc around the
client run, the server's own per-request timeline (queue / prefill / decode / TTFT means from
vLLM's histograms on /metrics, which both servers export), and the CPU other processes took
meanwhile. Results: benchmarks/results/serve-sweep-STAMP.json, a PNG of output tok/s and median
TTFT against concurrency, and the README section between the `compare:serve-sweep` markers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
from batch1_decode import compare_module  # noqa: E402
from offline_throughput import MODELS  # noqa: E402

from tengyun.entrypoints.bench import process_cpu  # noqa: E402
from tengyun.ops.bench_timeline import histogram_totals, timeline  # noqa: E402

compare = compare_module()
SERVED_NAME = "bench-model"
SYSTEMS = ("tengyun", "vllm")
CLIENT_KEYS = ("completed", "failed", "duration", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
               "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms")


def server_command(system: str, ctx: dict, folder: str, port: int) -> tuple[list[str], dict[str, str]]:
    common = [folder, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
              "--max-model-len", str(ctx["max_model_len"]), "--dtype", ctx["dtype"], "--disable-uvicorn-access-log"]
    if system == "tengyun":
        env = dict(item.split("=", 1) for item in ctx["tengyun_env"])
        return ([sys.executable, "-m", "tengyun.entrypoints.cli.main", "serve", *common, "--kv-cache-memory", "1GiB"],
                env)
    eager = ["--enforce-eager"] if ctx["vllm_enforce_eager"] else []
    return ([str(ctx["vllm_python"]), str(BENCH / "vllm_launch.py"), "serve", *common, *eager],
            compare.vllm_env(ctx["vllm_python"], ctx["threads"]))


def client_command(ctx: dict, folder: str, port: int, concurrency: int, result: Path) -> list[str]:
    num_prompts = ctx["num_prompts_at"].get(concurrency, ctx["num_prompts"])
    return [str(ctx["vllm_python"]), str(BENCH / "vllm_launch.py"), "bench", "serve", "--backend", "openai",
            "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", folder,
            "--served-model-name", SERVED_NAME, "--dataset-name", "random", "--random-input-len",
            str(ctx["input_len"]), "--random-output-len", str(ctx["output_len"]), "--ignore-eos",
            "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--seed", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]


def scrape(port: int) -> dict:
    import httpx

    try:
        return histogram_totals(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text)
    except httpx.HTTPError:
        return {}


def client_run(ctx: dict, server: subprocess.Popen, folder: str, port: int, concurrency: int, workdir: Path,
               tag: str) -> dict:
    """One `vllm bench serve` run against a ready server, with the server's CPU and timeline."""
    result = workdir / f"{tag}-c{concurrency}.json"
    cmd = client_command(ctx, folder, port, concurrency, result)
    record = {"concurrency": concurrency, "client_command": cmd, "load_before": compare.loadavg()}
    cpu_before, metrics_before = process_cpu.snapshot(server.pid), scrape(port)
    sampler = compare.TreeSampler(server.pid)
    client = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                                   "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"})
    sampler.add(client.pid)
    output = client.communicate()[0].decode(errors="replace")
    stats = sampler.stop()
    time.sleep(0.5)  # the last request's histograms are observed just after its last chunk
    share = process_cpu.run_share(cpu_before, process_cpu.snapshot(server.pid))
    record.update({"load_after": compare.loadavg(), "other_cpu_cores": stats["other_cpu_cores"],
                   "api_cpu_s": share[0].cpu_s, "engine_cpu_s": sum(p.cpu_s for p in share[1:]),
                   "server_cpu": [{"pid": p.pid, "command": p.command, "cpu_s": p.cpu_s} for p in share],
                   "server_timeline": timeline(metrics_before, scrape(port))})
    if client.returncode or not result.exists():
        return {**record, "error": f"vllm bench serve exit {client.returncode}: {output[-1500:]}"}
    answer = json.loads(result.read_text())
    record.update({key: answer.get(key) for key in CLIENT_KEYS})
    return record


def serve_system(system: str, ctx: dict, model: str, workdir: Path, repeat: int) -> list[dict]:
    """Start `system` on `model` once, run every concurrency, stop it: one record per concurrency."""
    folder, port = ctx["folders"][model], compare.free_port()
    cmd, env = server_command(system, ctx, folder, port)
    base = {"system": system, "model": model, "repeat": repeat, "command": cmd, "env": env}
    log_path = workdir / f"{system}-{model}-r{repeat}.log"
    started = time.monotonic()
    with open(log_path, "wb") as log_file:
        server = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                  cwd=REPO, start_new_session=True)
        try:
            if not compare.wait_healthy(server, port, timeout_s=900):
                return [{**base, "concurrency": c, "error": f"server not ready: {compare._tail(log_path)}"}
                        for c in ctx["concurrency"]]
            ready_s = time.monotonic() - started
            records = []
            for c in ctx["concurrency"]:
                compare.log(f"   {system} {model} concurrency {c}, load {compare.loadavg()}")
                records.append({**base, "ready_s": ready_s,
                                **client_run(ctx, server, folder, port, c, workdir, f"{system}-{model}-r{repeat}")})
            return records
        finally:
            compare.stop_tree(server)


# ----- report -------------------------------------------------------------------------------
def _cell(r: dict, key: str, fmt: str = "{:.0f}") -> str:
    return fmt.format(r[key]) if r.get(key) is not None else "-"


def table(runs: list[dict]) -> list[str]:
    lines = ["| system | concurrency | repeat | output tok/s | TTFT mean / median / p99 ms | "
             "TPOT mean / median / p99 ms | server queue / prefill ms | API CPU s | engine CPU s | other CPU |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (r["concurrency"], r["repeat"], r["system"])):
        if "error" in r:
            lines.append(f"| {r['system']} | {r['concurrency']} | {r['repeat']} | failed: "
                         f"{r['error'][:160].replace('|', '/').replace(chr(10), ' ')} | | | | | | |")
            continue
        phases = r.get("server_timeline", {})
        server = " / ".join(f"{phases[k]['mean_ms']:.0f}" if k in phases else "-" for k in ("queue", "prefill"))
        lines.append(
            f"| {r['system']} | {r['concurrency']} | {r['repeat']} | {_cell(r, 'output_throughput', '{:.1f}')} | "
            f"{_cell(r, 'mean_ttft_ms')} / {_cell(r, 'median_ttft_ms')} / {_cell(r, 'p99_ttft_ms')} | "
            f"{_cell(r, 'mean_tpot_ms')} / {_cell(r, 'median_tpot_ms')} / {_cell(r, 'p99_tpot_ms')} | {server} | "
            f"{r['api_cpu_s']:.1f} | {r['engine_cpu_s']:.1f} | {r['other_cpu_cores']:.2f} |")
    return lines


def best(runs: list[dict], system: str, concurrency: int) -> dict | None:
    """The repeat with the highest output tok/s (the least disturbed by other jobs)."""
    ok = [r for r in runs if r["system"] == system and r["concurrency"] == concurrency and "error" not in r]
    return max(ok, key=lambda r: r["output_throughput"], default=None)


def ratio_lines(runs: list[dict], concurrency: list[int]) -> list[str]:
    lines = []
    for c in concurrency:
        t, v = best(runs, "tengyun", c), best(runs, "vllm", c)
        if t and v:
            ratio = t["output_throughput"] / v["output_throughput"]
            lines.append(f"- concurrency {c}: output tok/s Tengyun / vLLM = **{ratio:.2f}x**; median TTFT "
                         f"{t['median_ttft_ms']:.0f} vs {v['median_ttft_ms']:.0f} ms; "
                         f"API process CPU {t['api_cpu_s']:.1f} vs {v['api_cpu_s']:.1f} s (best repeat of each)")
    return lines


def plot(runs: list[dict], model: str, concurrency: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    for system in SYSTEMS:
        points = [(c, best(runs, system, c)) for c in concurrency]
        points = [(c, r) for c, r in points if r]
        if points:
            tput.plot([c for c, _ in points], [r["output_throughput"] for _, r in points], marker="o", label=system)
            ttft.plot([c for c, _ in points], [r["median_ttft_ms"] for _, r in points], marker="o", label=system)
    for axis, label in ((tput, "output tok/s"), (ttft, "median TTFT (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrency")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle(f"{MODELS[model]}: served, vLLM's bench serve client")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def render(report: dict) -> str:
    a = report["args"]
    begin, end = compare.markers("serve-sweep")
    m, v = report["machine"], report["versions"]
    lines = [begin, "## Served: throughput and TTFT against concurrency (vLLM's client)", "",
             f"Written by `benchmarks/serve_sweep.py` on {report['date']} (Tengyun commit {v['tengyun_commit']}); "
             f"raw numbers in `benchmarks/results/{report['results_file']}`.", "", "```", report["command"], "```", "",
             f"Machine: {m['cpu']}, {m['cores']} cores ({', '.join(m['isa'])}), {m['mem_gib']} GiB. vllm-cpu "
             f"{v['vllm']} (torch {v['vllm_torch']}), Tengyun on torch {v['torch']}. {a['dtype']}, "
             f"{a['threads']} threads for vLLM (bound), Tengyun's environment {a['tengyun_env'] or 'default'}, "
             f"random {a['input_len']} in / {a['output_len']} out, "
             f"`--ignore-eos`. The client (vLLM's) runs on the same 2 cores. API CPU: the server's root "
             "process; engine CPU: every process under it. Other CPU: cores other processes used meanwhile "
             "(other engineers' jobs).", ""]
    for model in a["models"]:
        runs = [r for r in report["runs"] if r["model"] == model]
        lines += [f"### {MODELS[model]}", "", *table(runs), "", *ratio_lines(runs, a["concurrency"]), ""]
        if report.get("plots", {}).get(model):
            lines += [f"![{model}](results/{report['plots'][model]})", ""]
    lines += [f"Load average at the start: {report['load_start']}; at the end: {report['load_end']}.", "", end]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2", help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--num-prompts-at", default="", help="per-concurrency overrides, e.g. 1:32")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--vllm-enforce-eager", action="store_true", help="vLLM without its compile step")
    parser.add_argument("--tengyun-env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="the Tengyun server's environment; default none: its own thread choice, timed at run "
                             "time (OMP_NUM_THREADS=N fixes the count and turns that off)")
    parser.add_argument("--no-readme", action="store_true", help="print the section instead of writing it")
    args = parser.parse_args()
    args.models, args.systems = args.models.split(","), args.systems.split(",")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    from tengyun.models.model_source import resolve_model

    pythons = compare.setup()
    ctx = {**vars(args), "vllm_python": pythons["vllm"],
           "num_prompts_at": {int(k): int(n) for k, n in (item.split(":") for item in args.num_prompts_at.split(",")
                                                          if item)},
           "folders": {m: str(resolve_model(MODELS[m], "auto").folder) for m in args.models}}
    workdir = Path(tempfile.mkdtemp(prefix="tengyun-serve-sweep-"))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M")
    report = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "args": vars(args),
              "command": "benchmarks/serve_sweep.py " + " ".join(sys.argv[1:]), "machine": compare.machine(),
              "versions": compare.versions(pythons), "load_start": compare.loadavg(), "runs": [],
              "results_file": f"serve-sweep-{stamp}.json", "plots": {}}
    for repeat in range(args.repeats):
        for i, model in enumerate(args.models):
            order = args.systems if (i + repeat) % 2 == 0 else list(reversed(args.systems))
            for system in order:
                compare.log(f"repeat {repeat}: {system} serve on {model}")
                report["runs"] += serve_system(system, ctx, model, workdir, repeat)
    report["load_end"] = compare.loadavg()
    results = BENCH / "results"
    results.mkdir(exist_ok=True)
    for model in args.models:
        name = f"serve-sweep-{stamp}-{model}.png"
        plot([r for r in report["runs"] if r["model"] == model], model, args.concurrency, results / name)
        report["plots"][model] = name
    (results / report["results_file"]).write_text(json.dumps(report, indent=2, default=str))
    if args.no_readme:
        print(render(report))
    else:
        compare.write_readme(render(report), "serve-sweep")
    compare.log(f"wrote {results / report['results_file']}; work files in {workdir}")


if __name__ == "__main__":
    main()
