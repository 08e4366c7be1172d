"""`tengyun deploy systemd|nginx`: print a systemd unit or an nginx config (ops/deploy.py)."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys

from tengyun.entrypoints.cli.supervise import parse_serve_args, serve_command
from tengyun.entrypoints.openai.request_limits import default_max_request_bytes
from tengyun.ops.deploy import NginxSite, SystemdUnit, nginx_main_config, nginx_site, systemd_unit

# Carried into the unit from the shell it is generated in (after `source set_env.sh`).
ENV_PREFIXES = ("ASCEND_", "HCCL_", "TENGYUN_", "OMP_")
ENV_KEYS = ("LD_LIBRARY_PATH", "PYTHONPATH", "CUDA_VISIBLE_DEVICES", "HF_HOME")
SECRET_KEYS = ("TENGYUN_API_KEY",)  # never written into a world-readable unit: use --env-file


def tengyun_executable() -> list[str]:
    """The absolute command that runs this tengyun (the venv's console script when there is one)."""
    script = os.path.join(os.path.dirname(sys.executable), "tengyun")
    if os.access(script, os.X_OK):
        return [os.path.abspath(script)]
    found = shutil.which("tengyun")
    return [os.path.abspath(found)] if found else [sys.executable, "-m", "tengyun.entrypoints.cli.main"]


def captured_env(environ: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in sorted(environ.items())
            if (k in ENV_KEYS or k.startswith(ENV_PREFIXES)) and k not in SECRET_KEYS}


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    return key, value


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("deploy", help="print a systemd unit or an nginx config for production")
    kinds = parser.add_subparsers(dest="deploy_kind", required=True)

    unit = kinds.add_parser("systemd", help="a systemd unit for a serve command",
                            usage="tengyun deploy systemd [options] -- serve [MODEL] [serve flags]")
    unit.add_argument("--description", default=None)
    unit.add_argument("--user", default=None, help="User= of the service")
    unit.add_argument("--working-directory", default=None)
    unit.add_argument("--env", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                      help="an Environment= line (repeatable)")
    unit.add_argument("--env-file", default=None, help="EnvironmentFile= (secrets such as TENGYUN_API_KEY)")
    unit.add_argument("--no-capture-env", action="store_true",
                      help="do not copy ASCEND_*, HCCL_*, LD_LIBRARY_PATH, ... from this shell into the unit")
    unit.add_argument("--numa-node", type=int, default=None,
                      help="run under numactl --cpunodebind=N --membind=N (hosts with several NUMA nodes)")
    unit.add_argument("--supervise", action="store_true", help="run the server under `tengyun supervise`")
    unit.add_argument("--memory-threshold", type=float, default=None, help="with --supervise")
    unit.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- serve [MODEL] [flags]")

    nginx = kinds.add_parser("nginx", help="an nginx config balancing several servers, streaming unbuffered")
    nginx.add_argument("--upstream", action="append", required=True, metavar="HOST:PORT",
                       help="a tengyun serve instance (repeat for each)")
    nginx.add_argument("--listen", default="80", help="nginx's listen value (default 80)")
    nginx.add_argument("--server-name", default="_")
    nginx.add_argument("--max-fails", type=int, default=1)
    nginx.add_argument("--fail-timeout", type=int, default=10, help="seconds a failed instance is skipped")
    nginx.add_argument("--read-timeout", type=int, default=3600, help="seconds (long generations stream for minutes)")
    nginx.add_argument("--max-model-len", type=int, default=32768,
                       help="the servers' --max-model-len, to size client_max_body_size as they size "
                            "--max-request-bytes (default 32768)")
    nginx.add_argument("--max-request-bytes", type=int, default=None,
                       help="client_max_body_size in bytes: the servers' --max-request-bytes when they set one")
    nginx.add_argument("--full-config", metavar="PREFIX", default=None,
                       help="a complete nginx.conf with pid, logs and temp paths under PREFIX "
                            "(default: a conf.d snippet)")


def run(args: argparse.Namespace) -> int:
    if args.deploy_kind == "nginx":
        body_bytes = args.max_request_bytes or default_max_request_bytes(args.max_model_len)
        text = nginx_site(NginxSite(args.upstream, args.listen, args.server_name, max_fails=args.max_fails,
                                    fail_timeout_s=args.fail_timeout, read_timeout_s=args.read_timeout,
                                    client_max_body_size=str(body_bytes)))
        print(nginx_main_config(text, os.path.abspath(args.full_config)) if args.full_config else text, end="")
        return 0
    serve_args = serve_command(args.serve_args)
    serve = parse_serve_args(serve_args)
    exe = tengyun_executable()
    if args.supervise:
        extra = [] if args.memory_threshold is None else ["--memory-threshold", str(args.memory_threshold)]
        argv = [*exe, "supervise", *extra, "--", "serve", *serve_args]
    else:
        argv = [*exe, "serve", *serve_args]
    env = {} if args.no_capture_env else captured_env(dict(os.environ))
    env.update(dict(args.env))
    if args.numa_node is None:
        from tengyun.ops import probe

        nodes = probe.read_numa_nodes()
        if len(nodes) > 1:
            print(f"# note: this host has {len(nodes)} NUMA nodes; tengyun binds each worker to its device's node "
                  f"itself; pass --numa-node N to bind the whole service with numactl", file=sys.stderr)
    description = args.description or f"Tengyun LLM server: {shlex.join(serve_args)}"[:200]
    print(systemd_unit(SystemdUnit(argv, description, serve.shutdown_timeout, env, args.env_file, args.user,
                                   args.working_directory, args.numa_node)), end="")
    return 0
