"""`tengyun supervise [options] -- serve [MODEL] [flags]`: run the server and restart it
gracefully when its memory passes a threshold, /health fails, it exits, or its start-up stalls;
see ops/supervise.py."""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from tengyun.entrypoints.cli.flexible_parser import FlexibleArgumentParser, dashed_flags
from tengyun.host import probe
from tengyun.ops.supervise import Decision, Observation, Reason, Watchdog, WatchdogPolicy

logger = logging.getLogger("tengyun.supervise")
KILL_GRACE_S = 15  # after --shutdown-timeout the server aborts what is left; this covers its exit
_PR_SET_PDEATHSIG = 1


def serve_command(argv: list[str]) -> list[str]:
    """'-- serve MODEL ...' / 'serve MODEL ...' / 'MODEL ...' -> ['MODEL', ...] (the serve flags)."""
    argv = list(argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    return dashed_flags(argv)  # --api_key K is --api-key K (pop_api_key below looks for the dashed name)


def parse_serve_args(serve_args: list[str]) -> argparse.Namespace:
    """The serve flags as `tengyun serve` reads them (host, port, --shutdown-timeout, --device)."""
    from tengyun.entrypoints.openai.cli_args import make_arg_parser

    return make_arg_parser(FlexibleArgumentParser(prog="tengyun serve")).parse_args(serve_args)


def server_argv(serve_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "tengyun.entrypoints.cli.main", "serve", *serve_args]


def pop_api_key(serve_args: list[str]) -> tuple[list[str], str | None]:
    """The serve flags without --api-key, and its value, so that a child's command line (ps)
    never holds the key: ['M', '--api-key', 'K', '--port', '1'] -> (['M', '--port', '1'], 'K');
    '--api-key=K' likewise; the last one wins, as in argparse."""
    rest, key, i = [], None, 0
    while i < len(serve_args):
        arg = serve_args[i]
        if arg == "--api-key" and i + 1 < len(serve_args):
            key, i = serve_args[i + 1], i + 2
            continue
        if arg.startswith("--api-key="):
            key = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if parse_serve_args(rest).api_key is not None:  # an argv shape this missed: refuse, never leak
        raise ValueError("could not take --api-key out of the serve flags: set TENGYUN_API_KEY in the "
                         "environment or pass --api-key-file PATH instead.")
    return rest, key


def key_env(api_key: str | None) -> dict[str, str]:
    """The environment entry that hands a key taken off the command line to the server."""
    from tengyun.entrypoints.openai.cli_args import API_KEY_ENV

    return {API_KEY_ENV: api_key} if api_key else {}


def warn_key_in_argv(command: str) -> None:
    logger.warning("--api-key is on the command line of `tengyun %s`, where ps shows it; its servers get it as "
                   "$TENGYUN_API_KEY instead. Set TENGYUN_API_KEY (or pass --api-key-file PATH) before starting "
                   "`tengyun %s` to keep the key out of ps altogether.", command, command)


def _die_with_parent() -> None:
    """In the child: SIGTERM it if the supervisor dies (Linux), so no server is left orphaned."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def start_child(argv: list[str], env: dict[str, str] | None = None, cpus: set[int] | None = None) -> subprocess.Popen:
    """A child in its own session: a terminal's Ctrl-C reaches only the parent, which forwards
    one SIGTERM (a second one would stop the server without draining)."""
    def preexec() -> None:
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)

    return subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=preexec)


def stop_child(proc: subprocess.Popen, drain_s: float) -> int:
    """SIGTERM (the server drains), SIGKILL if still running drain_s + KILL_GRACE_S later."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(drain_s + KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        logger.warning("pid %d still running %.0f s after SIGTERM: SIGKILL", proc.pid, drain_s + KILL_GRACE_S)
        proc.kill()
        return proc.wait()


def health_ok(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "supervise", help="run `serve` under a watchdog that restarts it gracefully (memory, /health, exits)",
        usage="tengyun supervise [options] -- serve [MODEL] [serve flags]")
    parser.add_argument("--memory-threshold", type=float, default=0.95,
                        help="restart when the server's device memory (CPU: its RSS against host RAM) reaches "
                             "this fraction (default 0.95)")
    parser.add_argument("--check-interval", type=float, default=5.0, help="seconds between checks (default 5)")
    parser.add_argument("--health-failures", type=int, default=3,
                        help="restart after this many failed /health checks in a row (default 3)")
    parser.add_argument("--start-timeout", type=float, default=900.0,
                        help="restart when /health is not 200 this many seconds after a start (default 900)")
    parser.add_argument("--start-stall-timeout", type=float, default=120.0,
                        help="restart a server that is not ready and used under 1%% of a core (with its workers) "
                             "for this many seconds: hung in start-up (default 120; 0: off)")
    parser.add_argument("--backoff-initial", type=float, default=1.0,
                        help="seconds before the 2nd of a run of restarts; doubles each time (default 1)")
    parser.add_argument("--backoff-max", type=float, default=300.0, help="longest back-off (default 300 s)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve tengyun:supervisor_restarts_total on this port's /metrics")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- serve [MODEL] [flags]")


def run(args: argparse.Namespace) -> int:
    from tengyun.entrypoints.openai.cli_args import check_server_args

    serve_args = serve_command(args.serve_args)
    serve = parse_serve_args(serve_args)  # bad serve flags fail here, before anything starts
    check_server_args(serve)
    serve_args, api_key = pop_api_key(serve_args)
    if api_key:
        warn_key_in_argv("supervise")
    if not 0 < args.memory_threshold <= 1:
        raise ValueError(f"--memory-threshold {args.memory_threshold}: a fraction in (0, 1], e.g. 0.95.")
    if args.check_interval <= 0:
        raise ValueError(f"--check-interval {args.check_interval}: must be positive, e.g. 5.")
    if args.start_stall_timeout < 0:
        raise ValueError(f"--start-stall-timeout {args.start_stall_timeout}: seconds >= 0, e.g. 120 (0: off).")
    policy = WatchdogPolicy(args.memory_threshold, args.check_interval, args.health_failures, args.start_timeout,
                            args.backoff_initial, args.backoff_max, start_stall_timeout_s=args.start_stall_timeout)
    return Supervisor(policy, serve_args, serve, args.metrics_port, key_env(api_key)).run()


class Supervisor:
    def __init__(self, policy: WatchdogPolicy, serve_args: list[str], serve: argparse.Namespace,
                 metrics_port: int | None, env: dict[str, str] | None = None):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        from tengyun.platforms import get_platform

        self.policy = policy
        self.serve_args = serve_args  # holds no --api-key (pop_api_key): the key travels in env
        self.env = {**os.environ, **env} if env else None
        self.drain_s = serve.shutdown_timeout
        host = "127.0.0.1" if serve.host in ("0.0.0.0", "::", "") else serve.host
        self.health_url = f"http://{host}:{serve.port}/health"
        self.platform = get_platform(serve.device)
        self.watchdog = Watchdog(policy)
        self.stopping = False
        self.registry = CollectorRegistry()
        self.restarts = Counter("tengyun:supervisor_restarts", "Server restarts by the supervisor, by reason",
                                ["reason"], registry=self.registry)
        for reason in Reason:
            self.restarts.labels(reason.value)  # every series exists from the start, at 0
        self.memory = Gauge("tengyun:supervisor_memory_usage_perc",
                            "Memory the server fills, as a fraction of its device's (CPU: host RAM)",
                            registry=self.registry)
        self.up = Gauge("tengyun:supervisor_server_healthy", "1 while the server's /health is 200",
                        registry=self.registry)
        if metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(metrics_port, addr=host, registry=self.registry)
            logger.info("Supervisor metrics on http://%s:%d/metrics", host, metrics_port)

    def _on_signal(self, sig: int, frame) -> None:
        if not self.stopping:
            logger.info("Received signal %d: stopping the server (drain up to %.0f s)", sig, self._drain_s())
        self.stopping = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        while True:
            proc = start_child(server_argv(self.serve_args), self.env)
            logger.info("Started the server: pid %d, watching %s", proc.pid, self.health_url)
            self.watchdog.started(time.monotonic())
            decision = self._watch(proc)
            if decision is None:  # stopping
                code = stop_child(proc, self._drain_s())
                logger.info("The server exited with code %d", code)
                return code
            self.restarts.labels(decision.reason.value).inc()
            logger.warning("Restart %d (%s): %s", self.watchdog.restarts + 1, decision.reason.value, decision.detail)
            if decision.graceful:
                drain_s = self._drain_s()
                logger.info("Stopping pid %d gracefully (SIGTERM; in-flight requests finish within %.0f s, "
                            "SIGKILL %.0f s later)", proc.pid, drain_s, drain_s + KILL_GRACE_S)
                code = stop_child(proc, drain_s)
                logger.info("pid %d exited with code %d", proc.pid, code)
            self.up.set(0)
            delay = self.watchdog.restarted()
            logger.info("Starting the server again in %.1f s (back-off)", delay)
            if self._sleep(delay):
                return 0

    def _drain_s(self) -> float:
        """Never ready means nothing in flight (requests got 503): a hung start-up is not waited for."""
        return self.drain_s if self.watchdog.ready_at is not None else 0.0

    def _sleep(self, seconds: float) -> bool:
        """Sleep, returning True early if a stop signal came."""
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return self.stopping

    def _watch(self, proc: subprocess.Popen) -> Decision | None:
        next_check = time.monotonic() + min(self.policy.check_interval_s, 1.0)  # readiness polled at <= 1 s
        while not self.stopping:
            exited = proc.poll()
            if exited is None and time.monotonic() < next_check:
                time.sleep(0.1)
                continue
            now = time.monotonic()
            ready = self.watchdog.ready_at is not None
            healthy = exited is None and health_ok(self.health_url, timeout=min(10.0, self.policy.check_interval_s * 2))
            usage = self.platform.memory_usage(proc.pid) if ready and exited is None else None
            cpu_s = probe.process_tree_cpu_s(proc.pid) if not ready and exited is None else None
            if usage is not None:
                self.memory.set(usage[0] / usage[1])
            self.up.set(1 if healthy else 0)
            decision = self.watchdog.check(Observation(now, exited, healthy, *(usage or (None, None)), cpu_s=cpu_s))
            if not ready and self.watchdog.ready_at is not None:
                logger.info("The server is healthy (pid %d)", proc.pid)
            interval = self.policy.check_interval_s
            next_check = now + (interval if self.watchdog.ready_at is not None else min(interval, 1.0))
            if decision is not None:
                return decision
        return None
