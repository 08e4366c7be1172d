"""LoRAManager: the worker's adapters. It gives every targeted linear of this rank LoRA slots
(--max-loras of rank --max-lora-rank), keeps up to --max-cpu-loras adapters read on the host,
writes a step's adapters into slots (least recently used evicted: tengyun/lora/slots.py) and
builds the step's token -> slot map (batch.py).

    step: seqs [(sql, 5 tokens), (None, 1), (chat, 1)]
      -> slots.assign({sql.id, chat.id}); token_slots [0, 0, 0, 0, 0, -1, 1]
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch
from torch import nn

from tengyun.layers.lora.batch import LoRABatch
from tengyun.layers.lora.layer import LinearLoRA
from tengyun.layers.lora.loader import AdapterWeights, load_adapter
from tengyun.lora.peft_adapter import read_peft_adapter
from tengyun.lora.request import LoRARequest
from tengyun.lora.slots import AdapterSlots, HostCache
from tengyun.lora.targets import SLICES_OF_LAYER, TARGETS
from tengyun.model_spec import ModelSpec

logger = logging.getLogger(__name__)


def lora_target_layers(model: nn.Module) -> dict[str, nn.Module]:
    """"model.layers.<i>.self_attn.qkv_proj" -> the linear, for every targeted layer this rank holds."""
    layers = {}
    for name, module in model.named_modules():
        parts = name.split(".", 3)
        if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in SLICES_OF_LAYER:
            layers[name] = module
    return layers


def slice_columns(name: str, linear: nn.Module) -> list[tuple[int, int]]:
    """Each LoRA slice's output columns [first, end) in ``linear`` on this rank, in slice order,
    where the base layer places that module ("...qkv_proj" -> q's, k's, v's columns)."""
    layer = name.split(".", 3)[3]
    columns = []
    for target in sorted((t for t in TARGETS.values() if t.layer == layer), key=lambda t: t.slice_index):
        parts, _ = linear._out_parts(target.shard_id)
        columns.append((min(dst for dst, _, _ in parts), max(dst + count for dst, count, _ in parts)))
    return columns


class LoRAManager:
    def __init__(self, model: nn.Module, spec: ModelSpec, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device, kernel):
        self.spec, self.max_loras, self.max_lora_rank, self.dtype = spec, max_loras, max_lora_rank, dtype
        self.device = device
        self.layers = lora_target_layers(model)
        for name, linear in self.layers.items():
            linear.lora = LinearLoRA(linear.in_features, linear.out_features, slice_columns(name, linear),
                                     max_loras, max_lora_rank, dtype, device, kernel)
        self.slots = AdapterSlots(max_loras)
        self.host: HostCache[AdapterWeights] = HostCache(max_cpu_loras)
        logger.info("LoRA: %d slots of rank %d in %d layers, %.1f MiB (%s kernel)", max_loras, max_lora_rank,
                    len(self.layers), self.nbytes() / 2**20, kernel.name)

    def nbytes(self) -> int:
        """Bytes of the device slots on this rank."""
        return sum(linear.lora.nbytes() for linear in self.layers.values())

    def step_batch(self, seqs: Sequence[tuple[LoRARequest | None, int]]) -> LoRABatch | None:
        """``seqs``: (adapter, tokens) of each sequence in the flat batch's order. Loads the adapters
        not in a slot yet; None when no token runs an adapter (the layers then add nothing)."""
        requests = {lora.lora_int_id: lora for lora, _ in seqs if lora is not None}
        if not requests:
            return None
        for adapter_id, slot in self.slots.assign(set(requests)):
            self._write(slot, requests[adapter_id])
        slot_of = self.slots.slot_of
        per_seq = [slot_of[lora.lora_int_id] if lora is not None else -1 for lora, _ in seqs]
        token_slots = np.repeat(np.asarray(per_seq, dtype=np.int64), [n for _, n in seqs])
        return LoRABatch.build(token_slots, self.max_loras, self.device)

    def _write(self, slot: int, lora: LoRARequest) -> None:
        weights = self.host.get(lora.lora_int_id, lambda: self._read(lora))
        for name, linear in self.layers.items():
            linear.lora.write(slot, *weights.get(name, (None, None)))

    def _read(self, lora: LoRARequest) -> AdapterWeights:
        """The adapter from disk, checked again (the engine checked it when the request came)."""
        adapter = read_peft_adapter(lora, self.spec, self.max_lora_rank)
        logger.info("LoRA adapter %r (id %d) read from %s: rank %d, %d modules", lora.lora_name, lora.lora_int_id,
                    lora.lora_path, adapter.rank, len(adapter.modules))
        return load_adapter(adapter, self.layers, self.max_lora_rank, self.dtype)
