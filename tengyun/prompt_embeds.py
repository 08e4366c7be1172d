"""PromptEmbeds: a prompt given as embeddings instead of token ids (vLLM's ``prompt_embeds``).

Torch-free, so the engine can queue, schedule and pickle it: the rows travel as a numpy array of
their dtype's bits ([seq_len, hidden_size]; bfloat16, which numpy lacks, as uint16) and become a
tensor only on the worker (prompt_embeds_codec.to_tensor). The engine tracks such a prompt as
seq_len placeholder token ids 0 (as vLLM): they count as prompt tokens and take KV slots, but
they are never embedded, hashed into the prefix cache or shown as text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# dtype name -> the numpy dtype holding its bits; the dtypes vLLM accepts for prompt_embeds.
STORAGE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
# vLLM's words when the engine runs without the flag (vllm/inputs/preprocess.py).
NOT_ENABLED = "You must set `--enable-prompt-embeds` to input `prompt_embeds`."
PLACEHOLDER_TOKEN_ID = 0


@dataclass(eq=False)
class PromptEmbeds:
    data: np.ndarray  # [seq_len, hidden_size], STORAGE_DTYPES[dtype]
    dtype: str  # "float32", "float16" or "bfloat16"

    def __post_init__(self) -> None:
        if self.dtype not in STORAGE_DTYPES:
            raise ValueError(f"prompt_embeds must be float32, bfloat16 or float16, not {self.dtype}.")
        if self.data.ndim != 2:
            raise ValueError(f"prompt_embeds must be of shape (seq_len, hidden_size); got {tuple(self.data.shape)}.")
        if self.data.dtype != STORAGE_DTYPES[self.dtype]:
            raise ValueError(f"PromptEmbeds of dtype {self.dtype} must hold {STORAGE_DTYPES[self.dtype].__name__} "
                             f"bits, not {self.data.dtype}.")

    @property
    def num_tokens(self) -> int:
        return int(self.data.shape[0])

    def __len__(self) -> int:  # prompt tokens, as len(token_ids) counts them
        return self.num_tokens

    @property
    def hidden_size(self) -> int:
        return int(self.data.shape[1])

    def placeholder_token_ids(self) -> list[int]:
        """What the engine counts in place of the prompt: one id 0 per row, as vLLM reports them."""
        return [PLACEHOLDER_TOKEN_ID] * self.num_tokens

    def check_against_model(self, enabled: bool, hidden_size: int) -> None:
        """Raise ValueError naming prompt_embeds (or the flag) when this engine cannot run it."""
        if not enabled:
            raise ValueError(NOT_ENABLED)
        if self.num_tokens == 0:
            raise ValueError("prompt_embeds must hold at least one row (shape (seq_len, hidden_size), seq_len >= 1).")
        if self.hidden_size != hidden_size:
            raise ValueError(f"prompt_embeds has hidden size {self.hidden_size} but the model's is {hidden_size}: "
                             f"pass a tensor of shape (seq_len, {hidden_size}).")
