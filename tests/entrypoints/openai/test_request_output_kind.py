"""The server asks the engine for DELTA outputs when it streams (each chunk is built from what the
step added, never from the answer so far) and for FINAL_ONLY when it answers in one piece."""

from __future__ import annotations

import pytest

from tengyun.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tengyun.sampling_params import RequestOutputKind


@pytest.mark.parametrize("request_cls, body", [
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "Hi"}]}),
    (CompletionRequest, {"prompt": "Hi"}),
])
@pytest.mark.parametrize("stream, kind", [(True, RequestOutputKind.DELTA), (False, RequestOutputKind.FINAL_ONLY)])
def test_streams_take_delta_outputs_and_whole_answers_final_only(request_cls, body, stream, kind):
    request = request_cls(**body, stream=stream, n=2)
    assert request.to_sampling_params(16).output_kind is kind
