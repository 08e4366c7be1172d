"""Beam search's user-facing records, named and shaped as vLLM's (vllm/beam_search.py and
vllm.sampling_params.BeamSearchParams), and its score.

Score of a beam (vLLM's, adapted from HF's BeamHypotheses):

    cumulative logprob / len ** length_penalty

where len counts the prompt tokens too and leaves out a final EOS. 10 prompt tokens, 4 output
tokens ending in EOS, cumulative logprob -3.9, length_penalty 1 -> -3.9 / 13 = -0.3.
HF transformers divides by the generated length instead (EOS included); both rank beams of
one length alike, so they agree on which beams win whenever the final beams have one length
or length_penalty is 0 (docs/beam_search.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

from tengyun.lora.request import LoRARequest
from tengyun.outputs import Logprob


@dataclass
class BeamSearchParams:
    """vLLM's fields, then Tengyun's early_stopping (vLLM 0.11 has none and always searches
    to the end; see BeamSearchParams.stops_early)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    # False / "never": the answer of searching all max_tokens steps (the search ends once no live
    # beam can beat the beam_width best finished ones). True: end once beam_width beams finished.
    early_stopping: bool | Literal["never"] = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}.")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f'early_stopping must be true, false or "never", got {self.early_stopping!r}.')


@dataclass
class BeamSearchSequence:
    """One beam. ``tokens`` hold the prompt too; ``logprobs`` one {token: Logprob} per step: the
    candidates that step offered this beam's parent (2 x beam_width, the chosen token among them)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: LoRARequest | None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | str | None = None  # the EOS id that ended it


@dataclass
class BeamSearchOutput:
    """The beam_width best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | set[int],
                          length_penalty: float = 1.0) -> float:
    """cumulative_logprob / len ** length_penalty, len without a final EOS (see the module docstring)."""
    eos = eos_token_id if isinstance(eos_token_id, (set, frozenset)) else {eos_token_id}
    seq_len = len(tokens) - (1 if tokens and tokens[-1] in eos else 0)
    return cumulative_logprob / (seq_len ** length_penalty)


def create_sort_beams_key_function(eos_token_id: int | set[int],
                                   length_penalty: float) -> Callable[[BeamSearchSequence], float]:
    def sort_beams_key(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, length_penalty)

    return sort_beams_key


def beam_width_problem(width: int, max_logprobs: int, max_num_seqs: int, name: str = "beam_width") -> str | None:
    """Why an engine with these settings cannot search ``width`` beams (each round ranks 2 x width
    candidate tokens per beam, as logprobs, and every beam runs as a sequence); None if it can.
    ``name``: what the caller calls the width (the server's n)."""
    if max_logprobs != -1 and 2 * width > max_logprobs:
        return (f"{name} {width} ranks {2 * width} candidate tokens per beam each step but --max-logprobs is "
                f"{max_logprobs}: use a beam width of at most {max_logprobs // 2}, or raise --max-logprobs to "
                f"{2 * width}.")
    if width > max_num_seqs:
        return (f"{name} {width} is more than --max-num-seqs {max_num_seqs}: every beam runs as a sequence, so "
                f"use a beam width of at most {max_num_seqs} or raise --max-num-seqs.")
    return None
