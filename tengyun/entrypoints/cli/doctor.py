"""`tengyun doctor [--json]`: preflight checks of this machine (tengyun/ops/doctor.py)."""

from __future__ import annotations

import argparse
import json


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("doctor", help="check Python/torch/torch_npu/CANN/driver versions, devices, "
                                                  "topology, NUMA and gcc; exit 1 on any FAIL")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                        help="TP group size for the topology check (default: all devices)")


def run(args: argparse.Namespace) -> int:
    from tengyun.host import probe
    from tengyun.ops.doctor import exit_code, run_checks

    facts = probe.collect()
    findings = run_checks(facts, args.tensor_parallel_size)
    platform = facts.torch_probe.get("platform")
    if args.json:
        print(json.dumps({"platform": platform, "ok": exit_code(findings) == 0,
                          "findings": [{"check": f.check, "status": f.status.value, "detail": f.detail,
                                        "fix": f.fix} for f in findings]}, indent=2))
    else:
        width = max(len(f.check) for f in findings)
        for f in findings:
            print(f"[{f.status.value:<4}] {f.check:<{width}}  {f.detail}")
            if f.fix:
                print(f"       {'':<{width}}  -> {f.fix}")
        fails = sum(f.status.value == "FAIL" for f in findings)
        warns = sum(f.status.value == "WARN" for f in findings)
        print(f"\n{len(findings)} checks: {fails} FAIL, {warns} WARN")
    return exit_code(findings)
