"""vLLM's logging variables on a real server: VLLM_LOGGING_LEVEL / TENGYUN_LOGGING_LEVEL (the
`tengyun` logger's level), VLLM_LOGGING_CONFIG_PATH (a dictConfig JSON file), and a value that
cannot be used (exit 2 naming the variable)."""

from __future__ import annotations

import json
import re

from remote_server import server_model, start_server  # noqa: F401 (fixtures)

LINE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+ \S+ (\S+): ", re.M)


def levels_by_logger(log: str) -> dict[str, set[str]]:
    """{level: the logger names that wrote a line at it} from a log in the default format."""
    found: dict[str, set[str]] = {}
    for level, name in LINE.findall(log):
        found.setdefault(level, set()).add(name)
    return found


def test_vllm_logging_level_debug_shows_tengyuns_debug_lines_only(start_server):  # noqa: F811
    debug = start_server(env={"VLLM_LOGGING_LEVEL": "debug"}).wait_ready()
    plain = start_server().wait_ready()
    debug_lines = levels_by_logger(debug.log()).get("DEBUG", set())
    assert debug_lines and all(name.startswith("tengyun.") for name in debug_lines), debug_lines
    assert "DEBUG" not in levels_by_logger(plain.log())
    assert "tengyun.server" in levels_by_logger(debug.log())["INFO"]  # INFO lines stay


def test_tengyun_logging_level_wins_over_vllms(start_server):  # noqa: F811
    server = start_server(env={"TENGYUN_LOGGING_LEVEL": "WARNING", "VLLM_LOGGING_LEVEL": "DEBUG"}).wait_ready()
    found = levels_by_logger(server.log())
    assert not any(name.startswith("tengyun.") for name in found.get("DEBUG", set()) | found.get("INFO", set()))


def test_a_logging_config_file_takes_over(start_server, tmp_path):  # noqa: F811
    log_file = tmp_path / "tengyun.log"
    config = {"version": 1, "disable_existing_loggers": False,
              "formatters": {"plain": {"format": "[%(name)s] %(message)s"}},
              "handlers": {"file": {"class": "logging.FileHandler", "filename": str(log_file), "formatter": "plain"}},
              "loggers": {"tengyun": {"handlers": ["file"], "level": "INFO", "propagate": False}}}
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(config))
    server = start_server(env={"VLLM_LOGGING_CONFIG_PATH": str(path)}).wait_ready()
    assert re.search(r"^\[tengyun\.server\] Ready in [0-9.]+ s", log_file.read_text(), re.M)
    assert "tengyun.server: Ready in" not in server.log()  # the file's handler, not the default one


def test_values_that_cannot_be_used_exit_2_naming_the_variable(start_server, tmp_path):  # noqa: F811
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "refused.json").write_text(json.dumps({"version": 1, "handlers": {"h": {"class": "no.such.Handler"}}}))
    cases = [({"TENGYUN_LOGGING_LEVEL": "verbose"}, "TENGYUN_LOGGING_LEVEL='verbose' is not a logging level: use "
                                                    "one of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
             ({"VLLM_LOGGING_CONFIG_PATH": str(tmp_path / "missing.json")}, "VLLM_LOGGING_CONFIG_PATH="),
             ({"VLLM_LOGGING_CONFIG_PATH": str(tmp_path / "list.json")}, "holds a JSON list"),
             ({"TENGYUN_LOGGING_CONFIG_PATH": str(tmp_path / "refused.json")}, "logging.config.dictConfig refused it"),
             ({"VLLM_CONFIGURE_LOGGING": "0", "VLLM_LOGGING_CONFIG_PATH": str(tmp_path / "list.json")},
              "VLLM_LOGGING_CONFIG_PATH is set but VLLM_CONFIGURE_LOGGING=0")]
    servers = [(start_server(env=env), words) for env, words in cases]
    for server, words in servers:
        assert server.wait_exit() == 2, server.log()
        assert re.search(r"^error: .*" + re.escape(words), server.log(), re.M), server.log()
        assert "Traceback" not in server.log()
