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


def _block_diagonal_b(slots: int, rank: int, columns: list[tuple[int, int]], dtype) -> torch.Tensor:
    """b [slots, slices x rank, out]: slice s's rows hold only its columns, as layer.py stores a fused layer."""
    b = torch.zeros(slots, len(columns) * rank, columns[-1][1], dtype=dtype)
    for s, (start, end) in enumerate(columns):
        b[:, s * rank:(s + 1) * rank, start:end] = torch.randn(slots, rank, end - start, dtype=dtype)
    return b


@pytest.mark.parametrize("name", list(TORCH_LORA_KERNELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("token_slots", [[2, -1, 0, 0, 2, -1, 1], [0, 0, 1, 1, 1, 2, -1], [1, 1, 1, -1, -1],
                                         [-1, 2, 2, 2, 0, 1, 1, 1, 1, 2]],
                         ids=["mixed", "sorted_then_base", "one_adapter_then_base", "segments_among_others"])
@pytest.mark.parametrize("columns", [None, [(0, 24), (24, 32), (32, 40)]], ids=["one_slice", "three_slices"])
def test_each_form_adds_every_tokens_own_adapter_product_into_the_base_output(name, dtype, token_slots, columns):
    torch.manual_seed(0)
    slots, rank, in_, out = 3, 4, 24, 40
    a = torch.randn(slots, rank * len(columns or [0]), in_, dtype=dtype)
    b = _block_diagonal_b(slots, rank, columns or [(0, out)], dtype)
    token_slots = torch.tensor(token_slots)
    x, y = torch.randn(len(token_slots), in_, dtype=dtype), torch.randn(len(token_slots), out, dtype=dtype)
    base = y.clone()
    batch = LoRABatch.build(token_slots, slots, min_segment_rows=3)  # runs of 3+ rows are segments
    got = TORCH_LORA_KERNELS[name]().add(x, y, a, b, batch, columns)
    assert got.data_ptr() == y.data_ptr()  # written into the base output, no new [T, out] tensor
    for t, slot in enumerate(token_slots.tolist()):
        want = base[t].float() + (0 if slot < 0 else (x[t].float() @ a[slot].float().t()) @ b[slot].float())
        torch.testing.assert_close(got[t].float(), want, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=0.3 if dtype == torch.bfloat16 else 1e-4)


def _reference(x, base, a, b, token_slots) -> torch.Tensor:
    """y + each adapter token's own (x A^T) B in float32, row by row; base-model rows (-1) untouched."""
    want = base.float().clone()
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            want[t] += (x[t].float() @ a[slot].float().t()) @ b[slot].float()
    return want


@pytest.mark.parametrize(("token_slots", "layout"), [
    ([-1, 1, -1], "no_pad"),  # one token on one slot between base-model tokens: rows [1]
    ([0, 1], "in_place"),  # already in slot order from row 0, no pad: added to y[:2] without index_add_
    ([1, 0, 1, 0], "no_pad"),  # equal counts: gathered [1, 3 | 0, 2], nothing zeroed
    ([-1, 2, 0, 2, 0, 2], "pads"),  # slot 0: 2, slot 1: none (all pads), slot 2: 3 -> 3 slots x 3 rows
    ([-1, 3, 0], "pads"),  # a token on slot 0, one on slot 3: slots 1 and 2 empty, 4 x 1 rows for 2
    ([0, 3, 3, 3, 3, 3, 3], "not_padded"),  # 4 slots x 6 rows for 7: more than double, grouped instead
], ids=["one_token", "in_place", "equal_counts", "pads_and_an_empty_slot", "empty_slots_between",
        "too_skewed_to_pad"])
@pytest.mark.parametrize("columns", [[(0, 40)], [(0, 24), (24, 32), (32, 40)], [(0, 4), (4, 6)]],
                         ids=["one_slice", "three_slices", "odd_width"])
def test_the_padded_form_adds_each_tokens_product_whatever_the_padding(token_slots, layout, columns):
    torch.manual_seed(0)
    slots, rank, in_, out = 4, 4, 24, columns[-1][1]
    a, b = torch.randn(slots, rank * len(columns), in_), _block_diagonal_b(slots, rank, columns, torch.float32)
    x, y = torch.randn(len(token_slots), in_), torch.randn(len(token_slots), out)
    if token_slots[0] < 0:
        x[0] = float("inf")  # a base-model row; pads read row 0, and still add nothing
    base = y.clone()
    batch = LoRABatch.build(torch.tensor(token_slots), slots)
    padded = batch.padded
    assert layout == ("not_padded" if padded is None else "in_place" if padded.rows is None
                      else "no_pad" if padded.pads is None else "pads")
    got = TORCH_LORA_KERNELS["padded"]().add(x, y, a, b, batch, columns if len(columns) > 1 else None)
    assert got.data_ptr() == y.data_ptr()
    torch.testing.assert_close(got, _reference(x, base, a, b, token_slots), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_dtype_apart_from_the_model_and_odd_widths_add_the_same_product(dtype):
    """--lora-dtype float32 under a bfloat16 model: the product is added in the slots' dtype; an
    output 6 wide (24 bytes, not what torch._grouped_mm takes) runs the loop per slot."""
    from tengyun.layers.lora.batch import lora_batch
    from tengyun.layers.lora.layer import LinearLoRA

    torch.manual_seed(0)
    lora = LinearLoRA(8, 6, [(0, 4), (4, 6)], 2, 2, torch.float32, torch.device("cpu"),
                      TORCH_LORA_KERNELS["segmented"]())
    lora.a.normal_()
    lora.b.copy_(_block_diagonal_b(2, 2, lora.columns, torch.float32))
    x, y = torch.randn(3, 8, dtype=dtype), torch.randn(3, 6, dtype=dtype)
    with lora_batch(LoRABatch.build(torch.tensor([1, -1, 0]), 2)):
        got = lora.add(x, y.clone())
    want = y.float()
    for t, slot in ((0, 1), (2, 0)):
        want[t] += (x[t].float() @ lora.a[slot].t()) @ lora.b[slot]
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=0.1 if dtype == torch.bfloat16 else 1e-5)


def test_the_batch_keeps_long_runs_as_segments_and_sorts_the_rest_by_slot_on_the_host():
    batch = LoRABatch.build(torch.tensor([1, 1, -1, 0, 0, 0]), 2)  # no run reaches MIN_SEGMENT_ROWS
    assert batch.segments == [] and batch.order.tolist() == [3, 4, 5, 0, 1]
    assert batch.offsets.tolist() == [3, 5] and batch.offsets.dtype == torch.int32
    assert batch.runs == [(0, 0, 3), (1, 3, 2)]
    assert [(slot, rows.tolist()) for slot, rows in batch.groups] == [(0, [3, 4, 5]), (1, [0, 1])]
    in_order = LoRABatch.build(torch.tensor([0, 0, 2, -1]), 3)
    assert in_order.order is None and in_order.runs == [(0, 0, 2), (2, 2, 1)]
    assert in_order.offsets.tolist() == [2, 2, 3]
    mixed = LoRABatch.build(torch.tensor([1, 0, 0, 0, -1, 1, 1]), 2, min_segment_rows=3)
    assert mixed.segments == [(0, 1, 3)]  # (slot, first row, rows)
    assert mixed.order.tolist() == [0, 5, 6] and mixed.runs == [(1, 0, 3)] and mixed.offsets.tolist() == [0, 3]
    padded = LoRABatch.build(torch.tensor([1, -1, 0, 1, 1, 3, 0]), 4).padded  # batch.py's worked example
    assert (padded.first_slot, padded.end_slot, padded.rows_per_slot) == (0, 4, 3)
    assert padded.rows.tolist() == [2, 6, 0, 0, 3, 4, 0, 0, 0, 5, 0, 0]
    assert padded.pads.squeeze(-1).tolist() == [[False, False, True], [False, False, False], [True, True, True],
                                                [False, True, True]]
    assert LoRABatch.build(torch.tensor([-1, -1]), 4).padded is None  # no adapter token


def test_lora_is_a_kernel_kind_and_the_cpu_picks_padded():
    choice = CpuPlatform.choose_kernel("lora", KernelQuery("float32"))
    assert choice.name == "cpu_padded"
    assert [c.name for c in CpuPlatform.kernel_candidates("lora")] == \
        ["cpu_padded", "cpu_segmented", "cpu_grouped", "masked_dense"]


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


def test_slice_columns_are_where_the_base_layer_places_each_module(tiny_checkpoints):
    from conftest import read_config
    from tengyun.layers.lora.manager import lora_target_layers, slice_columns
    from tengyun.model_spec import ModelSpec
    from tengyun.models.registry import get_model_class

    spec = ModelSpec.from_hf_config(read_config(tiny_checkpoints["qwen2"]))
    layers = lora_target_layers(get_model_class(spec.architecture)(spec, 64, torch.float32))
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    assert slice_columns("model.layers.0.self_attn.qkv_proj", layers["model.layers.0.self_attn.qkv_proj"]) == \
        [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    inter = spec.intermediate_size
    assert slice_columns("model.layers.0.mlp.gate_up_proj", layers["model.layers.0.mlp.gate_up_proj"]) == \
        [(0, inter), (inter, 2 * inter)]
    assert slice_columns("model.layers.0.mlp.down_proj", layers["model.layers.0.mlp.down_proj"]) == \
        [(0, spec.hidden_size)]
