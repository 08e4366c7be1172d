"""Monitoring end to end: a real `tengyun serve` (tiny random Llama, --api-key set) with its device
gauges and GET /health/detail, scraped by a real Prometheus (Debian's package) started on loopback
with the config and rules `tengyun deploy prometheus|alerts` generate; its query API must return
the device gauges and up == 1."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from remote_server import API_KEY, free_port, running_server, server_model  # noqa: F401 (fixture)
from tengyun.entrypoints.cli.main import main
from tengyun.entrypoints.openai.device_metrics import DEVICE_GAUGES
from tengyun.ops.grafana import panel_queries
from tengyun.ops.monitoring import AlertThresholds, alert_rules_list

PROMETHEUS = shutil.which("prometheus")


@pytest.fixture(scope="module")
def server(server_model, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("monitoring") / "server.log"
    yield from running_server(server_model, ["--api-key", API_KEY, "--device-metrics-interval", "1",
                                             "--disable-log-stats"], log)


def samples(server) -> dict:
    """{(name, sorted labels): value} of one /metrics scrape."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_health_detail_is_open_and_shows_engine_kv_and_devices(server):
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401  # the key is on
    detail = wait_for(lambda: _detail_with_devices(server), "a device sample in /health/detail")
    assert detail["status"] == "ok" and detail["reason"] is None
    engine = detail["engine"]
    assert engine["state"] == "running" and engine["warmed_up"] is True and engine["draining"] is False
    assert engine["running"] == 0 and engine["kv_cache_usage"] == 0.0 and engine["kv_cache_blocks"] > 0
    assert detail["device_type"] == "cpu" and detail["node"] == socket.gethostname()
    cpu, = detail["devices"]
    assert cpu["device"] == "cpu" and cpu["source"] == "/proc"
    assert 0 < cpu["memory_used_bytes"] < cpu["memory_total_bytes"] == detail["host_memory_total_bytes"]
    assert detail["links"] is None  # no hccn_tool on a CPU host
    rank, = detail["memory"]  # the engine's one rank: weights, the profile step's measured peak, KV, headroom
    assert rank["rank"] == 0 and rank["weights"] > 0 and rank["kv_cache"] > 0
    assert rank["activation_peak"] > 0 and rank["activation_used"] == rank["activation_peak"]
    assert rank["measured_by"] == "process resident peak (VmHWM)" and 0 < rank["headroom"] < rank["memory_total"]


def _detail_with_devices(server):
    r = httpx.get(server.url + "/health/detail", timeout=10)
    assert r.status_code == 200, r.text
    return r.json() if r.json()["devices"] else None


def test_metrics_have_device_gauges_readiness_and_response_classes(server):
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    values = wait_for(lambda: samples(server) if ("tengyun:device_utilization_ratio", _cpu_labels()) in
                      samples(server) else None, "the CPU use gauge (after two samples)")
    for name, _, _ in DEVICE_GAUGES[:3]:
        assert values[(f"tengyun:{name}", _cpu_labels())] >= 0, name
    assert values[("tengyun:device_memory_used_bytes", _cpu_labels())] > 0
    assert ("tengyun:device_temperature_celsius", _cpu_labels()) not in values  # unreadable: left out, not 0
    assert values[("tengyun:server_ready", ())] == 1
    assert values[("tengyun:http_responses_total", (("status", "4xx"),))] >= 1


def _cpu_labels():
    return (("device", "cpu"), ("node", socket.gethostname()))


def test_starting_server_reports_loading_and_counts_its_503s(server_model):  # noqa: F811
    from tengyun.config import EngineConfig
    from tengyun.entrypoints.openai.http_server import build_host
    from tengyun.entrypoints.openai.routes import build_app
    from tengyun.entrypoints.openai.server_config import ServerConfig

    config = EngineConfig(model=str(server_model), kv_cache_memory="8MiB", max_model_len=256).finalize()
    state = build_host(config, ServerConfig(disable_log_stats=True, device_metrics_interval=5))
    app = build_app(state)  # no lifespan: the engine never starts, the sampler never runs

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tengyun") as http:
            assert (await http.post("/v1/completions", json={"prompt": "hi"})).status_code == 503
            detail = await http.get("/health/detail")
            assert detail.status_code == 503
            documented = (await http.get("/openapi.json")).json()["paths"]["/health/detail"]["get"]["responses"]
            assert sorted(documented) == ["200", "503"]  # no 401: open with --api-key too
            return detail.json(), (await http.get("/metrics")).text

    detail, metrics = asyncio.run(run())
    assert detail["engine"]["state"] == "loading" and detail["reason"].startswith("The server is starting")
    assert detail["devices"] is None  # no sample yet
    assert 'tengyun:http_responses_total{status="5xx"} 2.0' in metrics  # the two 503s
    assert "tengyun:server_ready 0.0" in metrics and "tengyun:device_memory_used_bytes" not in metrics


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed: apt-get install prometheus "
                                               "(.ci/run installs it)")
