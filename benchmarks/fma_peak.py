"""The arithmetic ceiling of this machine's cores for the linear layers' instruction: bf16 dot
products (vdpbf16ps) and float32 multiply-adds (vfmadd231ps, 512- or 256-bit), on registers only,
one copy per core at once (benchmarks/fma_peak.c, built here with gcc into a temporary folder).

A linear layer's rate (benchmarks/linear_kernels.py, matmul_floor.py) divided by this is how much
any kernel could still gain on it; an engine's throughput on a workload of known FLOPs, divided
by it, how far from the machine's limit the whole run is.

    python benchmarks/fma_peak.py [--seconds 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("fma_peak.c")


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def kinds(flags: set[str]) -> list[str]:
    """The loops this CPU runs: bf16 needs avx512_bf16, fp32-512 avx512f, fp32-256 avx2 + fma."""
    out = []
    if "avx512_bf16" in flags:
        out.append("bf16")
    if "avx512f" in flags:
        out.append("fp32-512")
    if {"avx2", "fma"} <= flags:
        out.append("fp32-256")
    return out


def run(binary: Path, kind: str, copies: int, seconds: float) -> list[float]:
    """GFLOP/s of each of `copies` simultaneous processes."""
    procs = [subprocess.Popen([str(binary), kind, str(seconds)], stdout=subprocess.PIPE, text=True)
             for _ in range(copies)]
    return [float(p.communicate()[0].split()[0]) for p in procs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="copies run at once")
    args = parser.parse_args()
    flags = cpu_flags()
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "fma_peak"
        subprocess.run(["gcc", "-O2", str(SOURCE), "-o", str(binary)], check=True)
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "unknown CPU")
        shown = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
        print(f"{model}, {os.cpu_count()} cores; flags: {' '.join(shown)}")
        print("| instruction | 1 core GFLOP/s | all cores at once GFLOP/s (sum) |")
        print("|---|---|---|")
        for kind in kinds(flags):
            alone = run(binary, kind, 1, args.seconds)[0]
            together = run(binary, kind, args.cores, args.seconds)
            print(f"| {kind} | {alone:.1f} | {sum(together):.1f} ({' + '.join(f'{g:.1f}' for g in together)}) |")


if __name__ == "__main__":
    main()
