"""tengyun.logging_config: which variable decides, in this process (the server tests start real
servers with them: tests/entrypoints/openai/test_logging_env.py)."""

from __future__ import annotations

import logging

import pytest

from tengyun.logging_config import configure_logging


@pytest.fixture(autouse=True)
def restore_logging():
    root, tengyun = logging.getLogger(), logging.getLogger("tengyun")
    handlers, root_level, level = root.handlers[:], root.level, tengyun.level
    yield
    root.handlers[:] = handlers
    root.setLevel(root_level)
    tengyun.setLevel(level)


@pytest.mark.parametrize("environ, level", [
    ({}, logging.NOTSET),  # follows the root logger's INFO
    ({"VLLM_LOGGING_LEVEL": "debug"}, logging.DEBUG),
    ({"TENGYUN_LOGGING_LEVEL": "ERROR", "VLLM_LOGGING_LEVEL": "DEBUG"}, logging.ERROR),
    ({"TENGYUN_LOGGING_LEVEL": "", "VLLM_LOGGING_LEVEL": "warning"}, logging.WARNING),  # empty: unset
])
def test_the_tengyun_loggers_level_comes_from_tengyuns_variable_then_vllms(environ, level):
    configure_logging(environ=environ)
    assert logging.getLogger("tengyun").level == level


def test_configure_logging_0_leaves_logging_alone():
    root = logging.getLogger()
    handlers = root.handlers[:]
    configure_logging(environ={"VLLM_CONFIGURE_LOGGING": "0", "VLLM_LOGGING_LEVEL": "DEBUG"})
    assert root.handlers == handlers and logging.getLogger("tengyun").level != logging.DEBUG


def test_a_bad_value_exits_2_naming_the_variable(capsys):
    with pytest.raises(SystemExit) as exit_info:
        configure_logging(environ={"VLLM_CONFIGURE_LOGGING": "yes"})
    assert exit_info.value.code == 2
    assert "error: VLLM_CONFIGURE_LOGGING='yes': use 1" in capsys.readouterr().err
