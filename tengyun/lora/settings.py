"""The LoRA flags (EngineConfig's enable_lora ... fully_sharded_loras) checked, with vLLM's names
and defaults. Torch-free: EngineConfig calls these."""

from __future__ import annotations

from typing import Any

from tengyun.lora.targets import architecture_problem

LORA_DTYPES = ("auto", "float32", "float16", "bfloat16")


def check_lora_values(config: Any) -> None:
    """The values as typed; raises ValueError naming the flag. --max-cpu-loras defaults to --max-loras."""
    if config.max_loras < 1:
        raise ValueError(f"--max-loras must be >= 1 (try 4); got {config.max_loras}.")
    if config.max_lora_rank < 1:
        raise ValueError(f"--max-lora-rank must be >= 1 (try 16); got {config.max_lora_rank}.")
    if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
        raise ValueError(f"--max-cpu-loras ({config.max_cpu_loras}) must be >= --max-loras ({config.max_loras}): "
                         f"every adapter in a slot is also kept on the host.")
    if config.lora_dtype not in LORA_DTYPES:
        raise ValueError(f"--lora-dtype must be one of {', '.join(LORA_DTYPES)}; got {config.lora_dtype!r}.")


def check_lora_model(config: Any) -> None:
    """At finalize: the combinations LoRA cannot run (speculative decoding, --fully-sharded-loras
    above TP 1, a pooling runner) and the model (Llama-style decoders only)."""
    if not config.enable_lora:
        return
    if config.speculative_config is not None:
        raise ValueError("--speculative-config with --enable-lora is not supported: drafts would be verified "
                         "without the request's adapter; drop --speculative-config (or --enable-lora).")
    if config.fully_sharded_loras and config.tensor_parallel_size > 1:
        raise ValueError("--fully-sharded-loras is not supported: Tengyun splits each adapter as its base layer "
                         "is split (B by outputs in column-parallel layers, A by inputs in row-parallel ones) and "
                         "keeps the other half whole; drop --fully-sharded-loras.")
    problem = architecture_problem(config.model_spec)
    if problem:
        raise ValueError(f"--enable-lora: {problem}; drop --enable-lora to serve the base model.")
    if getattr(config, "runner", "generate") == "pooling":
        raise ValueError("--enable-lora with --runner pooling is not supported: drop --enable-lora.")
