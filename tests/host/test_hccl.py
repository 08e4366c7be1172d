"""The HCCL environment: the defaults each NPU rank sets when the user did not (through the
platform layer: NpuPlatform.init_process), the range checks `tengyun doctor` runs, and the
`hccn_tool -i N -ip -g` parser on a recorded output."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from tengyun.host import hccl
from tengyun.host.smi import parse_hccn_ip

FIXTURES = Path(__file__).parents[1] / "fixtures" / "ops"


@pytest.fixture
def clean_hccl_env(monkeypatch):
    for d in hccl.HCCL_DEFAULTS:
        monkeypatch.delenv(d.name, raising=False)


def test_npu_rank_sets_the_unset_hccl_variables_and_logs_their_values(clean_hccl_env, monkeypatch, caplog):
    from tengyun.platforms.npu.platform import NpuPlatform

    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "900")  # the user's value is kept
    with caplog.at_level(logging.INFO, logger="tengyun.platforms.npu.platform"):
        NpuPlatform().init_process()
    assert os.environ["HCCL_CONNECT_TIMEOUT"] == "1200"
    assert os.environ["HCCL_EXEC_TIMEOUT"] == "900"
    assert "HCCL defaults (not set in the environment): HCCL_CONNECT_TIMEOUT=1200;" in caplog.text


def test_nothing_is_set_or_logged_when_the_user_set_them_all(clean_hccl_env, monkeypatch, caplog):
    from tengyun.platforms.npu.platform import NpuPlatform

    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "600")
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "0")
    with caplog.at_level(logging.INFO):
        NpuPlatform().init_process()
    assert (os.environ["HCCL_CONNECT_TIMEOUT"], os.environ["HCCL_EXEC_TIMEOUT"]) == ("600", "0")
    assert "HCCL defaults" not in caplog.text


def test_defaults_lie_inside_cann_documented_ranges():
    assert hccl.missing_defaults({}) == {"HCCL_CONNECT_TIMEOUT": "1200", "HCCL_EXEC_TIMEOUT": "1200"}
    assert all(hccl.value_problem(d.name, d.value) is None for d in hccl.HCCL_DEFAULTS)


@pytest.mark.parametrize("name, value, problem", [
    ("HCCL_CONNECT_TIMEOUT", "60", "HCCL_CONNECT_TIMEOUT=60 is outside CANN's range [120, 7200] s"),
    ("HCCL_CONNECT_TIMEOUT", "7201", "outside CANN's range [120, 7200] s"),
    ("HCCL_EXEC_TIMEOUT", "-1", "HCCL_EXEC_TIMEOUT=-1 is outside CANN's range [0, 2147483647] s"),
    ("HCCL_EXEC_TIMEOUT", "10m", "HCCL_EXEC_TIMEOUT='10m' is not a whole number of seconds"),
    ("HCCL_CONNECT_TIMEOUT", "120", None),
    ("HCCL_EXEC_TIMEOUT", "0", None),
    ("HCCL_BUFFSIZE", "whatever", None),  # not one Tengyun sets
])
def test_value_problem_names_the_variable_and_range(name, value, problem):
    found = hccl.value_problem(name, value)
    assert (found is None) if problem is None else (problem in found)


def test_describe_says_where_each_value_comes_from():
    assert hccl.describe({"HCCL_EXEC_TIMEOUT": "300"}) == [
        ("HCCL_CONNECT_TIMEOUT", "1200", "Tengyun default"), ("HCCL_EXEC_TIMEOUT", "300", "set")]


def test_parse_hccn_ip_reads_address_and_netmask():
    assert parse_hccn_ip((FIXTURES / "hccn_tool_ip.txt").read_text()) == ("192.168.100.101", "255.255.255.0")
    assert parse_hccn_ip("ipaddr:10.30.12.9 netmask:255.255.255.0") == ("10.30.12.9", "255.255.255.0")
    assert parse_hccn_ip("") is None
