"""Every question sizing asks a platform, in one place, by device name ("cpu", "cuda", "npu"),
torch-free and without touching the device: the class's answers (platforms.platform_class)."""

from __future__ import annotations


def _platform(device: str):
    from tengyun.platforms import platform_class

    return platform_class(device)


def served_dtype(requested: str, device: str, checkpoint_dtype: str | None) -> str:
    """--dtype on ``device``: "auto" as that platform serves a checkpoint stored in ``checkpoint_dtype``."""
    from tengyun.platforms import served_dtype as platform_served_dtype

    return platform_served_dtype(requested, device, checkpoint_dtype)


def default_block_size(device: str) -> int:
    """Tokens per KV block without --block-size; 16 where the platform's answer depends on the
    serving machine (CUDA: 256 only when flash-attn imports there)."""
    block_size = _platform(device).default_block_size
    return block_size if isinstance(block_size, int) else 16


def default_max_num_batched_tokens(device: str, usage_context: str) -> int:
    """Tokens per scheduler step without --max-num-batched-tokens: ``usage_context`` "llm" (the
    offline LLM class) or "api_server" (`tengyun serve`, and `tengyun plan`, which plans for it)."""
    platform = _platform(device)
    if usage_context == "api_server":
        return platform.default_batched_tokens_server
    return platform.default_batched_tokens_llm


def settings_problem(device: str, block_size: int, dtype: str, kv_cache_dtype: str) -> str | None:
    """Why the platform's kernels cannot run these settings, naming the flag (None: they can)."""
    return _platform(device).settings_problem(block_size, dtype, kv_cache_dtype)


def kv_cache_in_host_memory(device: str) -> bool:
    return _platform(device).kv_cache_in_host_memory


def fp8_matmul(device: str) -> bool:
    return _platform(device).fp8_matmul


def tied_head_copy(device: str, dtype: str, tp: int) -> bool:
    """A tied LM head holds its own copy of the vocab x hidden matrix next to the embedding's."""
    return _platform(device).tied_head_copy(dtype, tp)


def quantized_weight_bytes(device: str, scheme, out: int, in_: int, dtype: str, in_total: int | None = None) -> int:
    """Bytes the platform's kernel holds for one quantised [out, in_] weight in ``scheme``."""
    return _platform(device).quantized_weight_bytes(scheme, out, in_, dtype, in_total)


def quantized_head(device: str, scheme, dtype: str) -> str | None:
    """How the platform holds a quantised LM head in ``scheme`` (Platform.quantized_head)."""
    return _platform(device).quantized_head(scheme, dtype)
