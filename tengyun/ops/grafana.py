"""`tengyun deploy grafana`: a Grafana dashboard (JSON, import it in Dashboards > New > Import)
over the metrics the alerting rules watch (monitoring.py): readiness, latency, queue and KV
cache, throughput, errors, and each device's memory, use, temperature and power. Pure
functions; its PromQL is checked against a real Prometheus in
tests/entrypoints/openai/test_monitoring.py."""

from __future__ import annotations

from dataclasses import dataclass

GRID_WIDTH = 24  # Grafana's grid is 24 columns wide
PANEL_SIZE = (12, 8)  # two panels per row
PER_DEVICE = "{{device}} {{instance}}"  # legend of the device panels


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str  # Grafana unit id: "bytes", "percentunit", "s", "celsius", "watt", "reqps", "short"
    targets: tuple[tuple[str, str], ...]  # (PromQL with {sel} for the job/instance selector, legend)


def panels() -> list[Panel]:
    return [
        Panel("Ready (/health 200)", "short", (("tengyun:server_ready{sel}", "{{instance}}"),)),
        Panel("Time to first token", "s", (
            ("histogram_quantile(0.5, sum by (instance, le) (rate(tengyun:time_to_first_token_seconds_bucket{sel}"
             "[$__rate_interval])))", "p50 {{instance}}"),
            ("histogram_quantile(0.99, sum by (instance, le) (rate(tengyun:time_to_first_token_seconds_bucket{sel}"
             "[$__rate_interval])))", "p99 {{instance}}"))),
        Panel("Requests running / waiting", "short", (
            ("tengyun:num_requests_running{sel}", "running {{instance}}"),
            ("tengyun:num_requests_waiting{sel}", "waiting {{instance}}"))),
        Panel("KV cache usage", "percentunit", (("tengyun:kv_cache_usage_perc{sel}", "{{instance}}"),)),
        Panel("Tokens per second", "short", (
            ("rate(tengyun:prompt_tokens_total{sel}[$__rate_interval])", "prompt {{instance}}"),
            ("rate(tengyun:generation_tokens_total{sel}[$__rate_interval])", "generation {{instance}}"))),
        Panel("HTTP responses", "reqps", (
            ("sum by (instance, status) (rate(tengyun:http_responses_total{sel}[$__rate_interval]))",
             "{{status}} {{instance}}"),)),
        Panel("Device memory used", "percentunit", (
            ("tengyun:device_memory_used_bytes{sel} / tengyun:device_memory_total_bytes{sel}",
             PER_DEVICE),)),
        Panel("Device utilization", "percentunit", (("tengyun:device_utilization_ratio{sel}", PER_DEVICE),)),
        Panel("Device temperature", "celsius", (("tengyun:device_temperature_celsius{sel}", PER_DEVICE),)),
        Panel("Device power", "watt", (("tengyun:device_power_watts{sel}", PER_DEVICE),)),
    ]


def panel_queries(job: str = "tengyun", instance: str = ".*") -> list[str]:
    """Every panel's PromQL with the variables filled in (``$__rate_interval`` as 1m)."""
    selector = _selector(job, instance)
    return [expr.replace("{sel}", selector).replace("$__rate_interval", "1m")
            for p in panels() for expr, _ in p.targets]


def grafana_dashboard(job: str = "tengyun", title: str = "Tengyun") -> dict:
    """The dashboard as Grafana's JSON model: a Prometheus data-source variable and an
    ``instance`` variable (all instances of ``job`` by default)."""
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    selector = _selector(job, "$instance")
    width, height = PANEL_SIZE
    grafana_panels = []
    for i, p in enumerate(panels()):
        grafana_panels.append({
            "id": i + 1, "type": "timeseries", "title": p.title, "datasource": datasource,
            "gridPos": {"x": (i * width) % GRID_WIDTH, "y": (i * width) // GRID_WIDTH * height,
                        "w": width, "h": height},
            "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
            "targets": [{"refId": chr(ord("A") + k), "datasource": datasource, "legendFormat": legend,
                         "expr": expr.replace("{sel}", selector)} for k, (expr, legend) in enumerate(p.targets)],
        })
    variables = [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
        {"name": "instance", "label": "Instance", "type": "query", "datasource": datasource,
         "query": f'label_values(up{{job="{job}"}}, instance)', "refresh": 2, "multi": True, "includeAll": True,
         "allValue": ".*", "current": {"text": "All", "value": "$__all"}},
    ]
    return {"title": title, "uid": f"tengyun-{job}"[:40], "tags": ["tengyun"], "timezone": "browser",
            "schemaVersion": 39, "refresh": "30s", "time": {"from": "now-1h", "to": "now"},
            "templating": {"list": variables}, "panels": grafana_panels}


def _selector(job: str, instance: str) -> str:
    return f'{{job="{job}", instance=~"{instance}"}}'
