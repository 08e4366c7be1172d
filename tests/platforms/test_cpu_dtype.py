"""--dtype auto on CPU: bfloat16 where the cores multiply bf16 natively, whatever the checkpoint's
dtype (float32 checkpoints downcast, as vLLM's CPU build does), float32 otherwise; the engine and
`tengyun plan` give the same answer."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from tengyun.config import EngineConfig
from tengyun.model_spec import ModelSpec
from tengyun.sizing.checkpoint import read_model
from tengyun.sizing.plan import make_plan
from tengyun.sizing.resolve import resolve_sizing
from tengyun.host.probe import cpu_flags
from tengyun.platforms.cpu import platform as cpu
from tengyun.platforms.cpu.platform import CpuPlatform


def test_cpu_flags_reads_the_first_processor(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n\nprocessor\t: 1\nflags\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "avx512f", "avx512_bf16", "amx_tile"}
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


@pytest.mark.parametrize("flags,checkpoint,expected", [
    ({"avx512_bf16"}, "bfloat16", "bfloat16"),
    ({"amx_bf16"}, "float16", "bfloat16"),  # float16 compute is slow without AVX512-FP16: bf16
    ({"avx512_bf16"}, "float32", "bfloat16"),  # downcast, as vLLM's CPU build
    ({"avx512_bf16"}, None, "bfloat16"),  # unlabeled
    ({"avx512f", "avx2"}, "bfloat16", "float32"),  # bf16 would be emulated
    ({"avx512f", "avx2"}, "float32", "float32"),
])
def test_auto_dtype_follows_the_cpu_and_the_checkpoint(monkeypatch, flags, checkpoint, expected):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(flags))
    assert CpuPlatform.auto_dtype(checkpoint) == expected


@pytest.mark.parametrize("checkpoint", ["bfloat16", "float32"])
@pytest.mark.parametrize("native", [True, False])
def test_engine_and_plan_resolve_a_checkpoint_alike(tiny_checkpoints, tmp_path, monkeypatch, caplog, native,
                                                    checkpoint):
    folder = shutil.copytree(tiny_checkpoints["llama"], tmp_path / checkpoint)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dtype"] = checkpoint
    (folder / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512_bf16"} if native else {"avx2"}))
    with caplog.at_level(logging.INFO, logger="tengyun.config"):
        config = EngineConfig(str(folder), device="cpu").finalize()
    expected = "bfloat16" if native else "float32"
    assert config.dtype == config.kv_cache_dtype == expected
    assert f"--dtype auto: {expected} on cpu for a checkpoint config.json calls {checkpoint}" in caplog.text
    hf_config, checkpoint_bytes, name = read_model(folder)
    sizing = resolve_sizing(EngineConfig(kv_cache_memory=2**20), ModelSpec.from_hf_config(hf_config), "cpu")
    assert make_plan(hf_config, sizing, None, checkpoint_bytes).dtype == expected
    assert EngineConfig(str(folder), device="cpu", dtype="float32").finalize().dtype == "float32"
