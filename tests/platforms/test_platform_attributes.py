"""What used to be device-name branches outside platforms/, now Platform attributes: where the
KV cache's size comes from (worker, metrics), whether ranks split the host's cores (executor),
and how `tengyun launch` lists devices (smi tools, on recorded outputs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tengyun import LLM
from tengyun.config import EngineConfig
from tengyun.entrypoints.cli.launch import device_ids
from tengyun.entrypoints.openai.metrics import cache_config_labels
from tengyun.executor.multiproc_executor import _threads_per_rank
from tengyun.host import probe
from tengyun.platforms.cpu.platform import CpuPlatform
from tengyun.platforms.cuda.platform import CudaPlatform
from tengyun.platforms.npu.platform import NpuPlatform

FIXTURES = Path(__file__).parents[1] / "fixtures" / "ops"
MIB = 1 << 20


def test_only_the_cpu_keeps_its_kv_cache_in_host_memory_on_host_cores():
    assert CpuPlatform.kv_cache_in_host_memory and CpuPlatform.ranks_share_host_cores
    for device in (CudaPlatform, NpuPlatform):
        assert not device.kv_cache_in_host_memory and not device.ranks_share_host_cores


def test_kv_cache_takes_a_fraction_of_device_memory_where_it_is_not_in_host_memory(tiny_checkpoints, monkeypatch):
    folder = str(tiny_checkpoints["llama"])
    args = dict(block_size=8, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64)
    monkeypatch.setattr(CpuPlatform, "kv_cache_in_host_memory", False)
    # 64 MiB device, 6 MiB in use: 0.5 x 64 - 6 = 26 MiB less the profile step's peak for the KV
    # cache; --kv-cache-memory is ignored.
    monkeypatch.setattr(CpuPlatform, "memory_info", lambda self: (58 * MIB, 64 * MIB))
    device = LLM(folder, dtype="float32", kv_cache_memory="1MiB", gpu_memory_utilization=0.5,
                 **args).llm_engine.executor
    activation = device.memory_report.activation_used
    with monkeypatch.context() as host:
        host.setattr(CpuPlatform, "kv_cache_in_host_memory", True)
        expected = LLM(folder, dtype="float32", kv_cache_memory=26 * MIB - activation, **args).llm_engine.executor
    assert device.num_blocks == expected.num_blocks
    with pytest.raises(ValueError, match="raise --gpu-memory-utilization"):
        LLM(folder, dtype="float32", gpu_memory_utilization=0.05, **args)  # 3.2 MiB is less than the 6 MiB in use


def test_metrics_report_cpu_kv_space_only_where_the_kv_cache_is_in_host_memory(tiny_checkpoints, monkeypatch):
    config = EngineConfig(model=str(tiny_checkpoints["llama"]), kv_cache_memory="1MiB").finalize()
    assert cache_config_labels(config, 7)["cpu_kvcache_space_bytes"] == str(MIB)
    monkeypatch.setattr(CpuPlatform, "kv_cache_in_host_memory", False)
    assert cache_config_labels(config, 7)["cpu_kvcache_space_bytes"] == "None"


def test_ranks_split_the_host_cores_only_where_they_compute_on_them(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert _threads_per_rank(CpuPlatform, 2) == max(1, (os.cpu_count() or 1) // 2)
    assert _threads_per_rank(CudaPlatform, 2) == 0 and _threads_per_rank(NpuPlatform, 2) == 0
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _threads_per_rank(CpuPlatform, 2) == 0


def test_launch_lists_devices_through_the_platforms_smi_tool(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(probe, "nvidia_smi_memory", lambda: probe.CommandOutput(0, "1, 10, 80\n0, 5, 80\n", ""))
    npu_smi = (FIXTURES / "npu_smi_info_910b3_x8.txt").read_text()
    monkeypatch.setattr(probe, "npu_smi_info", lambda: probe.CommandOutput(0, npu_smi, ""))
    assert device_ids(CudaPlatform(), None) == [0, 1]
    assert device_ids(NpuPlatform(), None) == list(range(8))
    assert CpuPlatform().smi_device_ids() == []
    assert device_ids(NpuPlatform(), "4,5") == [4, 5]
    monkeypatch.setattr(probe, "npu_smi_info", lambda: probe.CommandOutput(127, "", "npu-smi: not found"))
    assert device_ids(NpuPlatform(), None) == []


def test_torch_cuda_version_is_read_from_torch_without_importing_it():
    """What platform selection asks in the API process (CudaPlatform.runtime_installed)."""
    import subprocess
    import sys

    code = ("import sys; from tengyun.platforms.cuda.platform import torch_cuda_version; found = torch_cuda_version(); "
            "imported = 'torch' in sys.modules; import torch; print(found == torch.version.cuda, imported)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "False"]
