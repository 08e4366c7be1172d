"""`--stream-interval` and the request field `stream_interval` on the real server, through the
official openai client: a stream's chunks carry the first token at once, then N tokens each, then
what is left; the text is the same as unbatched; a bad value is a 400 naming the field, after
which the server still answers."""

from __future__ import annotations

import openai
import pytest

from remote_server import running_server, server_model  # noqa: F401 (fixtures)

GREEDY = dict(model="tiny", prompt="The quick brown fox", max_tokens=10, temperature=0, logprobs=1)


@pytest.fixture(scope="module")
def client(server_model, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("stream_interval_server") / "server.log"
    for server in running_server(server_model, ["--served-model-name", "tiny", "--stream-interval", "3"], log):
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def streamed(client, **extra) -> tuple[list[int], str]:
    """(tokens in each chunk that carries some, the text joined) of a streamed greedy completion."""
    counts, text = [], ""
    for chunk in client.completions.create(**GREEDY, stream=True, extra_body={"ignore_eos": True, **extra}):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None and choice.logprobs.tokens:
                counts.append(len(choice.logprobs.tokens))
    return counts, text


@pytest.mark.parametrize("extra, counts", [
    ({}, [1, 3, 3, 3]),  # the server's --stream-interval 3
    ({"stream_interval": 2}, [1, 3, 3, 3]),  # raised to the server's
    ({"stream_interval": 4}, [1, 4, 4, 1]),
])
def test_chunks_carry_the_interval_and_the_same_text(client, extra, counts):
    whole = client.completions.create(**GREEDY, extra_body={"ignore_eos": True})
    got_counts, text = streamed(client, **extra)
    assert got_counts == counts
    assert text == whole.choices[0].text and len(whole.choices[0].logprobs.tokens) == 10


def test_a_chat_stream_takes_the_interval_too(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=9, temperature=0, stream=True,
        logprobs=True, extra_body={"ignore_eos": True, "stream_interval": 4}))
    counts = [len(c.choices[0].logprobs.content) for c in chunks
              if c.choices and c.choices[0].logprobs is not None and c.choices[0].logprobs.content]
    assert counts == [1, 4, 4]


def test_a_bad_stream_interval_is_a_400_naming_it_and_the_server_goes_on(client):
    with pytest.raises(openai.BadRequestError, match="stream_interval"):
        client.completions.create(**GREEDY, stream=True, extra_body={"stream_interval": 0})
    assert streamed(client)[0] == [1, 3, 3, 3]
