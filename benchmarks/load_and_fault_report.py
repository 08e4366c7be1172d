"""The tables and the invariants of benchmarks/load_and_fault.py: what one run measured, as
markdown rows, and which of its promises (no 5xx, no stream lost, KV back to 0, /health 200,
a clean exit) failed."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the run's records, defined beside the load
    from load_and_fault import HealthWatch, LoadRounds, Tally


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def counts(counter: Counter) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counter.items(), key=str)) or "none"


def tally_rows(t: Tally) -> list[tuple[str, str]]:
    return [
        ("streams completed / disconnected on purpose / failed",
         f"{t.completed} / {t.disconnected} / {sum(t.failed.values())}"),
        ("failures", counts(t.failed)),
        ("stream status codes", counts(t.statuses)),
        ("finish reasons (per choice)", counts(t.finish)),
        ("TTFT p50 / p99 s", f"{pct(t.ttft, .5):.2f} / {pct(t.ttft, .99):.2f}"),
        ("end-to-end p50 / p99 s", f"{pct(t.e2e, .5):.2f} / {pct(t.e2e, .99):.2f}"),
    ]


def load_rows(args, r: LoadRounds, watch: HealthWatch, hwm: float) -> list:
    ms = [x * 1000 for x in watch.latencies]
    wall = sum(r.walls)
    return [
        ("rounds x clients / duration s / wall s (all rounds)",
         f"{args.rounds} x {args.clients} / {args.duration:.0f} / {wall:.1f}"),
        *tally_rows(r.tally),
        ("output tok/s (completed streams' tokens / wall)", f"{r.tally.output_tokens / wall:.1f}"),
        ("bad requests (name: status: count)", "; ".join(f"{n}: {s}: {c}" for (n, s), c in sorted(r.bad.items()))),
        ("CPU cores busy: server / load generator / everything else on the machine",
         " / ".join(f"{x:.2f}" for x in r.cpu_cores)),
        ("/health polls before SIGTERM: answered / not 200",
         f"{len(watch.latencies)} / {counts(watch.not_ok_before_sigterm)}"),
        ("/health latency p50 / p99 / max ms", f"{pct(ms, .5):.1f} / {pct(ms, .99):.1f} / {max(ms, default=0):.1f}"),
        ("server RSS MiB: start / peak polled in the load / end of each round (VmHWM, start-up included)",
         f"{r.rss_start:.0f} / {watch.rss_peak:.0f} / {' -> '.join(f'{x:.0f}' for x in r.rss_ends)} ({hwm:.0f})"),
        ("/metrics after each round (s to reach these)", "; ".join(
            ", ".join(f"{k.split(':')[1]} {v:g}" for k, v in g.items()) + f" ({s:.1f} s)"
            for g, s in zip(r.gauges, r.idle_s))),
    ]


def sigterm_rows(args, t: Tally, code, exit_s: float, watch: HealthWatch, log_errors: list[str]) -> list:
    return [
        ("clients / SIGTERM after s", f"{args.sigterm_clients} / {args.sigterm_after:.0f}"),
        *tally_rows(t),
        ("new requests refused after SIGTERM", counts(t.refused)),
        ("200s for requests sent after /health turned 503", str(t.accepted_after_drain)),
        ("/health after SIGTERM", counts(watch.after_sigterm)),
        ("server log: ERROR / Traceback lines (both phases)", str(len(log_errors))),
        ("exit code / s from SIGTERM to exit", f"{code} / {exit_s:.1f} (limit {args.shutdown_timeout:.0f}"
                                                f" + {args.exit_margin:.0f})"),
    ]


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    print(f"\n### {title}\n\n| figure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value.replace('|', '/')} |")


def invariants(rounds: LoadRounds, watch: HealthWatch, term: Tally, code) -> list[str]:
    """The failed invariants, in words; empty when all hold."""
    load, bad = rounds.tally, rounds.bad
    load_statuses = list(load.statuses) + [int(s) for (_, s) in bad if s.isdigit()]
    failed = [
        (any(s >= 500 for s in load_statuses), "a 5xx answer under load"),
        (bool(load.failed), f"load: streams failed: {counts(load.failed)}"),
        (any(not s.isdigit() or not 400 <= int(s) < 500 for (_, s) in bad), "a bad request got no 4xx"),
        (any(v != 0 for g in rounds.gauges for v in g.values()), f"/metrics not back to 0: {rounds.gauges}"),
        (bool(watch.not_ok_before_sigterm), f"/health not 200 before SIGTERM: {counts(watch.not_ok_before_sigterm)}"),
        (bool(term.failed), f"SIGTERM: streams failed: {counts(term.failed)}"),
        (any(s >= 500 and s != 503 for s in term.statuses), "SIGTERM: a 5xx other than 503"),
        (term.accepted_after_drain > 0, "SIGTERM: requests accepted after /health turned 503"),
        (code != 0, f"exit code {code} (None: killed after the limit)"),
    ]
    return [message for broken, message in failed if broken]
