"""`tengyun plan --enable-lora`: the adapter slots counted per card as the worker allocates them."""

from __future__ import annotations

import json
import subprocess
import sys

from tengyun.config import EngineConfig
from tengyun.sizing.plan import Cards, make_plan
from tengyun.sizing.resolve import resolve_sizing
from tengyun.worker.worker import Worker

MIB = 2**20


def test_plan_counts_the_lora_slots_the_worker_allocates(tiny_checkpoints):
    folder = str(tiny_checkpoints["llama"])
    flags = dict(dtype="float32", max_model_len=64, max_num_seqs=4, block_size=16, enable_lora=True, max_loras=3,
                 max_lora_rank=8, lora_dtype="bfloat16")
    config = EngineConfig(folder, kv_cache_memory="1MiB", **flags).finalize()
    worker = Worker(config)
    hf = json.loads((tiny_checkpoints["llama"] / "config.json").read_text())
    device = EngineConfig(folder, gpu_memory_utilization=0.5, **flags)
    plan = make_plan(hf, resolve_sizing(device, config.model_spec, "cuda"), Cards(memory=64 * MIB))
    [stage] = plan.stages
    assert stage.lora_bytes == worker.lora.nbytes() > 0
    assert stage.budget_bytes == 32 * MIB - stage.weight_bytes - stage.lora_bytes - plan.activation_bytes
    without = make_plan(hf, resolve_sizing(EngineConfig(folder, gpu_memory_utilization=0.5, dtype="float32",
                                                        max_model_len=64, max_num_seqs=4, block_size=16),
                                           config.model_spec, "cuda"), Cards(memory=64 * MIB))
    assert without.stages[0].lora_bytes == 0 and without.stages[0].budget_bytes - stage.budget_bytes == stage.lora_bytes

    proc = subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "plan", folder, "--device", "cuda",
                           "--device-memory", "64MiB", "--dtype", "float32", "--max-model-len", "64",
                           "--enable-lora", "--max-loras", "3", "--max-lora-rank", "8", "--lora-dtype", "bfloat16"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "LoRA slots per card: --max-loras 3 x --max-lora-rank 8 in bfloat16 over 2 layers'" in proc.stdout