def test_real_prometheus_scrapes_the_server_with_the_generated_config(server, tmp_path, capsys):
    assert main(["deploy", "alerts"]) == 0
    (tmp_path / "tengyun-alerts.yml").write_text(capsys.readouterr().out)
    assert main(["deploy", "prometheus", "--targets", f"127.0.0.1:{server.port}", "--scrape-interval", "1s"]) == 0
    (tmp_path / "prometheus.yml").write_text(capsys.readouterr().out)
    port = free_port()
    log = open(tmp_path / "prometheus.log", "wb")
    argv = [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}"]  # loopback, a free port, storage in the test's folder
    prometheus = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        up = wait_for(lambda: _query(api, 'up{job="tengyun"}'), "up{job=\"tengyun\"}", prometheus)
        assert up[0]["metric"]["instance"] == f"127.0.0.1:{server.port}" and up[0]["value"][1] == "1"
        used = wait_for(lambda: _query(api, "tengyun:device_memory_used_bytes"), "the device gauges", prometheus)
        assert used[0]["metric"]["device"] == "cpu" and used[0]["metric"]["node"] == socket.gethostname()
        assert float(used[0]["value"][1]) > 0
        assert _query(api, "tengyun:device_memory_total_bytes")[0]["metric"]["job"] == "tengyun"
        assert _query(api, "tengyun:server_ready")[0]["value"][1] == "1"
        rules = wait_for(lambda: _evaluated_rules(api), "the alerting rules evaluated", prometheus)
        assert sorted(r["name"] for r in rules) == sorted(r.name for r in alert_rules_list(AlertThresholds()))
        assert {r["health"] for r in rules} == {"ok"}
        firing = [r["name"] for r in rules if r["state"] != "inactive"]
        assert firing == [], firing  # a healthy idle server trips nothing
        for promql in panel_queries():  # the Grafana dashboard's queries are valid PromQL (_query checks)
            _query(api, promql)
    finally:
        prometheus.terminate()
        prometheus.wait(30)
        log.close()


def _query(api: str, promql: str):
    r = httpx.get(f"{api}/query", params={"query": promql}, timeout=10)
    if r.status_code == 503:  # Prometheus still starting (replaying its WAL)
        return None
    body = r.json()
    assert body["status"] == "success", body
    return body["data"]["result"] or None


def _evaluated_rules(api: str):
    r = httpx.get(f"{api}/rules", timeout=10)
    if r.status_code == 503:
        return None
    rules = [rule for g in r.json()["data"]["groups"] for rule in g["rules"]]
    return rules if rules and all(r["health"] != "unknown" for r in rules) else None


def wait_for(read, what: str, process: subprocess.Popen | None = None, timeout: float = 60.0):
    """Poll ``read()`` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None:
            assert process.poll() is None, f"prometheus exited with {process.returncode}"
        try:
            found = read()
        except httpx.TransportError:
            found = None
        if found:
            return found
        time.sleep(0.2)
    pytest.fail(f"no {what} within {timeout} s")


def test_device_metrics_interval_zero_turns_the_gauges_off_and_negative_is_refused(server_model):  # noqa: F811
    import argparse

    from prometheus_client import generate_latest

    from tengyun.config import EngineConfig
    from tengyun.entrypoints.openai.http_server import build_host
    from tengyun.entrypoints.openai.cli_args import check_server_args, make_arg_parser
    from tengyun.entrypoints.openai.routes import health_json
    from tengyun.entrypoints.openai.server_config import ServerConfig

    config = EngineConfig(model=str(server_model), kv_cache_memory="8MiB", max_model_len=256).finalize()
    state = build_host(config, ServerConfig(disable_log_stats=True, device_metrics_interval=0))
    assert state.device_sampler is None and health_json(state)["devices"] is None
    assert "tengyun:device_" not in generate_latest(state.metrics.registry).decode()
    args = make_arg_parser(argparse.ArgumentParser()).parse_args([str(server_model), "--device-metrics-interval", "-1"])
    with pytest.raises(ValueError, match="--device-metrics-interval"):
        check_server_args(args)


def test_an_internal_error_counts_as_a_5xx_response(server_model):  # noqa: F811
    from tengyun.config import EngineConfig
    from tengyun.entrypoints.openai.http_server import build_host
    from tengyun.entrypoints.openai.routes import build_app
    from tengyun.entrypoints.openai.server_config import ServerConfig

    class Failing:
        async def create_completion(self, request):
            raise RuntimeError("injected bug")

    config = EngineConfig(model=str(server_model), kv_cache_memory="8MiB", max_model_len=256).finalize()
    state = build_host(config, ServerConfig(disable_log_stats=True, device_metrics_interval=0))
    state.lifecycle.ready, state.completion = True, Failing()  # no engine: the route itself fails
    app = build_app(state)

    async def run():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://tengyun") as http:
            assert (await http.post("/v1/completions", json={"prompt": "hi"})).status_code == 500
            assert (await http.get("/health")).status_code == 200
            return (await http.get("/metrics")).text

    metrics = asyncio.run(run())
    assert 'tengyun:http_responses_total{status="5xx"} 1.0' in metrics
    assert 'tengyun:http_responses_total{status="2xx"} 1.0' in metrics  # /health; /metrics counts after it answers
