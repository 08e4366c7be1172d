"""`tengyun rank-table generate|validate`: HCCL rank tables (hccl.json)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("rank-table", help="generate or validate an HCCL rank table (hccl.json)")
    sub = parser.add_subparsers(dest="rank_table_command", required=True)
    gen = sub.add_parser("generate", help="write a rank table from servers and their NPUs' RoCE IPs")
    gen.add_argument("--server", action="append", required=True, metavar="MGMT_IP=DEVICE_IPS",
                     help="repeat per server in rank order: 10.0.0.10=192.168.100.101,192.168.100.102,... "
                          "or 10.0.0.10=@/path/to/its/hccn.conf; version 1.2: IP/SUPER_DEVICE_ID per device")
    gen.add_argument("--devices-per-server", type=int, default=None, help="default: every IP given")
    gen.add_argument("--version", default="1.0", choices=("1.0", "1.2"))
    gen.add_argument("--super-pod-id", default="0", help="version 1.2")
    gen.add_argument("--mgmt-prefix", type=int, default=24, help="management network prefix length (/24)")
    gen.add_argument("--output", "-o", default=None, help="file to write (default: stdout)")
    val = sub.add_parser("validate", help="check a rank table; exit 1 when it has errors")
    val.add_argument("path", help="hccl.json")
    val.add_argument("--mgmt-prefix", type=int, default=24, help="management network prefix length (/24)")
    val.add_argument("--devices-per-server", type=int, default=None)
    val.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from tengyun.host import ranktable

    if args.rank_table_command == "generate":
        servers = [ranktable.parse_server_arg(s, read_file=lambda p: Path(p).read_text()) for s in args.server]
        table = ranktable.generate(servers, args.version, args.devices_per_server, args.super_pod_id,
                                   args.mgmt_prefix)
        text = json.dumps(table, indent=4) + "\n"
        if args.output:
            Path(args.output).write_text(text)
            print(f"wrote {args.output}: {len(servers)} server(s), "
                  f"{sum(len(s['device']) for s in table['server_list'])} ranks", file=sys.stderr)
        else:
            sys.stdout.write(text)
        return 0
    problems = ranktable.validate_text(Path(args.path).read_text(), args.mgmt_prefix, args.devices_per_server)
    if args.json:
        print(json.dumps([p.__dict__ for p in problems], indent=2))
    elif not problems:
        print(f"{args.path}: OK")
    for p in problems if not args.json else []:
        print(f"{p.severity}: {p.path}: {p.message}\n    fix: {p.fix}")
    return 1 if any(p.severity == "error" for p in problems) else 0
