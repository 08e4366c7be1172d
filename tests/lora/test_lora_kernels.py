"""LoRA's batched products: every form (masked_dense, grouped, gathered) equals each token's own
B A x, base-model tokens get nothing; the CPU's choice in the kernel table; the slots' LRU."""

from __future__ import annotations

import pytest
import torch

from tengyun.layers.lora.batch import LoRABatch
from tengyun.layers.lora.kernels import TORCH_LORA_KERNELS
from tengyun.lora.slots import AdapterSlots, HostCache
from tengyun.platforms.cpu.platform import CpuPlatform
from tengyun.platforms.kernel_choice import KernelQuery


@pytest.mark.parametrize("name", list(TORCH_LORA_KERNELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_form_adds_every_tokens_own_adapter_product(name, dtype):
    torch.manual_seed(0)
    slots, rows, in_, out = 3, 8, 24, 40
    a, b = torch.randn(slots, rows, in_, dtype=dtype), torch.randn(slots, rows, out, dtype=dtype)
    token_slots = torch.tensor([2, -1, 0, 0, 2, -1, 1])
    x = torch.randn(len(token_slots), in_, dtype=dtype)
    delta = TORCH_LORA_KERNELS[name]().apply(x, a, b, LoRABatch.build(token_slots, slots))
    for t, slot in enumerate(token_slots.tolist()):
        want = torch.zeros(out) if slot < 0 else (x[t].float() @ a[slot].float().t()) @ b[slot].float()
        torch.testing.assert_close(delta[t].float(), want, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=0.3 if dtype == torch.bfloat16 else 1e-4)


def test_lora_is_a_kernel_kind_and_the_cpu_picks_grouped():
    choice = CpuPlatform.choose_kernel("lora", KernelQuery("float32"))
    assert choice.name == "cpu_grouped"
    assert [c.name for c in CpuPlatform.kernel_candidates("lora")] == ["cpu_grouped", "masked_dense"]


def test_slots_evict_the_least_recently_used_adapter_a_step_does_not_need():
    slots = AdapterSlots(2)
    assert slots.assign({7, 9}) == [(7, 0), (9, 1)]
    assert slots.assign({9}) == []
    assert slots.assign({9, 4}) == [(4, 0)]  # 7 was used least recently
    with pytest.raises(ValueError, match="--max-loras is 2"):
        slots.assign({1, 2, 3})


def test_the_host_cache_keeps_max_cpu_loras_adapters():
    cache, made = HostCache(2), []
    for key in (1, 2, 1, 3, 2):
        cache.get(key, lambda key=key: made.append(key) or key)
    assert made == [1, 2, 3, 2]  # 3 pushed out 2 (1 had been used since), then 2 pushed out 1
    assert 1 not in cache and 3 in cache and 2 in cache and len(cache) == 2


def test_slot_bytes_without_torch_are_what_the_manager_allocates(tiny_checkpoints):
    from conftest import read_config
    from tengyun.layers.lora.kernels import GroupedLoRA
    from tengyun.layers.lora.manager import LoRAManager
    from tengyun.lora.sizing import lora_slot_bytes
    from tengyun.model_spec import ModelSpec
    from tengyun.models.registry import get_model_class

    spec = ModelSpec.from_hf_config(read_config(tiny_checkpoints["qwen3"]))
    model = get_model_class(spec.architecture)(spec, 64, torch.float32)
    manager = LoRAManager(model, spec, 3, 8, 3, torch.bfloat16, torch.device("cpu"), GroupedLoRA())
    assert manager.nbytes() == lora_slot_bytes(spec, 1, spec.num_layers, 3, 8, 2) > 0


def test_grouped_takes_the_whole_batch_at_once_when_one_adapter_runs_every_token():
    torch.manual_seed(0)
    a, b, x = torch.randn(2, 4, 8), torch.randn(2, 4, 6), torch.randn(5, 8)
    delta = TORCH_LORA_KERNELS["grouped"]().apply(x, a, b, LoRABatch.build(torch.ones(5, dtype=torch.long), 2))
    torch.testing.assert_close(delta, (x @ a[1].t()) @ b[1])
