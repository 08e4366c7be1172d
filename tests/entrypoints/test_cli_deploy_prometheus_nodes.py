"""The alert rules cover every node of a multi-node launch (`promtool test rules` on synthetic
series): a --headless node that stops answering fires TengyunDown like node 0, and a headless
rank that exited fires TengyunRankDown naming the rank and node, a headless data-parallel node's
replica that exited TengyunReplicaDown naming the replica."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tengyun.entrypoints.cli.main import main

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed: apt-get install prometheus")

NODES_TEST = """
rule_files: [tengyun-alerts.yml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'up{job="tengyun",instance="10.0.0.1:8000"}'
        values: '1x10'
      - series: 'up{job="tengyun",instance="10.0.0.2:8000"}'
        values: '1 1 0x8'
      - series: 'tengyun:rank_alive{job="tengyun",instance="10.0.0.3:8000",node="n3",node_rank="2",rank="17"}'
        values: '1 1 1 0x7'
      - series: 'tengyun:replica_alive{job="tengyun",instance="10.0.0.4:8000",node="n4",engine="3"}'
        values: '1 1 1 0x7'
    alert_rule_test:
      - eval_time: 1m
        alertname: TengyunDown
        exp_alerts: []
      - eval_time: 4m
        alertname: TengyunDown
        exp_alerts:
          - exp_labels: {severity: critical, job: tengyun, instance: '10.0.0.2:8000'}
            exp_annotations:
              summary: 'Tengyun instance 10.0.0.2:8000 is down'
              description: "DOWN_DESCRIPTION"
      - eval_time: 5m
        alertname: TengyunRankDown
        exp_alerts:
          - exp_labels: {severity: critical, job: tengyun, instance: '10.0.0.3:8000', node: n3, node_rank: '2',
                         rank: '17'}
            exp_annotations:
              summary: 'Tengyun 10.0.0.3:8000: rank 17 of node 2 exited'
              description: "RANK_DESCRIPTION"
      - eval_time: 2m
        alertname: TengyunReplicaDown
        exp_alerts: []
      - eval_time: 5m
        alertname: TengyunReplicaDown
        exp_alerts:
          - exp_labels: {severity: critical, job: tengyun, instance: '10.0.0.4:8000', node: n4, engine: '3'}
            exp_annotations:
              summary: 'Tengyun 10.0.0.4:8000: data-parallel replica 3 is down'
              description: "REPLICA_DESCRIPTION"
"""


def test_a_silent_headless_node_an_exited_rank_and_an_exited_replica_fire_their_alerts(capsys, tmp_path):
    from tengyun.ops.monitoring import AlertThresholds, alert_rules_list

    assert main(["deploy", "alerts"]) == 0
    (tmp_path / "tengyun-alerts.yml").write_text(capsys.readouterr().out)
    rules = {r.name: r for r in alert_rules_list(AlertThresholds())}
    (tmp_path / "nodes_test.yml").write_text(NODES_TEST.replace("DOWN_DESCRIPTION", rules["TengyunDown"].description)
                                             .replace("RANK_DESCRIPTION", rules["TengyunRankDown"].description)
                                             .replace("REPLICA_DESCRIPTION", rules["TengyunReplicaDown"].description))
    run = subprocess.run([PROMTOOL, "test", "rules", "nodes_test.yml"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
