"""LoRARequest: the adapter a request runs with, as vLLM's (``vllm.lora.request.LoRARequest``).

    from tengyun.lora.request import LoRARequest
    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql-lora"))
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """``lora_int_id`` (>= 1) identifies the adapter everywhere below the API: its worker slot, its
    share of the prefix cache. Two requests with the same id must mean the same weights."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None  # the model it was trained on (--lora-modules' JSON form)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id!r}.")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path is empty; pass the PEFT folder.")

    # vLLM's short names
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
