"""The fast tier's rule (tests/conftest.py heavy_reason; `make test-fast` runs -m "not heavy"): a test
that loads a real model, starts a process or serves is heavy, whether its body, a fixture or a
helper under tests/ does it; an engine of one rank in this process and plain code stay fast."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import heavy_reason

ROOT = Path(__file__).parent.parent


def _item(function, fixtures=(), params=None, marker=None, nodeid="tests/test_x.py::test_x"):
    """What heavy_reason reads of a collected pytest item."""
    defs = {f.__name__: [SimpleNamespace(func=f)] for f in fixtures}
    return SimpleNamespace(nodeid=nodeid, function=function, _fixtureinfo=SimpleNamespace(name2fixturedefs=defs),
                           callspec=SimpleNamespace(params=params) if params is not None else None,
                           get_closest_marker=lambda name: marker if name == "slow" else None)


def _real_model():
    from tengyun.models.model_source import smollm2_gguf

    return smollm2_gguf()


def _reads_the_real_model():
    return _real_model().stat().st_size


def _starts_a_server():
    return subprocess.Popen([sys.executable, "-m", "tengyun.entrypoints.openai.api_server"])


class _Server:
    def start(self):
        return _starts_a_server()


def _uses_a_server_class():
    return _Server().start()


def _engine(folder, tp):
    from tengyun import LLM

    return LLM(folder, tensor_parallel_size=tp)


def _tp2_engine(folder):
    from tengyun import LLM

    return LLM(folder, tensor_parallel_size=2)


def _tp2_config_only():
    from tengyun.config import EngineConfig

    return EngineConfig(tensor_parallel_size=2).executor_backend


def _one_rank_engine(folder):
    from tengyun import LLM

    return LLM(folder, dtype="float32")


def test_a_test_reaching_the_real_model_is_heavy_through_its_body_a_helper_or_a_fixture():
    assert heavy_reason(_item(_real_model)) == "loads a real model (smollm2_gguf)"
    assert heavy_reason(_item(_reads_the_real_model)) == "loads a real model (smollm2_gguf)"
    assert heavy_reason(_item(_one_rank_engine, fixtures=[_reads_the_real_model])) == \
        "loads a real model (smollm2_gguf)"
    assert heavy_reason(_item(_one_rank_engine, marker=pytest.mark.slow)) == "marked slow (a real model)"


def test_a_test_starting_a_process_is_heavy_through_a_helper_class():
    assert heavy_reason(_item(_starts_a_server)) == "starts a process (Popen)"
    assert heavy_reason(_item(_uses_a_server_class)) == "starts a process (Popen)"


def test_an_engine_of_more_than_one_rank_is_heavy_and_one_rank_or_a_config_alone_is_fast():
    assert heavy_reason(_item(_tp2_engine)) == "starts worker processes (more than one rank)"
    assert heavy_reason(_item(_engine, params={"tp": 2})) == "starts worker processes (more than one rank)"
    assert heavy_reason(_item(_engine, params={"tp": 1})) is None
    assert heavy_reason(_item(_one_rank_engine)) is None
    assert heavy_reason(_item(_tp2_config_only)) is None


def test_the_suite_s_real_model_server_and_multi_rank_tests_are_collected_heavy(tmp_path):
    """Collected in a fresh pytest (a process, so this test is itself heavy): the tests that call the
    real GGUFs without the slow marker, the server tests and the TP/PP parity tests are all marked."""
    files = ["tests/quantization/test_gguf.py", "tests/entrypoints/openai/test_openai_server.py",
             "tests/distributed/test_parallel_parity.py", "tests/layers/test_top_p.py"]
    plugin = tmp_path / "tier_dump.py"
    plugin.write_text("def pytest_collection_finish(session):\n"
                      "    for item in session.items:\n"
                      "        print('TIER', item.nodeid, bool(item.get_closest_marker('heavy')))\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-p", "tier_dump", *files], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    tiers = dict(line.split()[1:] for line in run.stdout.splitlines() if line.startswith("TIER "))
    assert tiers, run.stdout + run.stderr
    real = [n for n in tiers if "test_gguf.py" in n and any(
        k in n for k in ("test_real_blocks_cover", "test_plan_of_the_gguf_kept", "test_a_dense_gguf_is_read"))]
    assert real and all(tiers[n] == "True" for n in real)
    assert all(v == "True" for n, v in tiers.items() if "test_openai_server.py" in n or "test_parallel_parity" in n)
    assert all(v == "False" for n, v in tiers.items() if "test_top_p.py" in n)
