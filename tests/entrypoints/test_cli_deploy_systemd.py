"""`tengyun deploy systemd` keeps the API key out of the unit: the key goes to --secrets-file
(mode 0600, TENGYUN_API_KEY=...) and the unit points EnvironmentFile= at it."""

from __future__ import annotations

import shutil
import stat
import subprocess

import pytest

from tengyun.entrypoints.cli.main import main

KEY = "sk-deploy-secret"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


@pytest.fixture(autouse=True)
def no_shell_keys(monkeypatch):
    for name in ("TENGYUN_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)


def deploy(capsys, *flags: str, serve: tuple[str, ...] = ()) -> tuple[int, str, str]:
    code = main(["deploy", "systemd", "--no-capture-env", *flags, "--", "serve", "/models/m", "--port", "8001",
                 *serve])
    out, err = capsys.readouterr()
    return code, out, err


def service(unit: str) -> dict[str, list[str]]:
    lines: dict[str, list[str]] = {}
    for line in unit.splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            lines.setdefault(key, []).append(value)
    return lines


@pytest.mark.parametrize("supervise", [(), ("--supervise",)])
def test_key_given_as_serve_flag_goes_to_a_0600_file_never_into_the_unit(supervise, capsys, tmp_path):
    secrets = tmp_path / "tengyun.env"
    code, unit, err = deploy(capsys, *supervise, "--secrets-file", str(secrets), serve=("--api-key", KEY))
    assert code == 0, err
    assert KEY not in unit and "--api-key" not in unit
    assert service(unit)["EnvironmentFile"] == [str(secrets)]
    assert service(unit)["ExecStart"][0].endswith("serve /models/m --port 8001")
    assert secrets.read_text() == f"TENGYUN_API_KEY={KEY}\n"
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o600
    assert f"wrote the API key to {secrets} (mode 0600)" in err and KEY not in err
    if SYSTEMD_ANALYZE:
        (tmp_path / "t.service").write_text(unit)
        r = subprocess.run([SYSTEMD_ANALYZE, "verify", str(tmp_path / "t.service")], capture_output=True, text=True)
        assert r.returncode == 0 and r.stderr == "", r.stderr


def test_key_from_this_shell_goes_to_the_file_and_an_existing_file_becomes_0600(capsys, tmp_path, monkeypatch):
    secrets = tmp_path / "tengyun.env"
    secrets.write_text("old\n")
    secrets.chmod(0o644)
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    code, unit, err = deploy(capsys, "--secrets-file", str(secrets))
    assert code == 0, err
    assert KEY not in unit
    assert secrets.read_text() == f"TENGYUN_API_KEY={KEY}\n"
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o600


def test_key_without_a_secrets_file_is_refused_and_nothing_is_printed(capsys):
    code, unit, err = deploy(capsys, serve=("--api-key", KEY))
    assert (code, unit) == (2, "")
    assert "error: --api-key would be written into the unit in plain text" in err and "--secrets-file" in err
    assert KEY not in err


def test_a_key_in_the_shell_but_no_secrets_file_is_noted(capsys, monkeypatch):
    monkeypatch.setenv("TENGYUN_API_KEY", KEY)
    code, unit, err = deploy(capsys)
    assert code == 0 and KEY not in unit and "EnvironmentFile" not in unit
    assert "# note: TENGYUN_API_KEY is set in this shell but not written into the unit" in err


@pytest.mark.parametrize("flags, serve, message", [
    (("--env", f"TENGYUN_API_KEY={KEY}"), (), "TENGYUN_API_KEY in Environment= would be world-readable"),
    (("--secrets-file", "{dir}/s.env"), (), "--secrets-file needs a key"),
    (("--secrets-file", "{dir}/s.env"), ("--api-key-file", "/etc/k"), "--api-key-file both give the key"),
    (("--secrets-file", "{dir}/missing/s.env"), ("--api-key", KEY), "cannot write it (No such file or directory)"),
    ((), ("--allow-credentials",), "--allow-credentials with --allowed-origins '*'"),
])
def test_deploy_refuses_keys_it_cannot_keep_secret(flags, serve, message, capsys, tmp_path):
    code, unit, err = deploy(capsys, *[f.format(dir=tmp_path) for f in flags], serve=serve)
    assert (code, unit) == (2, ""), err
    assert message in err and KEY not in err
    assert not (tmp_path / "s.env").exists()
