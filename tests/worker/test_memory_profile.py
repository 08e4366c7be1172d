"""The profile step (worker/memory_profile.py): its shape, the CPU meter, and the report the worker
keeps (weights, measured activation peak, KV, headroom) with the budget it sizes from."""

from __future__ import annotations

import torch

from tengyun.entrypoints.llm import LLM
from tengyun.platforms.cpu.platform import CpuPlatform
from tengyun.platforms.cpu.runtime.memory_meter import ResidentPeakMeter
from tengyun.worker.memory_profile import CacheLayout, profile_shape, profile_step, run_profile_step

MIB = 2**20


def test_profile_shape_fills_the_token_budget_with_the_most_sampled_rows_and_longest_chunk():
    # 2048 tokens, 256 sequences, 1024-token prompts: 2 chunks would do, but every sequence samples:
    # 254 decodes of one token and 1794 prompt tokens as 1024 + 770.
    shape = profile_shape(2048, 256, 1024)
    assert (shape.decode_seqs, shape.prefill_lens, shape.tokens, shape.seqs) == (254, (1024, 770), 2048, 256)
    # Fewer tokens than sequences: one token of prompt, the rest decodes.
    assert profile_shape(8, 256, 64) == type(shape)(7, (1,))
    # Sequences too few for the budget: whole prompts only, the budget not reached.
    one = profile_shape(4096, 2, 1024)
    assert (one.decode_seqs, one.prefill_lens) == (0, (1024, 1024))
    assert one.blocks(16) == 128 and profile_shape(8, 256, 64).blocks(16) == 8


def test_profile_step_schedules_that_shape_on_distinct_blocks_and_slots():
    sched = profile_step(profile_shape(40, 4, 32), block_size=16, vocab_size=384, hybrid=True)
    assert sum(sched.num_scheduled_tokens.values()) == 40
    assert [s.state_slot for s in sched.new_seqs] == [0, 1, 2, 3]
    blocks = [b for s in sched.new_seqs for b in s.block_table]
    assert sorted(blocks) == list(range(len(blocks)))
    decodes = [s for s in sched.new_seqs if sched.num_scheduled_tokens[s.seq_id] == 1]
    assert len(decodes) == 2 and all(s.num_computed_tokens == 1 for s in decodes)  # and prompts of 32 + 6


def test_resident_peak_meter_sees_a_buffer_the_step_allocates_and_frees():
    meter = ResidentPeakMeter()
    meter.start()
    buffer = torch.ones(64 * MIB // 4)  # 64 MiB, every page touched
    del buffer
    peak = meter.peak()
    # the buffer's pages, give or take what the rest of the process released meanwhile
    assert peak is not None and 60 * MIB <= peak < 96 * MIB
    meter.start()  # the next step starts from the level now, not from the earlier peak
    assert meter.peak() < 16 * MIB


def test_worker_reports_weights_measured_activations_kv_and_headroom(tiny_checkpoints):
    folder = str(tiny_checkpoints["llama"])
    small = LLM(folder, dtype="float32", kv_cache_memory="1MiB", max_model_len=64, max_num_seqs=4,
                max_num_batched_tokens=64).llm_engine.executor
    report = small.memory_report
    assert report.weights == small.weight_bytes
    assert report.kv_cache == small.kv_cache.numel() * 4 and report.state_cache == 0
    assert report.profile_tokens == 64 and report.profile_seqs == 4
    assert report.activation_peak is not None and report.activation_peak > 0
    assert report.activation_used == report.activation_peak
    assert report.headroom < report.memory_total
    # 16 sequences of 256 tokens: the step's logits, MLP and attention buffers grow with it.
    big = LLM(folder, dtype="float32", kv_cache_memory="1MiB", max_num_seqs=16,
              max_num_batched_tokens=4096).llm_engine.executor.memory_report
    assert big.profile_tokens == 4096 and big.activation_peak > report.activation_peak


def test_device_budget_leaves_room_for_the_measured_peak(tiny_checkpoints, monkeypatch):
    """Where the KV cache takes a fraction of device memory, the budget subtracts the step's measured
    peak; where the platform cannot measure it, the estimate `tengyun plan` uses."""
    folder = str(tiny_checkpoints["llama"])
    args = dict(dtype="float32", block_size=8, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64)
    monkeypatch.setattr(CpuPlatform, "kv_cache_in_host_memory", False)
    monkeypatch.setattr(CpuPlatform, "memory_info", lambda self: (58 * MIB, 64 * MIB))
    worker = LLM(folder, gpu_memory_utilization=0.5, **args).llm_engine.executor
    per_block = worker.kv_shape.bytes_per_block(8)
    report = worker.memory_report
    assert report.activation_used == report.activation_peak
    assert worker.num_blocks == (32 * MIB - 6 * MIB - report.activation_peak) // per_block

    class CannotMeasure(ResidentPeakMeter):
        def start(self) -> None:
            self.base = None  # as where /proc/self/clear_refs is refused

    monkeypatch.setattr(CpuPlatform, "memory_meter", lambda self: CannotMeasure())
    worker = LLM(folder, gpu_memory_utilization=0.5, **args).llm_engine.executor
    report = worker.memory_report
    assert report.activation_peak is None and report.activation_used == report.activation_estimate
    assert worker.num_blocks == (32 * MIB - 6 * MIB - report.activation_estimate) // per_block


def test_the_profile_step_leaves_the_random_generator_as_it_was(tiny_checkpoints):
    """It samples at temperature 1; a seeded run must draw afterwards as it would without it."""
    worker = LLM(str(tiny_checkpoints["llama"]), dtype="float32", kv_cache_memory="1MiB", max_model_len=64,
                 max_num_seqs=4).llm_engine.executor
    config = worker.config
    layout = CacheLayout(worker.kv_shape, worker.state_shape, config.block_size, torch.float32, torch.float32)
    before = torch.get_rng_state()
    result = run_profile_step(worker.model, worker.kernels, worker.platform, worker.device, layout, config.sizing,
                              config.model_spec.vocab_size, config.model_spec.hidden_size)
    assert result.shape.seqs == 4 and torch.equal(torch.get_rng_state(), before)
