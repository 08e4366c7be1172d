"""Generated systemd units and nginx configs (checked by systemd-analyze / nginx -t), instance
plans, the supervisor's restart policy and the CPU time it reads from /proc."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
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
        env={"OMP_NUM_THREADS": "8", "TENGYUN_X": "with space"}, worker_numa_nodes=[6, 6],
        worker_numa_lines=["worker 0: npu 0 -> node 6 (CPUs 144-167)", "worker 1: npu 1 -> node 6 (CPUs 144-167)"])))
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


def test_watchdog_restarts_a_start_up_that_uses_no_cpu_for_the_stall_timeout():
    w = Watchdog(WatchdogPolicy(start_timeout_s=900, start_stall_timeout_s=120))  # progress: 1.2 s of CPU
    w.started(0.0)
    assert w.check(Observation(1.0, None, False, cpu_s=5.0)) is None  # the first reading: the baseline
    assert w.check(Observation(60.0, None, False, cpu_s=6.0)) is None  # +1.0 s: no progress, 59 s idle
    assert w.check(Observation(121.0, None, False, cpu_s=6.1)) is None  # 120 s idle: not over yet
    d = w.check(Observation(122.0, None, False, cpu_s=6.1))
    assert d.reason is Reason.START_STALL and d.graceful
    assert "1.10 s of CPU in the last 121 s (under 1% of a core) > --start-stall-timeout 120 s" in d.detail


def test_watchdog_stall_clock_restarts_at_each_progress_and_stops_at_ready():
    w = Watchdog(WatchdogPolicy(start_timeout_s=900, start_stall_timeout_s=120))
    w.started(0.0)
    w.check(Observation(1.0, None, False, cpu_s=0.0))
    assert w.check(Observation(100.0, None, False, cpu_s=1.2)) is None  # progress at 100
    assert w.check(Observation(220.0, None, False, cpu_s=2.3)) is None  # 120 s idle
    assert w.check(Observation(221.0, None, False, cpu_s=2.3)).reason is Reason.START_STALL
    w.started(300.0)  # a new process: a new baseline
    assert w.check(Observation(301.0, None, False, cpu_s=50.0)) is None
    assert w.check(Observation(350.0, None, True, cpu_s=50.0)) is None  # ready: CPU no longer judged
    assert w.check(Observation(600.0, None, True, cpu_s=50.0)) is None


def test_watchdog_stall_check_is_off_at_0_and_without_cpu_readings():
    for policy, cpu in ((WatchdogPolicy(start_timeout_s=900, start_stall_timeout_s=0), 1.0),
                        (WatchdogPolicy(start_timeout_s=900), None)):
        w = Watchdog(policy)
        w.started(0.0)
        assert all(w.check(Observation(t, None, False, cpu_s=cpu)) is None for t in (1.0, 500.0, 900.0))
        assert w.check(Observation(901.0, None, False, cpu_s=cpu)).reason is Reason.START_TIMEOUT


def test_stat_cpu_ticks_counts_from_the_last_parenthesis():
    from tengyun.host.probe import stat_cpu_ticks

    # A real /proc/PID/stat line whose command name holds ") (" and spaces.
    line = "4242 (py ) (x) S 1 4242 4242 0 -1 4194560 2573 0 0 0 30 5 2 1 20 0 3 0 98765 123 45 18446744073709551615"
    assert stat_cpu_ticks(line) == 38


def test_process_tree_cpu_counts_a_busy_child_and_none_once_gone():
    from tengyun.host.probe import process_tree, process_tree_cpu_s

    burn = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass\ntime.sleep(60)\n"
    parent = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {burn!r}]).wait()\n"
    proc = subprocess.Popen([sys.executable, "-c", parent])
    try:
        deadline = time.monotonic() + 60
        while (process_tree_cpu_s(proc.pid) or 0) < 1.0:  # the child's second of CPU counts for the parent
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert len(process_tree(proc.pid)) == 2
    finally:
        for pid in reversed(process_tree(proc.pid) or []):
            os.kill(pid, signal.SIGKILL)
        proc.wait()
    assert process_tree_cpu_s(proc.pid) is None
