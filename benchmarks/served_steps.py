"""Where a served engine's time went, step by step: the files benchmarks/step_log/sitecustomize.py
writes (one line per engine step), summarised by step size: how many steps, their seconds and
median, and the time between steps (scheduling, outputs, the pipe to the API process).

The first `--skip` steps (start-up and the client's test request) are left out.

    python benchmarks/served_steps.py /tmp/steps.* [--skip 5]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

BANDS = [(1, 1), (2, 63), (64, 64), (65, 128), (129, 256), (257, 479), (480, 1 << 30)]


def read(path: Path) -> list[tuple[float, int, int, int, float]]:
    """[(end time, tokens, sequences, decodes, seconds)] per step."""
    rows = []
    for line in path.read_text().splitlines():
        end, tokens, seqs, decodes, seconds = line.split()
        rows.append((float(end), int(tokens), int(seqs), int(decodes), float(seconds)))
    return rows


def summary(rows: list[tuple[float, int, int, int, float]]) -> list[str]:
    gaps = [b[0] - b[4] - a[0] for a, b in zip(rows, rows[1:])]
    span = rows[-1][0] - (rows[0][0] - rows[0][4])
    out = [f"{len(rows)} steps over {span:.1f} s: {sum(r[4] for r in rows):.1f} s in steps, "
           f"{sum(gaps):.1f} s between them (median {1e3 * statistics.median(gaps):.1f} ms)" if gaps else "",
           "", "| tokens per step | steps | seconds | median ms | mean decodes |", "|---|---|---|---|---|"]
    for lo, hi in BANDS:
        band = [r for r in rows if lo <= r[1] <= hi]
        if band:
            label = str(lo) if lo == hi else f"{lo}+" if hi >= 1 << 30 else f"{lo}-{hi}"
            out.append(f"| {label} | {len(band)} | {sum(r[4] for r in band):.1f} | "
                       f"{1e3 * statistics.median(r[4] for r in band):.1f} | "
                       f"{statistics.mean(r[3] for r in band):.1f} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--skip", type=int, default=5, help="leading steps to leave out")
    args = parser.parse_args()
    for path in args.files:
        rows = read(path)[args.skip:]
        if rows:
            print(f"## {path}", "", *summary(rows), "", sep="\n")


if __name__ == "__main__":
    main()
