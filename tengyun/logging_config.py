"""How a Tengyun process sets up Python logging, from the environment, with vLLM's variables:

- ``TENGYUN_LOGGING_LEVEL``, else ``VLLM_LOGGING_LEVEL`` (default INFO): the level of the
  ``tengyun`` logger, so DEBUG shows Tengyun's own debug lines (why each kernel was chosen, the
  thread tuner's timings) without every library's;
- ``TENGYUN_LOGGING_CONFIG_PATH``, else ``VLLM_LOGGING_CONFIG_PATH``: a JSON file for
  ``logging.config.dictConfig``, used instead of the default set-up (handlers, formats, levels:
  all of it is the file's; the level variable is then not applied);
- ``TENGYUN_CONFIGURE_LOGGING``, else ``VLLM_CONFIGURE_LOGGING`` (default 1): 0 leaves logging
  as the host application configured it.

Every entry point calls ``configure_logging`` first; processes started from it inherit the
environment and call it too (a rank worker, with its rank in the format). A value that cannot be
used exits 2 naming the variable and what it accepts.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
import sys
from collections.abc import Mapping

DEFAULT_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def configure_logging(fmt: str = DEFAULT_FORMAT, force: bool = False, environ: Mapping[str, str] | None = None) -> None:
    """Logging as the environment says (module docstring); ``fmt`` and ``force`` are the default
    set-up's (``logging.basicConfig``'s). Exits 2 on a value it cannot use."""
    try:
        _configure(fmt, force, os.environ if environ is None else environ)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _configure(fmt: str, force: bool, environ: Mapping[str, str]) -> None:
    configure_name, configure = _setting(environ, "CONFIGURE_LOGGING", "1")
    if configure not in ("0", "1"):
        raise ValueError(f"{configure_name}={configure!r}: use 1 (Tengyun sets up logging) or 0 (leave it as it is)")
    path_name, path = _setting(environ, "LOGGING_CONFIG_PATH", "")
    if configure == "0":
        if path:
            raise ValueError(f"{path_name} is set but {configure_name}=0 turns logging set-up off: unset one")
        return
    if path:
        config = _dict_config(path_name, path)
        try:
            logging.config.dictConfig(config)
        except (ValueError, TypeError, AttributeError, ImportError) as e:
            raise ValueError(f"{path_name}={path!r}: logging.config.dictConfig refused it: {e}") from e
        return
    level_name, level = _setting(environ, "LOGGING_LEVEL", "")
    if level and level.upper() not in LEVELS:
        raise ValueError(f"{level_name}={level!r} is not a logging level: use one of {', '.join(LEVELS)}")
    logging.basicConfig(level=logging.INFO, format=fmt, force=force)  # other libraries: INFO, as before
    if level:  # unset: the tengyun logger follows the root's INFO (and a test's caplog.set_level)
        logging.getLogger("tengyun").setLevel(level.upper())


def _setting(environ: Mapping[str, str], suffix: str, default: str) -> tuple[str, str]:
    """(the variable that decided, its value): TENGYUN_<suffix>, else VLLM_<suffix>, else default."""
    for name in (f"TENGYUN_{suffix}", f"VLLM_{suffix}"):
        if environ.get(name, "") != "":
            return name, environ[name].strip()
    return f"TENGYUN_{suffix}", default


def _dict_config(name: str, path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as e:
        raise ValueError(f"{name}={path!r} cannot be read: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}={path!r} is not JSON ({e}); it takes a logging.config.dictConfig "
                         f"dictionary as JSON") from e
    if not isinstance(config, dict):
        raise ValueError(f"{name}={path!r} holds a JSON {type(config).__name__}; it takes a "
                         f"logging.config.dictConfig dictionary (with \"version\": 1)")
    return config
