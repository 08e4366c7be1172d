"""`tengyun deploy alerts` and `tengyun deploy prometheus`: Debian's promtool accepts both files,
and `promtool test rules` fires the device-memory alert on a synthetic series exactly when it
crosses --memory-threshold for the --for duration."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tengyun.entrypoints.cli.main import main
from tengyun.ops.monitoring import AlertThresholds, alert_rules_list

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed: apt-get install prometheus "
                                                             "(.ci/run installs it)")


def deploy(capsys, *args: str) -> str:
    assert main(["deploy", *args]) == 0
    return capsys.readouterr().out


def promtool(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


@needs_promtool
def test_generated_rules_and_config_pass_promtool_check(capsys, tmp_path):
    (tmp_path / "tengyun-alerts.yml").write_text(deploy(capsys, "alerts", "--memory-threshold", "0.9"))
    (tmp_path / "prometheus.yml").write_text(deploy(capsys, "prometheus", "--targets", "10.0.0.1:8000,10.0.0.2:8000",
                                                    "--alertmanager", "127.0.0.1:9093"))
    rules = promtool("check", "rules", str(tmp_path / "tengyun-alerts.yml"))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert f"SUCCESS: {len(alert_rules_list(AlertThresholds()))} rules found" in rules.stdout
    config = promtool("check", "config", str(tmp_path / "prometheus.yml"))  # also checks the rules it loads
    assert config.returncode == 0, config.stdout + config.stderr
    assert "1 rule files found" in config.stdout


MEMORY_TEST = """
rule_files: [tengyun-alerts.yml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'tengyun:device_memory_used_bytes{job="tengyun",instance="a:8000",device="npu:0",node="n1"}'
        values: '96x20'
      - series: 'tengyun:device_memory_total_bytes{job="tengyun",instance="a:8000",device="npu:0",node="n1"}'
        values: '100x20'
      - series: 'tengyun:device_memory_used_bytes{job="tengyun",instance="a:8000",device="npu:1",node="n1"}'
        values: '90x20'
      - series: 'tengyun:device_memory_total_bytes{job="tengyun",instance="a:8000",device="npu:1",node="n1"}'
        values: '100x20'
    alert_rule_test:
      - eval_time: 3m
        alertname: TengyunDeviceMemoryHigh
        exp_alerts: []
      - eval_time: 10m
        alertname: TengyunDeviceMemoryHigh
        exp_alerts: EXPECTED
"""
FIRING = """
          - exp_labels: {severity: warning, job: tengyun, instance: 'a:8000', device: 'npu:0', node: n1}
            exp_annotations:
              summary: 'Tengyun a:8000 npu:0: memory 96% used'
              description: "DESCRIPTION"
"""


@needs_promtool
@pytest.mark.parametrize("threshold, fires", [("0.95", True), ("0.97", False)])
def test_memory_alert_fires_on_a_synthetic_series_above_the_threshold(capsys, tmp_path, threshold, fires):
    (tmp_path / "tengyun-alerts.yml").write_text(deploy(capsys, "alerts", "--memory-threshold", threshold))
    rule = next(r for r in alert_rules_list(AlertThresholds(memory_ratio=float(threshold)))
                if r.name == "TengyunDeviceMemoryHigh")
    expected = FIRING.replace("DESCRIPTION", rule.description) if fires else " []"
    (tmp_path / "memory_test.yml").write_text(MEMORY_TEST.replace(" EXPECTED", expected))
    run = promtool("test", "rules", "memory_test.yml", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("args, flag", [
    (("alerts", "--memory-threshold", "95"), "--memory-threshold"),
    (("alerts", "--for", "five minutes"), "--for"),
    (("prometheus", "--targets", "10.0.0.1"), "10.0.0.1"),
    (("prometheus", "--targets", "a:1", "--scrape-interval", "1 s"), "--scrape-interval"),
])
def test_bad_values_exit_2_naming_the_flag(capsys, args, flag):
    assert main(["deploy", *args]) == 2
    assert flag in capsys.readouterr().err


def test_grafana_dashboard_has_a_panel_per_metric_group_scoped_to_the_selected_instances(capsys):
    import json

    from tengyun.ops.grafana import panels

    dashboard = json.loads(deploy(capsys, "grafana", "--job", "llm"))
    assert [p["title"] for p in dashboard["panels"]] == [p.title for p in panels()]
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs and all('job="llm", instance=~"$instance"' in e for e in exprs)
    cells = {(p["gridPos"]["x"], p["gridPos"]["y"]) for p in dashboard["panels"]}
    assert len(cells) == len(dashboard["panels"])  # no two panels on the same spot
    assert dashboard["templating"]["list"][1]["query"] == 'label_values(up{job="llm"}, instance)'
