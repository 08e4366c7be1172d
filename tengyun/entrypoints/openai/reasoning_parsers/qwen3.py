"""Qwen3 reasoning: `<think>reasoning</think>content`, whole or as a growing prefix (streaming).

    "<think>\\nPlan.\\n</think>\\n\\nAnswer."  ->  reasoning "Plan.", content "Answer."
    "Answer."                                 ->  reasoning None, content "Answer."  (thinking off)
    prompt ends "<think>\\n", "Plan.</think>A" ->  reasoning "Plan.", content "A"  (Qwen3-2507: the
                                                  template opens <think>, the model only closes it)

Streaming parses the text so far with final=False: a partial tag at the end is held back, and so
are trailing newlines of the reasoning, so each result's reasoning and content extend the
previous ones and their differences are the deltas.
"""

from __future__ import annotations


def partial_suffix_len(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that ends `text`: ("ab<thi", "<think>") -> 4."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class Qwen3ReasoningParser:
    start = "<think>"
    end = "</think>"

    def prompt_opens_reasoning(self, prompt: str) -> bool:
        """True when the chat template ended the prompt inside <think> (the output starts thinking)."""
        return prompt.rstrip().endswith(self.start)

    def parse(self, text: str, in_reasoning: bool = False, final: bool = True,
              allow_missing_start: bool = False) -> tuple[str | None, str]:
        """-> (reasoning, or None when the output has no reasoning section; content).

        allow_missing_start (whole outputs only): text that closes </think> without opening it
        is reasoning up to the close, as some Qwen3 releases emit when the prompt opened it.
        """
        if not in_reasoning:
            stripped = text.lstrip()
            if stripped.startswith(self.start):
                text = stripped[len(self.start):]
            elif not final and (not stripped or self.start.startswith(stripped)):
                return None, ""  # maybe the start of "<think>": wait for more
            elif allow_missing_start and final and self.end in text:
                pass  # reasoning up to </think>
            else:
                return None, text
        idx = text.find(self.end)
        if idx == -1:
            if not final:
                text = text[:len(text) - partial_suffix_len(text, self.end)]
            return text.strip("\n"), ""
        return text[:idx].strip("\n"), text[idx + len(self.end):].lstrip()
