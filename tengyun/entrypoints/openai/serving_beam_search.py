"""use_beam_search on /v1/completions and /v1/chat/completions, as vLLM 0.11 answers it.

n is the beam width and the number of choices (best first); length_penalty and temperature
apply (temperature only adds the sampled token to each beam's candidates, as in vLLM);
ignore_eos, include_stop_str_in_output and max_tokens as for sampling; early_stopping is the
only field vLLM 0.11 lacks (tengyun/beam_search.py BeamSearchParams). The answer comes in one
piece: with stream true, /v1/completions sends it as a single event (vLLM's "fake stream") and
chat streams each choice's whole text as one delta.

vLLM silently ignores the sampling fields below under beam search; here a request that sets one
gets a 400 naming it, so no one believes a stop string or top_p was applied.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from tengyun.beam_search import BeamSearchParams, beam_width_problem
from tengyun.entrypoints.openai.protocol import RequestError
from tengyun.entrypoints.openai.serving_engine import SSE_DONE, sse

# field -> its value when unused; None: unused when null
NOT_APPLIED = {"top_p": 1.0, "top_k": None, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
               "repetition_penalty": 1.0, "stop": None, "stop_token_ids": None, "min_tokens": 0,
               "logit_bias": None, "prompt_logprobs": None, "structured_outputs": None, "guided_json": None,
               "guided_regex": None, "guided_choice": None, "guided_grammar": None}


def beam_search_params(request: Any, max_tokens: int, defaults: dict[str, Any], max_logprobs: int,
                       max_num_seqs: int) -> BeamSearchParams:
    """The request's BeamSearchParams; RequestError naming the field that beam search cannot honour.
    ``defaults``: --generation-config's (temperature, when the request leaves it unset; else 1.0, as vLLM)."""
    for name, unused in NOT_APPLIED.items():
        value = getattr(request, name, unused)
        if value not in (unused, None, [], {}) and not (name == "top_k" and value in (0, -1)):
            raise RequestError(f"{name} is not applied by beam search (use_beam_search: true): drop {name}, or "
                               f"sample instead of searching.", name)
    response_format = getattr(request, "response_format", None)
    if response_format is not None and response_format.type != "text":
        raise RequestError("response_format is not applied by beam search (use_beam_search: true): drop "
                           "response_format, or sample instead of searching.", "response_format")
    problem = beam_width_problem(request.n, max_logprobs, max_num_seqs, name="n")
    if problem is not None:
        raise RequestError(f"With use_beam_search, n is the beam width: {problem}", "n")
    temperature = request.temperature if request.temperature is not None else defaults.get("temperature", 1.0)
    try:
        return BeamSearchParams(beam_width=request.n, max_tokens=max_tokens, ignore_eos=request.ignore_eos,
                                temperature=temperature, length_penalty=request.length_penalty,
                                include_stop_str_in_output=request.include_stop_str_in_output,
                                early_stopping=request.early_stopping)
    except ValueError as e:  # BeamSearchParams names the field first
        field = str(e).split(" ", 1)[0]
        raise RequestError(str(e), "n" if field == "beam_width" else field) from None


async def one_event_stream(response: Any) -> AsyncIterator[str]:
    """A whole answer as one server-sent event, then [DONE] (vLLM's stream under beam search)."""
    yield sse(response.model_dump())
    yield SSE_DONE
