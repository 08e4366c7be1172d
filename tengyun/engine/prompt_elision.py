"""A request's prompt crosses the engine process's results pipe once, not with every step.

Every RequestOutput carries the request's prompt text and token ids, and a streaming request gets
one after every step: at 64 streams of 128-token text prompts a step's StepResult pickled to ~97
KB, ~80 of them prompts the API process already had. Over 64 KiB the engine's send also blocks
until the API process is scheduled and reads. So the engine side leaves them out of every output
after a request's first (``PromptSender``), naming those requests in ``StepResult.elided_prompts``,
and the API side puts them back from the first one (``PromptKeeper``) before anything reads the
outputs. Readers see the same RequestOutputs as before.

Both ends forget a request when a message says it finished (an output or a progress entry: aborted
requests report one too; or a rejection), before and after reading that message's outputs, so a
finished request's last output carries its prompt, and a request id that ends and starts again in
one message never takes the earlier request's prompt. Both ends apply the same rule to the same
messages, so they always agree on who holds what. Pure Python, no torch.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from tengyun.outputs import RequestOutput


def _finished_ids(message: Any) -> set[str]:
    return {p.request_id for p in message.progress if p.finished} | {
        o.request_id for o in message.outputs if o.finished} | set(message.rejected)


class PromptSender:
    """Engine side: ``slim(step_result)`` before it is pickled."""

    def __init__(self) -> None:
        self._sent: set[str] = set()  # requests whose prompt already crossed

    def slim(self, message: Any) -> Any:
        """The StepResult with the prompts the receiver already holds left out (the outputs are
        copies; the engine's own are untouched); any other message as it is."""
        outputs = getattr(message, "outputs", None)
        if outputs is None:
            return message
        done = _finished_ids(message)
        self._sent -= done
        slimmed, elided = [], set()
        for output in outputs:
            if isinstance(output, RequestOutput):  # not a pooled one: that comes once, finished
                if output.request_id in self._sent:
                    output = copy.copy(output)
                    output.prompt = output.prompt_token_ids = None
                    elided.add(output.request_id)
                else:
                    self._sent.add(output.request_id)
            slimmed.append(output)
        self._sent -= done
        return dataclasses.replace(message, outputs=slimmed, elided_prompts=frozenset(elided))

    def __len__(self) -> int:
        return len(self._sent)


class PromptKeeper:
    """API side: ``restore(step_result)`` before it is dispatched."""

    def __init__(self) -> None:
        self._prompts: dict[str, tuple[str | None, list[int]]] = {}  # request id -> (prompt, token ids)

    def restore(self, message: Any) -> Any:
        """The StepResult with every output whole again (in place)."""
        outputs = getattr(message, "outputs", None)
        if outputs is None:
            return message
        elided, done = getattr(message, "elided_prompts", frozenset()), _finished_ids(message)
        self._forget(done)
        for output in outputs:
            if not isinstance(output, RequestOutput):
                continue
            if output.request_id in elided:
                output.prompt, output.prompt_token_ids = self._prompts[output.request_id]
            else:
                self._prompts[output.request_id] = (output.prompt, output.prompt_token_ids)
        self._forget(done)
        return message

    def _forget(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            self._prompts.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._prompts)

