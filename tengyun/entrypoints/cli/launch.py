"""`tengyun launch --instances K [--devices-per-instance D] -- serve MODEL [flags]`: K servers
on disjoint devices (CPU: disjoint cores) and consecutive ports, behind one nginx endpoint."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

from tengyun.entrypoints.cli.supervise import (
    key_env, parse_serve_args, pop_api_key, serve_command, server_argv, start_child, stop_child, warn_key_in_argv,
)
from tengyun.ops.deploy import NginxSite, nginx_main_config, nginx_site
from tengyun.ops.launch import InstancePlan, plan_instances

logger = logging.getLogger("tengyun.launch")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "launch", help="several servers on disjoint devices behind one nginx endpoint",
        usage="tengyun launch --instances K [options] -- serve [MODEL] [serve flags]")
    parser.add_argument("--instances", type=int, required=True)
    parser.add_argument("--devices-per-instance", type=int, default=1)
    parser.add_argument("--devices", default=None,
                        help="device ids to split, e.g. 0,1,2,3 (default: $ASCEND_RT_VISIBLE_DEVICES / "
                             "$CUDA_VISIBLE_DEVICES, else every device the platform's smi tool lists)")
    parser.add_argument("--base-port", type=int, default=8001, help="instance i listens on BASE_PORT + i")
    parser.add_argument("--listen", default="8000", help="nginx's listen value, e.g. 8000 or 127.0.0.1:8000")
    parser.add_argument("--nginx-dir", default="tengyun-launch",
                        help="where nginx.conf, its pid, logs and temp files go (default ./tengyun-launch)")
    parser.add_argument("--nginx", default=None,
                        help="the nginx binary to run (default: nginx on PATH or /usr/sbin/nginx)")
    parser.add_argument("--no-nginx", action="store_true", help="only write nginx.conf, do not run nginx")
    parser.add_argument("--supervise", action="store_true", help="run each instance under `tengyun supervise`")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- serve [MODEL] [flags]")


def device_ids(platform, requested: str | None) -> list[int]:
    value = requested or os.environ.get(platform.visible_devices_env or "_", "")
    if value:
        return [int(v) for v in value.split(",") if v.strip()]
    return platform.smi_device_ids()


def instance_argv(plan: InstancePlan, serve_args: list[str], supervise: bool) -> list[str]:
    args = [*serve_args, "--host", "127.0.0.1", "--port", str(plan.port)]  # the last --port wins
    if supervise:
        return [sys.executable, "-m", "tengyun.entrypoints.cli.main", "supervise", "--", "serve", *args]
    return server_argv(args)


def run(args: argparse.Namespace) -> int:
    from tengyun.platforms import get_platform

    serve_args = serve_command(args.serve_args)
    serve = parse_serve_args(serve_args)
    serve_args, api_key = pop_api_key(serve_args)  # the instances get the key in their environment
    if api_key:
        warn_key_in_argv("launch")
    platform = get_platform(serve.device)
    ids = device_ids(platform, args.devices) if platform.visible_devices_env else []
    plans = plan_instances(args.instances, args.devices_per_instance, args.base_port, ids,
                           sorted(os.sched_getaffinity(0)), platform.visible_devices_env)
    prefix = os.path.abspath(args.nginx_dir)
    os.makedirs(prefix, exist_ok=True)
    conf = os.path.join(prefix, "nginx.conf")
    with open(conf, "w") as f:
        f.write(nginx_main_config(nginx_site(NginxSite([p.upstream for p in plans], args.listen)), prefix))
    logger.info("Wrote %s", conf)

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    procs: list[subprocess.Popen] = []
    for plan in plans:
        proc = start_child(instance_argv(plan, serve_args, args.supervise),
                           {**os.environ, **plan.env, **key_env(api_key)}, set(plan.cpus))
        procs.append(proc)
        logger.info("Instance %d: pid %d on 127.0.0.1:%d, devices %s, cpus %s", plan.index, proc.pid, plan.port,
                    ",".join(map(str, plan.devices)) or "-", ",".join(map(str, plan.cpus)))
    nginx = None
    if not args.no_nginx:
        binary = args.nginx or shutil.which("nginx") or "/usr/sbin/nginx"
        nginx = start_child([binary, "-p", prefix, "-c", conf, "-g", "daemon off;"])
        logger.info("nginx: pid %d listening on %s (%s)", nginx.pid, args.listen, conf)
    else:
        logger.info("Run nginx with: nginx -p %s -c %s", prefix, conf)
    running = set(range(len(procs)))
    while not stopping and running:
        for i in sorted(running):
            if procs[i].poll() is not None:
                running.discard(i)
                logger.warning("Instance %d (pid %d) exited with code %d; nginx routes around it",
                               i, procs[i].pid, procs[i].returncode)
        time.sleep(0.2)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    codes = [stop_child(p, serve.shutdown_timeout) for p in procs]
    if nginx is not None:
        stop_child(nginx, 0)
    return max(codes, default=0) if stopping else 1
