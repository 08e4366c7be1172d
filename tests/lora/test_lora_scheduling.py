"""The engine's side of LoRA, torch-free: a step runs at most --max-loras adapters (the others
wait, base-model sequences pass them), and the prefix cache never shares blocks across adapters."""

from __future__ import annotations

from types import SimpleNamespace

from tengyun.engine.block_manager import BlockManager
from tengyun.engine.scheduler import Scheduler
from tengyun.engine.sequence import Sequence
from tengyun.lora.request import LoRARequest
from tengyun.sampling_params import SamplingParams

CONFIG = SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True, block_size=4,
                         enable_prefix_caching=True, enable_lora=True, max_loras=2)
LORAS = {i: LoRARequest(f"a{i}", i, f"/adapters/a{i}") for i in (1, 2, 3)}


def _seq(seq_id: int, lora_id: int | None, tokens=(1, 2, 3, 4, 5, 6, 7, 8, 9)) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), SamplingParams(), arrival_order=seq_id,
                    lora_request=LORAS.get(lora_id))


def test_a_step_runs_at_most_max_loras_adapters_and_base_sequences_pass_the_waiting_ones():
    scheduler = Scheduler(CONFIG, num_blocks=64)
    for seq in (_seq(0, 1), _seq(1, 2), _seq(2, 3), _seq(3, None), _seq(4, 1)):
        scheduler.add(seq)
    out = scheduler.schedule()
    assert [new.seq_id for new in out.new_seqs] == [0, 1, 3, 4]  # adapter 3 waits; the base one passes it
    assert {new.lora_request.lora_int_id for new in out.new_seqs if new.lora_request} == {1, 2}
    assert [seq.seq_id for seq in scheduler.waiting] == [2]
    scheduler.advance(out, {s.seq_id: s for s in scheduler.running})
    for seq in list(scheduler.running):
        if seq.lora_request is not None and seq.lora_request.lora_int_id == 2:
            scheduler.finish(seq)
    out = scheduler.schedule()  # adapter 2 is gone: adapter 3 takes its place
    assert [new.seq_id for new in out.new_seqs] == [2]


def test_running_sequences_on_a_third_adapter_wait_a_step():
    scheduler = Scheduler(SimpleNamespace(**{**vars(CONFIG), "max_loras": 1}), num_blocks=64)
    a, b = _seq(0, 1), _seq(1, 2)
    scheduler.add(a)
    scheduler.advance(scheduler.schedule(), {0: a})
    scheduler.add(b)  # b cannot start while a runs (one slot)
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == [0] and list(scheduler.waiting) == [b]


def test_the_prefix_cache_never_shares_blocks_across_adapters():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = _seq(0, 1)
    manager.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    assert manager.find_cached_blocks(_seq(1, 1)) == first.block_table[:2]  # same adapter: a hit
    assert manager.find_cached_blocks(_seq(2, 2)) == []  # another adapter
    assert manager.find_cached_blocks(_seq(3, None)) == []  # the base model
