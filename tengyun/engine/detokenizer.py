"""IncrementalDetokenizer: token ids -> text, a few tokens per step, never a broken character.

Window (as vLLM's prefix_offset / read_offset), over ids = prompt tail + output ids:

    ids:  ... [prefix_offset ...... read_offset) [read_offset ...... len(ids))
               already emitted, decoded again      new, emitted once clean
               for context (leading spaces)

    new = decode(ids[prefix:]) - decode(ids[prefix:read]), emitted only when it does not end in
    U+FFFD (a multi-byte character still split across byte-level tokens). Then
    prefix, read = read, len(ids).

Pure Python: the tokenizer is duck-typed (anything with ``decode``), no torch import. A
transformers fast tokenizer that keeps the library's own decode is decoded by its Rust backend
directly (``text_decoder``): the same text, without the wrapper's argument handling.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from tengyun.sampling_params import SamplingParams

# Prompt ids kept as left context for the first output tokens (vLLM uses 5).
_PROMPT_CONTEXT = 5
_REPLACEMENT_CHAR = "\ufffd"


# transformers' own decode, and the _decode methods that only call the backend and (when asked) clean
# up spaces: PreTrainedTokenizerFast's (4.x) and TokenizersBackend's (5.x).
_LIBRARY_DECODE = "PreTrainedTokenizerBase.decode"
_BACKEND_DECODES = ("PreTrainedTokenizerFast._decode", "TokenizersBackend._decode")


@functools.cache
def decodes_through_backend(cls: type) -> bool:
    """Whether ``cls.decode(ids, skip_special_tokens=s, clean_up_tokenization_spaces=False)`` is
    ``backend.decode(ids, skip_special_tokens=s)``: transformers' own decode and _decode, not a
    subclass's override (fast tokenizers ignore spaces_between_special_tokens)."""
    decode, _decode = getattr(cls, "decode", None), getattr(cls, "_decode", None)
    return (getattr(decode, "__qualname__", "") == _LIBRARY_DECODE
            and getattr(_decode, "__qualname__", "") in _BACKEND_DECODES
            and getattr(_decode, "__module__", "").startswith("transformers."))


def text_decoder(tokenizer: Any, params: SamplingParams) -> Callable[[list[int]], str]:
    """ids -> text as ``tokenizer.decode`` gives it for these params. A fast tokenizer's Rust
    backend directly where that is the same (decodes_through_backend): an update of one token took
    3.5 against 11.8 us with SmolLM2's tokenizer, 1.9 against 6.3 with Qwen2.5's, and the engine's
    output work at 64 streams 1.56-1.58 against 1.86-2.44 ms a step (benchmarks/engine_output_work.py)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode") and decodes_through_backend(type(tokenizer)):
        skip = params.skip_special_tokens
        return lambda ids: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens,
                                        spaces_between_special_tokens=params.spaces_between_special_tokens,
                                        clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self._decode = text_decoder(tokenizer, params) if params.detokenize else None
        self.output_text = ""
        self._ids: list[int] = self._prompt_context(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stops: list[str] = list(params.stop or [])
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        # Chars withheld from streaming while unfinished; 0 when a stop string will be kept anyway.
        self._hold_back = 0 if params.include_stop_str_in_output else max(self._max_stop_len - 1, 0)
        self._num_sent = 0  # len of output_text already returned by get_next_output_text(delta=True)

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        """The last few prompt ids, minus leading ones that start mid-character.

        A window that starts inside a character decodes to U+FFFD there, and byte-fallback
        decoders turn the whole run of byte tokens into U+FFFD, new ones included.
        """
        if not self.params.detokenize:
            return []
        ids = list(prompt_token_ids[max(len(prompt_token_ids) - _PROMPT_CONTEXT, 0) :])
        while ids and self._decode(ids).startswith(_REPLACEMENT_CHAR):
            ids.pop(0)
        return ids

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens and extend output_text; return the stop string if one matched.

        On a match output_text is cut before the stop string (after it with
        include_stop_str_in_output); the caller then finishes the sequence.
        """
        if not self.params.detokenize or not new_token_ids:
            return None
        self._ids.extend(new_token_ids)
        new_text = self._decode_new()
        if not new_text:
            return None
        self.output_text += new_text
        return self._check_stop(len(new_text)) if self._stops else None

    def _decode_new(self) -> str:
        """Text of ids[read_offset:] once it is whole; advances the window when it is."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            # Nothing new (e.g. a skipped special token) or a character still incomplete.
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text) :]

    def _check_stop(self, num_new_chars: int) -> str | None:
        """Find the earliest stop string that ends in the new text.

        Search text[-(num_new + longest_stop - 1):] so a stop spanning two steps is caught.
        """
        text = self.output_text
        start = max(len(text) - num_new_chars - (self._max_stop_len - 1), 0)
        best: tuple[int, str] | None = None
        for stop in self._stops:
            i = text.find(stop, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return None
        i, stop = best
        self.output_text = text[: i + len(stop)] if self.params.include_stop_str_in_output else text[:i]
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to stream: all of it, or with delta=True what was not yet returned.

        Unless finished, the last (longest stop - 1) chars are held back, so a stop string that
        is later cut from output_text was never partly streamed.
        """
        end = len(self.output_text) if finished else max(len(self.output_text) - self._hold_back, 0)
        if not delta:
            return self.output_text[:end]
        start = self._num_sent
        self._num_sent = max(end, start)
        return self.output_text[start:end]
