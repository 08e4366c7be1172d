"""`tengyun deploy systemd|nginx|alerts|prometheus|grafana`: print a systemd unit, an nginx config
(ops/deploy.py), Prometheus alerting rules or a Prometheus scrape config (ops/monitoring.py), or
a Grafana dashboard (ops/grafana.py)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys

from tengyun.entrypoints.cli.supervise import parse_serve_args, pop_api_key, serve_command
from tengyun.entrypoints.openai.request_limits import default_max_request_bytes
from tengyun.ops.deploy import (
    SECRET_ENV, NginxSite, SystemdUnit, nginx_main_config, nginx_site, secrets_env_file_text, systemd_unit,
)
from tengyun.ops.grafana import grafana_dashboard
from tengyun.ops.monitoring import AlertThresholds, alert_rules, prometheus_config
from tengyun.sizing.data_parallel import local_replicas

# Carried into the unit from the shell it is generated in (after `source set_env.sh`).
ENV_PREFIXES = ("ASCEND_", "HCCL_", "TENGYUN_", "OMP_")
ENV_KEYS = ("LD_LIBRARY_PATH", "PYTHONPATH", "CUDA_VISIBLE_DEVICES", "HF_HOME", "RANK_TABLE_FILE")
SECRET_KEYS = SECRET_ENV  # never written into a world-readable unit: they go to --secrets-file


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
    parser = subparsers.add_parser("deploy", help="print a systemd unit, an nginx config or Prometheus monitoring "
                                                  "for production")
    kinds = parser.add_subparsers(dest="deploy_kind", required=True)

    unit = kinds.add_parser("systemd", help="a systemd unit for a serve command",
                            usage="tengyun deploy systemd [options] -- serve [MODEL] [serve flags]")
    unit.add_argument("--description", default=None)
    unit.add_argument("--user", default=None, help="User= of the service")
    unit.add_argument("--working-directory", default=None)
    unit.add_argument("--env", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                      help="an Environment= line (repeatable)")
    unit.add_argument("--env-file", default=None, help="EnvironmentFile= of your own (e.g. Ascend's set_env.sh "
                                                        "output), read before --secrets-file")
    unit.add_argument("--secrets-file", default=None, metavar="PATH",
                      help="write the API key (the serve flags' --api-key, else $TENGYUN_API_KEY / $VLLM_API_KEY "
                           "of this shell) to PATH as TENGYUN_API_KEY=..., mode 0600, and point EnvironmentFile= "
                           "at it; the unit and its command line never hold the key")
    unit.add_argument("--no-capture-env", action="store_true",
                      help="do not copy ASCEND_*, HCCL_*, LD_LIBRARY_PATH, ... from this shell into the unit")
    unit.add_argument("--numa-node", type=int, default=None,
                      help="run the whole service under numactl --cpunodebind=N --membind=N (default: each worker "
                           "binds to its own device's node, written into the unit as TENGYUN_NUMA_NODES)")
    unit.add_argument("--supervise", action="store_true", help="run the server under `tengyun supervise`")
    unit.add_argument("--nnodes", type=int, default=None,
                      help="a unit for one node of a multi-node launch: adds --nnodes N and --node-rank R to the "
                           "serve flags (and --headless for R > 0), so every node's unit comes from one command; "
                           "with --data-parallel-size, node R runs replicas R x --data-parallel-size-local on "
                           "(--headless --data-parallel-start-rank for R > 0)")
    unit.add_argument("--node-rank", type=int, default=None, help="with --nnodes: this unit's node (0: the engine)")
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
    _add_monitoring_parsers(kinds)


def _comma_list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _add_monitoring_parsers(kinds) -> None:
    defaults = AlertThresholds()
    alerts = kinds.add_parser("alerts", help="Prometheus alerting rules for the servers' /metrics")
    alerts.add_argument("--job", default=defaults.job, help="the scrape job the rules watch (default tengyun)")
    alerts.add_argument("--memory-threshold", type=float, default=defaults.memory_ratio,
                        help="device memory used / total that fires TengyunDeviceMemoryHigh (default 0.95)")
    alerts.add_argument("--max-temperature", type=float, default=defaults.temperature_celsius,
                        help="device temperature in C (default 85)")
    alerts.add_argument("--ttft-p99", type=float, default=defaults.ttft_p99_seconds,
                        help="SLO for the 99th percentile time to first token, seconds (default 2)")
    alerts.add_argument("--max-waiting", type=int, default=defaults.max_waiting,
                        help="SLO for requests waiting to be scheduled (default 10)")
    alerts.add_argument("--max-5xx-ratio", type=float, default=defaults.error_ratio,
                        help="fraction of HTTP responses that may be 5xx (default 0.05)")
    alerts.add_argument("--for", dest="duration", default=defaults.duration,
                        help="how long a device or SLO condition holds before it fires (default 5m)")
    alerts.add_argument("--not-ready-for", default=defaults.not_ready_for,
                        help="how long /health may be 503 (loading, draining) before it fires (default 10m)")

    prometheus = kinds.add_parser("prometheus", help="a prometheus.yml scraping the servers and loading the rules")
    prometheus.add_argument("--targets", type=_comma_list, required=True, metavar="HOST:PORT,...",
                            help="the `tengyun serve` instances to scrape")
    prometheus.add_argument("--rules-file", default="tengyun-alerts.yml",
                            help="where `tengyun deploy alerts` output is saved (relative: next to prometheus.yml)")
    prometheus.add_argument("--job", default=defaults.job, help="job_name (default tengyun; match deploy alerts)")
    prometheus.add_argument("--scrape-interval", default="15s")
    prometheus.add_argument("--alertmanager", type=_comma_list, default=None, metavar="HOST:PORT,...",
                            help="Alertmanagers to send firing alerts to")

    grafana = kinds.add_parser("grafana", help="a Grafana dashboard (JSON) for the servers and their devices")
    grafana.add_argument("--job", default=defaults.job, help="the scrape job (default tengyun)")
    grafana.add_argument("--title", default="Tengyun")


def run(args: argparse.Namespace) -> int:
    if args.deploy_kind == "alerts":
        thresholds = AlertThresholds(
            job=args.job, memory_ratio=args.memory_threshold, temperature_celsius=args.max_temperature,
            ttft_p99_seconds=args.ttft_p99, max_waiting=args.max_waiting, error_ratio=args.max_5xx_ratio,
            not_ready_for=args.not_ready_for, duration=args.duration)
        print(alert_rules(thresholds), end="")
        return 0
    if args.deploy_kind == "grafana":
        print(json.dumps(grafana_dashboard(args.job, args.title), indent=2))
        return 0
    if args.deploy_kind == "prometheus":
        print(prometheus_config(args.targets, args.rules_file, args.job, args.scrape_interval, args.alertmanager),
              end="")
        return 0
    if args.deploy_kind == "nginx":
        body_bytes = args.max_request_bytes or default_max_request_bytes(args.max_model_len)
        text = nginx_site(NginxSite(args.upstream, args.listen, args.server_name, max_fails=args.max_fails,
                                    fail_timeout_s=args.fail_timeout, read_timeout_s=args.read_timeout,
                                    client_max_body_size=str(body_bytes)))
        print(nginx_main_config(text, os.path.abspath(args.full_config)) if args.full_config else text, end="")
        return 0
    return run_systemd(args)


def run_systemd(args: argparse.Namespace) -> int:
    from tengyun.entrypoints.openai.cli_args import check_server_args

    serve_args = node_serve_args(serve_command(args.serve_args), args.nnodes, args.node_rank)
    serve = parse_serve_args(serve_args)
    check_server_args(serve)  # a unit that cannot start is refused here, not at every restart
    serve_args, api_key = pop_api_key(serve_args)
    secrets = secrets_for_unit(args.secrets_file, api_key, serve) if args.secrets_file or api_key else None
    if secrets is None and not (serve.api_key_file or args.env_file):
        shell_keys = [k for k in SECRET_ENV if os.environ.get(k)]
        if shell_keys:
            print(f"# note: {shell_keys[0]} is set in this shell but not written into the unit, which will run "
                  f"without a key: pass --secrets-file PATH to carry it", file=sys.stderr)
    exe = tengyun_executable()
    if args.supervise:
        extra = [] if args.memory_threshold is None else ["--memory-threshold", str(args.memory_threshold)]
        argv = [*exe, "supervise", *extra, "--", "serve", *serve_args]
    else:
        argv = [*exe, "serve", *serve_args]
    env = {} if args.no_capture_env else captured_env(dict(os.environ))
    env.update(dict(args.env))
    placement = worker_placement(serve, env, args.numa_node)
    node = f" node {args.node_rank} of {args.nnodes}" if (args.nnodes or 1) > 1 else ""
    description = args.description or f"Tengyun LLM server{node}: {shlex.join(serve_args)}"[:200]
    text = systemd_unit(SystemdUnit(argv, description, serve.shutdown_timeout, env, args.env_file, args.user,
                                    args.working_directory, args.numa_node,
                                    secrets_file=secrets[0] if secrets else None,
                                    worker_numa_nodes=placement.nodes if placement else None,
                                    worker_numa_lines=placement.lines if placement else []))
    if secrets:
        write_secrets(*secrets)
    print(text, end="")
    return 0


def node_serve_args(serve_args: list[str], nnodes: int | None, node_rank: int | None) -> list[str]:
    """The serve flags of node ``node_rank`` of ``nnodes``: ['M', '-tp', '8'], 2, 1 ->
    ['M', '-tp', '8', '--nnodes', '2', '--node-rank', '1', '--headless']; a serve flag that
    says otherwise is refused."""
    if nnodes is None and node_rank is None:
        return serve_args
    if nnodes is None or node_rank is None or not 0 <= node_rank < nnodes:
        raise ValueError(f"--nnodes {nnodes} --node-rank {node_rank}: give both, with 0 <= --node-rank < --nnodes "
                         f"(e.g. --nnodes 4 --node-rank 1).")
    given = parse_serve_args(serve_args)
    if given.headless and node_rank == 0:
        raise ValueError("--node-rank 0 runs the engine: drop --headless from the serve flags.")
    if given.data_parallel_size > 1:
        return data_parallel_node_args(serve_args, given, nnodes, node_rank)
    for flag, value, default in (("--nnodes", nnodes, 1), ("--node-rank", node_rank, 0)):
        if getattr(given, flag[2:].replace("-", "_")) not in (value, default):
            raise ValueError(f"{flag} {value} of `deploy systemd` differs from the serve flag {flag}: keep one.")
    rest = [a for a in _without_flags(serve_args, ("--nnodes", "--node-rank")) if a != "--headless"]
    return [*rest, "--nnodes", str(nnodes), "--node-rank", str(node_rank), *(["--headless"] if node_rank else [])]


DATA_PARALLEL_NODE_FLAGS = ("--data-parallel-size-local", "-dpl", "--data-parallel-start-rank", "-dpr")


def data_parallel_node_args(serve_args: list[str], given: argparse.Namespace, nnodes: int, node_rank: int
                            ) -> list[str]:
    """Replicas over nodes (vLLM's layout): node R of ``nnodes`` runs --data-parallel-size-local
    replicas from R x that; node 0 serves the API, the others run --headless and connect to
    --data-parallel-address. ['M', '-dp', '4', '-dpa', 'H'], 2, 1 -> ['M', '-dp', '4', '-dpa', 'H',
    '--data-parallel-size-local', '2', '--headless', '--data-parallel-start-rank', '2']."""
    dp = given.data_parallel_size
    local = given.data_parallel_size_local or dp // nnodes
    if local * nnodes != dp:
        per_node = f"--data-parallel-size-local {local}" if given.data_parallel_size_local else f"{dp} / {nnodes}"
        raise ValueError(f"--nnodes {nnodes} x {per_node} replicas per node != --data-parallel-size {dp}: every node "
                         f"runs the same number of replicas; pick --nnodes and --data-parallel-size-local whose "
                         f"product is {dp}.")
    if given.nnodes != 1:
        raise ValueError(f"--nnodes {nnodes} of `deploy systemd` places data-parallel replicas on nodes; the serve "
                         f"flag --nnodes {given.nnodes} would spread one replica's ranks over nodes: drop it.")
    if not given.data_parallel_address:
        raise ValueError(f"--data-parallel-size {dp} over --nnodes {nnodes} needs --data-parallel-address (the API "
                         f"node's address, which the other nodes' replicas connect to) in the serve flags.")
    start = node_rank * local
    if given.data_parallel_start_rank not in (0, start):
        raise ValueError(f"--data-parallel-start-rank {given.data_parallel_start_rank} in the serve flags differs "
                         f"from node {node_rank}'s first replica {start} (--node-rank x --data-parallel-size-local): "
                         f"drop it.")
    rest = [a for a in _without_flags(serve_args, DATA_PARALLEL_NODE_FLAGS) if a != "--headless"]
    return [*rest, "--data-parallel-size-local", str(local),
            *(["--headless", "--data-parallel-start-rank", str(start)] if node_rank else [])]


def _without_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv without ``flags`` and their values ('--nnodes 2' and '--nnodes=2' alike)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in flags)):
            out.append(arg)
    return out


def worker_placement(serve: argparse.Namespace, env: dict[str, str], numa_node: int | None):
    """Each of this node's workers on its device's NUMA node (host/numa.py WorkerPlacement), None
    where the host has one node or no accelerator; --numa-node N is refused when it would pin
    workers whose devices sit on other nodes."""
    from tengyun.host import numa, probe

    kind = numa.accelerator_kind(serve.device)
    nodes, device_nodes = numa.host_device_nodes(kind) if kind else (probe.read_numa_nodes(), {})
    replicas = len(local_replicas(serve))  # each runs tp x pp workers, on the next devices (replica_environments)
    workers = replicas * serve.tensor_parallel_size * serve.pipeline_parallel_size // max(serve.nnodes, 1)
    visible = env.get(numa.VISIBLE_DEVICES_ENV[kind]) if kind else None
    placement = numa.plan_worker_nodes(kind, workers, visible, nodes, device_nodes) if kind else None
    if numa_node is not None:
        if placement and set(placement.nodes) != {numa_node}:
            raise ValueError(f"--numa-node {numa_node} would pin all {workers} workers to node {numa_node}, but their "
                             f"devices sit on nodes {','.join(map(str, placement.nodes))}: drop --numa-node (the unit "
                             f"then binds each worker to its own device's node).")
        return None
    if placement is None and len(nodes) > 1:
        print(f"# note: this host has {len(nodes)} NUMA nodes but the devices' nodes are unknown here; each worker "
              f"binds to its device's node itself when it starts", file=sys.stderr)
    return placement


def secrets_for_unit(path: str | None, flag_key: str | None, serve: argparse.Namespace) -> tuple[str, str]:
    """(--secrets-file as an absolute path for EnvironmentFile=, the text to write there)."""
    if path is None:
        raise ValueError("--api-key would be written into the unit in plain text (world-readable, and in ps): add "
                         "--secrets-file /etc/tengyun/tengyun.env to write it there with mode 0600 instead.")
    if serve.api_key_file:
        raise ValueError("--secrets-file and the serve flag --api-key-file both give the key: keep one.")
    key = flag_key or next((os.environ[k] for k in SECRET_ENV if os.environ.get(k)), None)
    if not key:
        raise ValueError("--secrets-file needs a key: add --api-key KEY to the serve flags or set TENGYUN_API_KEY "
                         "in this shell.")
    return os.path.abspath(path), secrets_env_file_text(key)  # EnvironmentFile= takes absolute paths only


def write_secrets(path: str, text: str) -> None:
    try:
        write_private_file(path, text)
    except OSError as e:
        raise ValueError(f"--secrets-file {path}: cannot write it ({e.strerror}); pick a writable path.") from None
    print(f"# wrote the API key to {path} (mode 0600); the unit reads it with EnvironmentFile=", file=sys.stderr)


def write_private_file(path: str, text: str) -> None:
    """Create or replace ``path`` as mode 0600 before the first byte goes in (an existing file
    keeps its old mode through O_TRUNC, hence the fchmod); a symlink there is refused."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(text)
