"""`tengyun deploy alerts|prometheus`: Prometheus alerting rules for Tengyun's /metrics and a
scrape config that loads them, as text. Pure functions over plain values; both outputs pass
`promtool check rules` / `promtool check config` (tests/entrypoints/test_cli_deploy_prometheus.py).

Every rule is scoped to the scrape job (``job``), so other jobs in the same Prometheus are left
alone. The "/health not 200" rule reads tengyun:server_ready, which the server computes from the
same condition /health answers with (Prometheus scrapes /metrics, which stays 200 while the
server starts, drains or has a dead engine); a process that is gone shows as up == 0. A
--headless node exports the same tengyun:server_ready and device gauges, so list every node of
a multi-node launch in --targets: a node that stops answering fires TengyunDown like node 0.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tengyun.ops.deploy import parse_upstream

_DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


@dataclass(frozen=True)
class AlertThresholds:
    job: str = "tengyun"
    memory_ratio: float = 0.95  # device memory used / total
    temperature_celsius: float = 85.0
    ttft_p99_seconds: float = 2.0
    max_waiting: int = 10  # requests queued (tengyun:num_requests_waiting)
    error_ratio: float = 0.05  # 5xx responses / all responses
    not_ready_for: str = "10m"  # loading a large model takes minutes: /health is 503 meanwhile
    duration: str = "5m"  # how long the SLO and device conditions must hold before firing


@dataclass(frozen=True)
class Rule:
    name: str
    expr: str
    duration: str
    severity: str  # "critical" pages; "warning" does not
    summary: str
    description: str


def alert_rules_list(t: AlertThresholds) -> list[Rule]:
    """The rules, in the order they are written. Annotations use Prometheus templates
    ({{ $labels.instance }}, {{ $value }})."""
    check_thresholds(t)
    job = f'job="{t.job}"'
    per_instance = "sum by (job, instance)"
    return [
        Rule("TengyunDown", f"up{{{job}}} == 0", "1m", "critical", "Tengyun instance {{ $labels.instance }} is down",
             "Prometheus cannot scrape /metrics: the server process (node 0, or a --headless node of a multi-node "
             "launch) is gone, hangs, or its port is unreachable."),
        Rule("TengyunRankDown", f"tengyun:rank_alive{{{job}}} == 0", "1m", "critical",
             "Tengyun {{ $labels.instance }}: rank {{ $labels.rank }} of node {{ $labels.node_rank }} exited",
             "A worker process of this --headless node has exited: the whole cluster stops serving until the "
             "node and node 0 restart (GET /health/detail on both says why)."),
        Rule("TengyunReplicaDown", f"tengyun:replica_alive{{{job}}} == 0", "1m", "critical",
             "Tengyun {{ $labels.instance }}: data-parallel replica {{ $labels.engine }} is down",
             "A data-parallel replica of this --headless node exited or its engine died: the API node serves "
             "no new requests until both nodes restart (GET /health/detail on both says why)."),
        Rule("TengyunNotReady", f"tengyun:server_ready{{{job}}} == 0", t.not_ready_for, "critical",
             "Tengyun {{ $labels.instance }}: /health is not 200",
             "The server answers 503 on /health (loading, warming up, draining, or its engine died); "
             "GET /health/detail says which."),
        Rule("TengyunDeviceMemoryHigh",
             f"tengyun:device_memory_used_bytes{{{job}}} / tengyun:device_memory_total_bytes{{{job}}} "
             f"> {t.memory_ratio:g}", t.duration, "warning",
             "Tengyun {{ $labels.instance }} {{ $labels.device }}: memory {{ $value | humanizePercentage }} used",
             f"Device memory above {t.memory_ratio:.0%} of capacity (CPU: the engine's resident memory against "
             "host RAM): another process shares the device, or the server is close to running out."),
        Rule("TengyunDeviceTemperatureHigh", f"tengyun:device_temperature_celsius{{{job}}} > {t.temperature_celsius:g}",
             t.duration, "warning", "Tengyun {{ $labels.instance }} {{ $labels.device }}: {{ $value }} C",
             f"Device temperature above {t.temperature_celsius:g} C: check cooling before it throttles."),
        Rule("TengyunDeviceUnhealthy", f"tengyun:device_health{{{job}}} == 0", "1m", "critical",
             "Tengyun {{ $labels.instance }} {{ $labels.device }} reports unhealthy",
             "npu-smi reports a Health other than OK: run `npu-smi info` on {{ $labels.node }}."),
        Rule("TengyunLinkDown", f"tengyun:device_link_up{{{job}}} == 0", "1m", "critical",
             "Tengyun {{ $labels.instance }} {{ $labels.device }}: HCCL link DOWN",
             "hccn_tool -link -g reports DOWN: collective communication across nodes will hang or fail."),
        Rule("TengyunTTFTHigh",
             f"histogram_quantile(0.99, sum by (job, instance, le) "
             f"(rate(tengyun:time_to_first_token_seconds_bucket{{{job}}}[5m]))) > {t.ttft_p99_seconds:g}",
             t.duration, "warning", "Tengyun {{ $labels.instance }}: TTFT p99 {{ $value | humanizeDuration }}",
             f"99th percentile time to first token above the {t.ttft_p99_seconds:g} s SLO: the server is "
             "overloaded (add instances) or prefills are too long."),
        Rule("TengyunQueueLong", f"tengyun:num_requests_waiting{{{job}}} > {t.max_waiting}", t.duration,
             "warning", "Tengyun {{ $labels.instance }}: {{ $value }} requests waiting",
             f"More than {t.max_waiting} requests wait for a batch slot or KV blocks: add instances or raise "
             "--max-num-seqs / the KV cache."),
        Rule("TengyunHigh5xxRate",
             f'{per_instance} (rate(tengyun:http_responses_total{{{job},status="5xx"}}[5m])) / '
             f"{per_instance} (rate(tengyun:http_responses_total{{{job}}}[5m])) > {t.error_ratio:g}",
             t.duration, "critical",
             "Tengyun {{ $labels.instance }}: {{ $value | humanizePercentage }} of responses are 5xx",
             f"More than {t.error_ratio:.0%} of HTTP responses are server errors (503 while not ready, 500 on "
             "internal errors): see the server log."),
        Rule("TengyunDeviceReadingsStale", f"time() - tengyun:device_sample_timestamp_seconds{{{job}}} > 120",
             t.duration, "warning", "Tengyun {{ $labels.instance }}: device readings are stale",
             "The device sampler has not finished a reading for 2 minutes: npu-smi / nvidia-smi may hang."),
    ]


def alert_rules(t: AlertThresholds) -> str:
    """A Prometheus rule file (YAML)."""
    lines = ["# Generated by `tengyun deploy alerts`: load it from prometheus.yml's rule_files.",
             "groups:", f"  - name: {_q(t.job)}", "    rules:"]
    for r in alert_rules_list(t):
        lines += [f"      - alert: {r.name}", f"        expr: {_q(r.expr)}", f"        for: {r.duration}",
                  "        labels:", f"          severity: {r.severity}", "        annotations:",
                  f"          summary: {_q(r.summary)}", f"          description: {_q(r.description)}"]
    return "\n".join(lines) + "\n"


def check_thresholds(t: AlertThresholds) -> None:
    if not 0 < t.memory_ratio <= 1:
        raise ValueError(f"--memory-threshold {t.memory_ratio:g}: a fraction in (0, 1], e.g. 0.95.")
    if not 0 < t.error_ratio <= 1:
        raise ValueError(f"--max-5xx-ratio {t.error_ratio:g}: a fraction in (0, 1], e.g. 0.05.")
    if t.ttft_p99_seconds <= 0 or t.max_waiting < 0:
        raise ValueError("--ttft-p99 must be positive seconds (e.g. 2) and --max-waiting at least 0 (e.g. 10).")
    for flag, value in (("--for", t.duration), ("--not-ready-for", t.not_ready_for)):
        if not _DURATION.match(value):
            raise ValueError(f"{flag} {value!r}: a Prometheus duration such as 5m, 90s or 1h.")
    if not re.match(r"^[A-Za-z0-9_.:-]+$", t.job):
        raise ValueError(f"--job {t.job!r}: use letters, digits, '_', '.', ':' or '-'.")


def prometheus_config(targets: list[str], rules_file: str, job: str = "tengyun", scrape_interval: str = "15s",
                      alertmanagers: list[str] | None = None) -> str:
    """prometheus.yml scraping ``targets`` (HOST:PORT of each `tengyun serve`) at /metrics and
    loading ``rules_file`` (relative paths resolve against prometheus.yml's folder)."""
    if not targets:
        raise ValueError("--targets needs at least one HOST:PORT, e.g. --targets 10.0.0.1:8000,10.0.0.2:8000.")
    for value in (*targets, *(alertmanagers or [])):
        parse_upstream(value)  # HOST:PORT or [v6]:PORT; raises naming the value
    if not _DURATION.match(scrape_interval):
        raise ValueError(f"--scrape-interval {scrape_interval!r}: a Prometheus duration such as 15s.")
    lines = ["# Generated by `tengyun deploy prometheus`.", "global:", f"  scrape_interval: {scrape_interval}",
             f"  evaluation_interval: {scrape_interval}", "rule_files:", f"  - {_q(rules_file)}"]
    if alertmanagers:
        lines += ["alerting:", "  alertmanagers:", "    - static_configs:",
                  f"        - targets: [{', '.join(_q(a) for a in alertmanagers)}]"]
    lines += ["scrape_configs:", f"  - job_name: {_q(job)}", "    metrics_path: /metrics",
              "    static_configs:", f"      - targets: [{', '.join(_q(t.strip()) for t in targets)}]"]
    return "\n".join(lines) + "\n"


def _q(text: str) -> str:
    """A quoted YAML scalar: single quotes (read literally) when the text has none, else JSON's
    double-quoted form (valid YAML). 'up{job="x"}' -> \'up{job="x"}\'."""
    return f"'{text}'" if "'" not in text and "\n" not in text else json.dumps(text, ensure_ascii=False)
