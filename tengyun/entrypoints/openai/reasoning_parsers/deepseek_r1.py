"""DeepSeek-R1 reasoning (--reasoning-parser deepseek_r1): the same `<think>` tags as Qwen3, but
the answer always starts inside the reasoning, as vLLM's parser of that name reads it. R1's
template opens `<think>` in the prompt (newer releases) or the model writes it (older ones), so
the output's own `<think>` is optional and everything up to `</think>` is reasoning:

    "<think>Plan.</think>Answer."  ->  reasoning "Plan.", content "Answer."
    "Plan.</think>Answer."         ->  reasoning "Plan.", content "Answer."
    "Plan, cut by max_tokens"      ->  reasoning "Plan, cut by max_tokens", content ""
"""

from __future__ import annotations

from tengyun.entrypoints.openai.reasoning_parsers.qwen3 import Qwen3ReasoningParser


class DeepSeekR1ReasoningParser(Qwen3ReasoningParser):
    def prompt_opens_reasoning(self, prompt: str) -> bool:
        return True  # whatever the template did, the output is reasoning until </think>

    def parse(self, text: str, in_reasoning: bool = True, final: bool = True,
              allow_missing_start: bool = False) -> tuple[str | None, str]:
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            text = stripped[len(self.start):]
        elif not final and stripped and self.start.startswith(stripped):
            return None, ""  # maybe the start of "<think>": wait for more
        return super().parse(text, True, final)
