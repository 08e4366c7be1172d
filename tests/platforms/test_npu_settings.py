"""--device npu refuses, before any model work, the settings torch_npu's ops do not take (docs/ascend.md):
a --block-size off 128-512 in multiples of 128, a float32 --dtype or --kv-cache-dtype. `tengyun plan`,
`LLM` and `tengyun serve` ask the same check (sizing/resolve.py, Platform.settings_problem)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tengyun.platforms.npu.platform import NpuPlatform

FIXTURES = Path(__file__).parents[1] / "fixtures" / "ops"
REFUSALS = [
    (["--block-size", "16"], "--block-size 16: torch_npu's paged attention takes blocks of 128-512 tokens in "
                             "multiples of 128 for a prompt's tokens: use --block-size 128 (the NPU default)"),
    (["--dtype", "float32"], "--dtype float32: torch_npu's attention, KV-cache write and W8A8 ops take float16 or "
                             "bfloat16 only: use --dtype bfloat16"),
    (["--kv-cache-dtype", "float32"], "--kv-cache-dtype float32: torch_npu's attention, KV-cache write and W8A8 ops "
                                      "take float16 or bfloat16 only: use --kv-cache-dtype bfloat16"),
]


@pytest.fixture
def npu_here(monkeypatch):
    """The NPU platform reports itself usable (its device checks pass) without touching torch_npu."""
    monkeypatch.setattr(NpuPlatform, "runtime_problem", classmethod(lambda cls, timeout_s: None))
    monkeypatch.setattr(NpuPlatform, "is_available", classmethod(lambda cls: True))
    monkeypatch.setattr(NpuPlatform, "check_available", lambda self: None)
    monkeypatch.setattr(NpuPlatform, "check_versions", classmethod(lambda cls: None))


@pytest.mark.parametrize("flags, message", REFUSALS, ids=["block-size", "dtype", "kv-cache-dtype"])
def test_plan_for_npu_exits_2_naming_the_flag_and_the_value_to_use(flags, message):
    proc = subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "plan",
                           str(FIXTURES / "qwen3_0_6b"), "--device", "npu", *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "plan", str(FIXTURES / "qwen3_0_6b"),
                           "--device", "cpu", "--kv-cache-memory", "4GiB", "--max-model-len", "4096", *flags],
                          capture_output=True, text=True, timeout=120).returncode == 0  # CPU takes them


@pytest.mark.parametrize("flags, message", REFUSALS, ids=["block-size", "dtype", "kv-cache-dtype"])
def test_llm_on_npu_refuses_before_loading(tiny_checkpoints, npu_here, flags, message):
    from tengyun import LLM

    kwargs = {flags[0].removeprefix("--").replace("-", "_"): int(flags[1]) if flags[1].isdigit() else flags[1]}
    with pytest.raises(ValueError) as refused:
        LLM(str(tiny_checkpoints["qwen3"]), device="npu", **kwargs)
    assert str(refused.value) == message


def test_serve_on_npu_exits_2_before_binding_a_port(tiny_checkpoints, npu_here, capsys):
    from tengyun.entrypoints.openai.api_server import main

    assert main([str(tiny_checkpoints["qwen3"]), "--device", "npu", "--block-size", "16", "--port", "1"]) == 2
    assert REFUSALS[0][1] in capsys.readouterr().err


def test_npu_defaults_pass_the_check(tiny_checkpoints, npu_here):
    from tengyun.config import EngineConfig

    config = EngineConfig(str(tiny_checkpoints["qwen3"]), device="npu").finalize()
    assert (config.block_size, config.dtype, config.kv_cache_dtype) == (128, "bfloat16", "bfloat16")
