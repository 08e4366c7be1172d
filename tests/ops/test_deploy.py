"""Generated systemd units and nginx configs (checked by systemd-analyze / nginx -t), instance
plans, and the supervisor's restart policy."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tengyun.ops.deploy import (
    NginxSite, SystemdUnit, nginx_main_config, nginx_site, parse_upstream, systemd_quote, systemd_unit,
)
from tengyun.ops.launch import plan_instances
from tengyun.ops.supervise import Backoff, Observation, Reason, Watchdog, WatchdogPolicy
from tengyun.platforms.base import fullest_device

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
TENGYUN = str(Path(sys.executable).parent / "tengyun")


def unit_sections(text: str) -> dict[str, list[tuple[str, str]]]:
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
        elif line and not line.startswith("#"):
            key, _, value = line.partition("=")
            current.append((key, value))
    return sections


def test_systemd_unit_restarts_always_and_outwaits_the_drain():
    text = systemd_unit(SystemdUnit([TENGYUN, "serve", "/models/Qwen3-8B", "--port", "8001"], drain_timeout_s=60,
                                    env={"ASCEND_RT_VISIBLE_DEVICES": "0,1"}, numa_node=2))
    s = unit_sections(text)
    service = dict(s["Service"])
    assert dict(s["Unit"])["StartLimitIntervalSec"] == "0"
    assert service["Restart"] == "always" and service["KillSignal"] == "SIGTERM"
    assert service["TimeoutStopSec"] == "90"  # 60 s drain + 30 s margin
    assert service["ExecStart"] == (f"/usr/bin/numactl --cpunodebind=2 --membind=2 {TENGYUN} serve "
                                    "/models/Qwen3-8B --port 8001")
    assert ("Environment", "ASCEND_RT_VISIBLE_DEVICES=0,1") in s["Service"]
    assert dict(s["Install"])["WantedBy"] == "multi-user.target"


def test_systemd_quote_escapes_specifiers_variables_and_spaces():
    assert systemd_quote("--port") == "--port"
    assert systemd_quote("a b") == '"a b"'
    assert systemd_quote("50%") == "50%%"
    assert systemd_quote("$HOME") == '"$$HOME"'
    assert systemd_quote('{"x": 1}') == '"{\\"x\\": 1}"'


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed (the structural test covers it)")
def test_generated_unit_passes_systemd_analyze_verify(tmp_path):
    unit = tmp_path / "tengyun.service"
    unit.write_text(systemd_unit(SystemdUnit(
        [TENGYUN, "supervise", "--", "serve", str(tmp_path), "--chat-template", "{{ 'a b' }} 100%"],
        env={"OMP_NUM_THREADS": "8", "TENGYUN_X": "with space"})))
    r = subprocess.run([SYSTEMD_ANALYZE, "verify", str(unit)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr  # warnings (bad quoting, unknown keys) go to stderr
    bad = tmp_path / "bad.service"
    bad.write_text(unit.read_text().replace("Restart=always", "Restart=sometimes"))
    r = subprocess.run([SYSTEMD_ANALYZE, "verify", str(bad)], capture_output=True, text=True)
    assert "restart specifier" in r.stderr  # the check does read what we generate


def nginx_t(tmp_path: Path, conf_text: str) -> subprocess.CompletedProcess:
    conf = tmp_path / "nginx.conf"
    conf.write_text(conf_text)
    return subprocess.run([NGINX, "-t", "-p", str(tmp_path), "-c", str(conf)], capture_output=True, text=True)


def test_generated_nginx_config_passes_nginx_t_and_streams_unbuffered(tmp_path):
    site = nginx_site(NginxSite(["127.0.0.1:8001", "127.0.0.1:8002"], listen="127.0.0.1:18080"))
    for directive in ("least_conn;", "server 127.0.0.1:8001 max_fails=1 fail_timeout=10s;", "keepalive 64;",
                      "proxy_buffering off;", "proxy_http_version 1.1;", 'proxy_set_header Connection "";',
                      "proxy_read_timeout 3600s;", "location = /instances/1/health",
                      "proxy_pass http://127.0.0.1:8002/metrics;"):
        assert directive in site
    r = nginx_t(tmp_path, nginx_main_config(site, str(tmp_path)))
    assert r.returncode == 0, r.stderr
    assert "syntax is ok" in r.stderr
    r = nginx_t(tmp_path, nginx_main_config(site.replace("least_conn;", "least_conn"), str(tmp_path)))
    assert r.returncode != 0


def test_nginx_upstream_must_be_host_port():
    assert parse_upstream("[::1]:8001") == ("[::1]", 8001)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_upstream("127.0.0.1")
    with pytest.raises(ValueError, match="--upstream"):
        nginx_site(NginxSite([]))


def test_plan_splits_npu_devices_and_cores_disjointly():
    plans = plan_instances(2, 2, 8001, list(range(8)), list(range(16)), "ASCEND_RT_VISIBLE_DEVICES")
    assert [(p.port, p.devices, p.cpus) for p in plans] == [
        (8001, (0, 1), tuple(range(8))), (8002, (2, 3), tuple(range(8, 16)))]
    assert plans[1].env == {"ASCEND_RT_VISIBLE_DEVICES": "2,3", "OMP_NUM_THREADS": "8"}


def test_plan_on_cpu_splits_cores_and_refuses_too_many_instances():
    plans = plan_instances(2, 1, 9000, [], [0, 1, 2], "")
    assert [(p.devices, p.cpus, p.env) for p in plans] == [((), (0,), {"OMP_NUM_THREADS": "1"}),
                                                           ((), (1,), {"OMP_NUM_THREADS": "1"})]
    with pytest.raises(ValueError, match="lower --instances to 3"):
        plan_instances(4, 1, 9000, [], [0, 1, 2], "")
    with pytest.raises(ValueError, match=r"needs 6 devices but 4 are visible.*lower --instances to 2"):
        plan_instances(3, 2, 9000, [0, 1, 2, 3], list(range(8)), "CUDA_VISIBLE_DEVICES")


def test_backoff_doubles_while_restarts_repeat_and_resets_after_a_stable_run():
    b = Backoff(1.0, 8.0, reset_s=600)
    assert [b.next_delay() for _ in range(6)] == [0.0, 1.0, 2.0, 4.0, 8.0, 8.0]
    b.stable_for(599)
    assert b.next_delay() == 8.0
    b.stable_for(600)
    assert b.next_delay() == 0.0


def test_watchdog_restarts_on_memory_only_once_ready():
    w = Watchdog(WatchdogPolicy(memory_threshold=0.9, start_timeout_s=100))
    w.started(0.0)
    assert w.check(Observation(1.0, None, False, 95, 100)) is None  # loading: memory not judged
    assert w.check(Observation(2.0, None, True, 95, 100)) is None  # the check that sees it ready
    d = w.check(Observation(7.0, None, True, 95, 100))
    assert d.reason is Reason.MEMORY and d.graceful and "95.0%" in d.detail
    assert w.check(Observation(8.0, None, True, 89, 100)) is None


def test_watchdog_health_failures_start_timeout_and_exit():
    w = Watchdog(WatchdogPolicy(health_failures=2, start_timeout_s=10))
    w.started(0.0)
    assert w.check(Observation(11.0, None, False)).reason is Reason.START_TIMEOUT
    w.started(20.0)
    w.check(Observation(21.0, None, True))
    assert w.check(Observation(22.0, None, False)) is None
    assert w.check(Observation(23.0, None, False)).reason is Reason.HEALTH
    d = w.check(Observation(24.0, -9, False))
    assert d.reason is Reason.EXIT and not d.graceful and "-9" in d.detail
    assert [w.restarted() for _ in range(3)] == [0.0, 1.0, 2.0] and w.restarts == 3


def test_fullest_device_limits_to_visible_devices():
    usage = {0: (1000, 2000), 1: (1900, 2000), 2: (100, 2000)}
    assert fullest_device(usage, None) == (1900 << 20, 2000 << 20)
    assert fullest_device(usage, "0,2") == (1000 << 20, 2000 << 20)
    assert fullest_device({}, None) is None


def test_deploy_cli_prints_a_verified_unit_and_a_valid_nginx_config(tmp_path, capsys):
    from tengyun.entrypoints.cli.main import main

    assert main(["deploy", "systemd", "--no-capture-env", "--env", "ASCEND_RT_VISIBLE_DEVICES=4,5", "--supervise",
                 "--memory-threshold", "0.9", "--", "serve", str(tmp_path), "--port", "8001",
                 "--shutdown-timeout", "45"]) == 0
    text = capsys.readouterr().out
    service = dict(unit_sections(text)["Service"])
    assert service["ExecStart"] == (f"{TENGYUN} supervise --memory-threshold 0.9 -- serve {tmp_path} "
                                    "--port 8001 --shutdown-timeout 45")
    assert service["TimeoutStopSec"] == "75" and service["Environment"] == "ASCEND_RT_VISIBLE_DEVICES=4,5"
    if SYSTEMD_ANALYZE:
        (tmp_path / "t.service").write_text(text)
        r = subprocess.run([SYSTEMD_ANALYZE, "verify", str(tmp_path / "t.service")], capture_output=True, text=True)
        assert r.returncode == 0 and r.stderr == "", r.stderr
    assert main(["deploy", "nginx", "--upstream", "127.0.0.1:8001", "--listen", "127.0.0.1:18081",
                 "--full-config", str(tmp_path)]) == 0
    r = nginx_t(tmp_path, capsys.readouterr().out)
    assert r.returncode == 0, r.stderr
    with pytest.raises(SystemExit):  # serve's own flag parser reads the serve flags
        main(["deploy", "systemd", "--", "serve", str(tmp_path), "--port", "eighty"])
    assert main(["deploy", "nginx", "--upstream", "localhost"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err


def test_systemd_unit_reads_the_key_from_its_secrets_file_and_refuses_it_anywhere_else():
    text = systemd_unit(SystemdUnit([TENGYUN, "serve", "/m"], env_file="/etc/ascend.env",
                                    secrets_file="/etc/tengyun/tengyun.env"))
    assert [v for k, v in unit_sections(text)["Service"] if k == "EnvironmentFile"] == [
        "/etc/ascend.env", "/etc/tengyun/tengyun.env"]  # the secrets file last: its key wins
    for unit in (SystemdUnit([TENGYUN, "serve", "/m", "--api-key", "sk-x"]),
                 SystemdUnit([TENGYUN, "serve", "/m", "--api-key=sk-x"]),
                 SystemdUnit([TENGYUN, "serve", "/m"], env={"TENGYUN_API_KEY": "sk-x"}),
                 SystemdUnit([TENGYUN, "serve", "/m"], env={"VLLM_API_KEY": "sk-x"})):
        with pytest.raises(ValueError, match="world-readable: pass the key through --secrets-file"):
            systemd_unit(unit)


def test_secrets_env_file_text_keeps_keys_literal():
    from tengyun.ops.deploy import secrets_env_file_text

    assert secrets_env_file_text("sk-AZ09_.+/=") == "TENGYUN_API_KEY=sk-AZ09_.+/=\n"
    assert secrets_env_file_text("a b$c\\d\"e") == "TENGYUN_API_KEY='a b$c\\d\"e'\n"  # single quotes: literal
    for bad in ("it's", "a\nb"):
        with pytest.raises(ValueError, match="quote or a control character"):
            secrets_env_file_text(bad)
