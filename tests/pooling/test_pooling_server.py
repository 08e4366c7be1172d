"""The pooling routes on a real server over loopback: the official openai SDK's
embeddings.create, httpx for /pooling, /classify, /score and /rerank; auth, errors and metrics
as the generative routes; each runner refuses the other's routes naming --runner pooling."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F

from pooling_checkpoints import (  # noqa: F401  (fixtures)
    RERANKER_OVERRIDES, classify_checkpoint, embed_checkpoint, reranker_checkpoint,
)
from test_pooling_vs_hf import PROMPTS, hf_hidden

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints" / "openai"))
from remote_server import API_KEY, running_server, server_model  # noqa: E402, F401  (fixture)

import json  # noqa: E402

QUERY = "Which city is the capital of France?"


def auth() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def embed_server(embed_checkpoint, tmp_path_factory):  # noqa: F811
    yield from running_server(embed_checkpoint, ["--api-key", API_KEY, "--max-model-len", "64", "--dtype", "float32"],
                              tmp_path_factory.mktemp("embed_server") / "server.log")


@pytest.fixture(scope="module")
def rerank_server(reranker_checkpoint, tmp_path_factory):  # noqa: F811
    yield from running_server(reranker_checkpoint, ["--runner", "pooling", "--hf-overrides",
                                                    json.dumps(RERANKER_OVERRIDES), "--max-model-len", "128",
                                                    "--dtype", "float32"],
                              tmp_path_factory.mktemp("rerank_server") / "server.log")


@pytest.fixture(scope="module")
def client(embed_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=embed_server.url + "/v1", api_key=API_KEY)


def test_sdk_embeddings_match_hf(client, embed_checkpoint):  # noqa: F811
    response = client.embeddings.create(model=str(embed_checkpoint), input=PROMPTS[:2])  # the SDK asks for base64
    assert [d.index for d in response.data] == [0, 1]
    for text, item in zip(PROMPTS, response.data):
        reference = F.normalize(hf_hidden(embed_checkpoint, text)[-1], dim=-1)
        assert 1 - F.cosine_similarity(torch.tensor(item.embedding), reference, dim=0).item() < 1e-4
    assert response.usage.prompt_tokens == response.usage.total_tokens > 0


def test_float_and_token_id_inputs_answer_the_same(client, embed_server):
    tokenizer_ids = client.embeddings.create(model=None, input=PROMPTS[1], encoding_format="float")
    body = httpx.post(embed_server.url + "/v1/embeddings", headers=auth(),
                      json={"input": PROMPTS[1], "encoding_format": "float"}, timeout=60).json()
    ids = httpx.post(embed_server.url + "/tokenize", headers=auth(), json={"prompt": PROMPTS[1]}, timeout=60).json()
    by_ids = client.embeddings.create(model=None, input=[ids["tokens"], ids["tokens"]], encoding_format="float")
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding" and body["id"].startswith("embd-")
    assert body["usage"] == {"prompt_tokens": ids["count"], "total_tokens": ids["count"], "completion_tokens": 0,
                             "prompt_tokens_details": None}
    for vector in (tokenizer_ids.data[0].embedding, by_ids.data[0].embedding, by_ids.data[1].embedding):
        assert vector == pytest.approx(body["data"][0]["embedding"], abs=1e-6)


def test_dimensions_refused_for_a_model_without_matryoshka(client):
    with pytest.raises(openai.BadRequestError, match="does not support matryoshka representation"):
        client.embeddings.create(model=None, input="a", dimensions=8)


def test_long_input_refused_with_vllm_wording_or_truncated(embed_server):
    ids = list(range(1, 80))
    refused = httpx.post(embed_server.url + "/v1/embeddings", headers=auth(), json={"input": ids}, timeout=60)
    assert refused.status_code == 400
    assert ("This model's maximum context length is 64 tokens. However, you requested 79 tokens in the input for "
            "embedding generation.") in refused.json()["error"]["message"]
    kept = httpx.post(embed_server.url + "/v1/embeddings", headers=auth(),
                      json={"input": ids, "truncate_prompt_tokens": 10}, timeout=60)
    assert kept.status_code == 200 and kept.json()["usage"]["prompt_tokens"] == 10


def test_truncation_past_max_model_len_and_to_zero_as_vllm(embed_server):
    def embed(truncate):
        return httpx.post(embed_server.url + "/v1/embeddings", headers=auth(),
                          json={"input": PROMPTS[0], "truncate_prompt_tokens": truncate}, timeout=60)
    too_many = embed(65)
    assert too_many.status_code == 400
    assert too_many.json()["error"]["message"] == ("truncate_prompt_tokens value is greater than max_model_len. "
                                                   "Please, select a smaller truncation size.")
    nothing = embed(0)  # vLLM keeps no token: no data, no tokens
    assert nothing.status_code == 200
    assert nothing.json()["data"] == [] and nothing.json()["usage"]["prompt_tokens"] == 0
    empty = httpx.post(embed_server.url + "/v1/embeddings", headers=auth(), json={"input": []}, timeout=60)
    assert empty.status_code == 200 and empty.json()["data"] == [] and empty.json()["usage"]["prompt_tokens"] == 0


def test_messages_embed_the_chat_template_rendering(client, embed_server, embed_checkpoint):  # noqa: F811
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": PROMPTS[0]}, {"role": "assistant", "content": PROMPTS[1]}]
    chat = httpx.post(embed_server.url + "/v1/embeddings", headers=auth(),
                      json={"messages": messages, "encoding_format": "float"}, timeout=60).json()
    text = AutoTokenizer.from_pretrained(embed_checkpoint).apply_chat_template(messages, tokenize=False)
    # vLLM's chat form adds no special tokens on top of the template; the plain form's default does
    plain = client.embeddings.create(model=None, input=text, encoding_format="float",
                                     extra_body={"add_special_tokens": False})
    assert chat["usage"]["prompt_tokens"] == plain.usage.prompt_tokens
    assert chat["data"][0]["embedding"] == pytest.approx(plain.data[0].embedding, abs=1e-6)
    both = httpx.post(embed_server.url + "/v1/embeddings", headers=auth(),
                      json={"messages": messages, "input": "a"}, timeout=60)
    assert both.status_code == 400 and "either input" in both.json()["error"]["message"]


def test_invocations_route_pooling_bodies_by_shape(client, embed_server):
    body = {"input": PROMPTS[1], "encoding_format": "float"}
    direct = httpx.post(embed_server.url + "/v1/embeddings", headers=auth(), json=body, timeout=60).json()
    routed = httpx.post(embed_server.url + "/invocations", headers=auth(), json=body, timeout=60).json()
    assert routed["data"][0]["embedding"] == pytest.approx(direct["data"][0]["embedding"], abs=1e-6)
    pair = {"text_1": PROMPTS[0], "text_2": PROMPTS[1]}
    score = httpx.post(embed_server.url + "/score", headers=auth(), json=pair, timeout=60).json()
    routed = httpx.post(embed_server.url + "/invocations", headers=auth(), json=pair, timeout=60).json()
    assert routed["data"][0]["score"] == pytest.approx(score["data"][0]["score"], abs=1e-6)


def test_an_embedding_model_scores_without_a_cross_encoders_activation(embed_server):
    pair = {"text_1": PROMPTS[0], "text_2": PROMPTS[1], "activation": True}
    refused = httpx.post(embed_server.url + "/score", headers=auth(), json=pair, timeout=60)
    assert refused.status_code == 400 and "does not support ['activation']" in refused.json()["error"]["message"]


def test_pooling_routes_need_the_api_key(embed_server):
    for path in ("/v1/embeddings", "/pooling", "/score", "/rerank", "/v2/rerank"):
        assert httpx.post(embed_server.url + path, json={"input": "a"}, timeout=60).status_code == 401


def test_pooling_route_returns_a_row_per_token(embed_server):
    body = httpx.post(embed_server.url + "/pooling", headers=auth(), json={"input": PROMPTS[1]}, timeout=60).json()
    rows = body["data"][0]["data"]
    assert body["data"][0]["object"] == "pooling" and len(rows) == body["usage"]["prompt_tokens"] and len(rows[0]) == 64


def test_a_pooling_server_refuses_generation_naming_the_runner(client):
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client.chat.completions.create(model=None, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client.completions.create(model=None, prompt="hi", stream=True)


def test_a_generative_server_refuses_embeddings_naming_the_runner(server_model, tmp_path):  # noqa: F811
    for server in running_server(server_model, [], tmp_path / "server.log"):
        for path, body in (("/v1/embeddings", {"input": "a"}), ("/score", {"text_1": "a", "text_2": "b"}),
                           ("/rerank", {"query": "a", "documents": ["b"]}),
                           # inputs a pooling server answers with no data (vLLM's test_openai_schema found a 500)
                           ("/classify", {"input": []}), ("/v1/embeddings", {"input": []}),
                           ("/pooling", {"input": "a", "truncate_prompt_tokens": 0})):
            answer = httpx.post(server.url + path, json=body, timeout=60)
            assert answer.status_code == 400 and "--runner pooling" in answer.json()["error"]["message"]


def test_metrics_count_pooling_requests_and_tokens(embed_server, client):
    def scrape() -> dict[str, float]:
        text = httpx.get(embed_server.url + "/metrics", timeout=60).text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith(("vllm:prompt_tokens_total", "vllm:request_success_total"))}

    before = scrape()
    response = client.embeddings.create(model=None, input=PROMPTS[:3])
    after = scrape()
    prompt = next(k for k in after if k.startswith("vllm:prompt_tokens_total{"))
    assert after[prompt] - before[prompt] == response.usage.prompt_tokens
    success = next(k for k in after if k.startswith("vllm:request_success_total") and 'finished_reason="stop"' in k)
    assert after[success] - before.get(success, 0.0) == 3


def test_score_and_rerank_follow_the_yes_no_rule(rerank_server, reranker_checkpoint):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reranker_checkpoint)
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    hf = AutoModelForCausalLM.from_pretrained(reranker_checkpoint, dtype=torch.float32).eval()
    expected = []
    for document in PROMPTS:
        ids = tokenizer(text=QUERY, text_pair=document)["input_ids"]
        with torch.no_grad():
            expected.append(hf(torch.tensor([ids])).logits[0, -1][[no, yes]].softmax(-1)[1].item())
    for path in ("/score", "/v1/score"):
        body = httpx.post(rerank_server.url + path, json={"text_1": QUERY, "text_2": PROMPTS}, timeout=60).json()
        assert body["id"].startswith("score-") and [d["object"] for d in body["data"]] == ["score"] * len(PROMPTS)
        assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-5)
    order = sorted(range(len(PROMPTS)), key=lambda i: expected[i], reverse=True)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = httpx.post(rerank_server.url + path, json={"query": QUERY, "documents": PROMPTS, "top_n": 2},
                          timeout=60).json()
        assert [r["index"] for r in body["results"]] == order[:2]
        assert body["results"][0]["document"] == {"text": PROMPTS[order[0]]}
        assert body["results"][0]["relevance_score"] == pytest.approx(expected[order[0]], abs=1e-5)
        assert body["usage"]["total_tokens"] > 0


def test_classify_and_bad_score_bodies(rerank_server):
    body = httpx.post(rerank_server.url + "/classify", json={"input": [QUERY, PROMPTS[0]]}, timeout=60).json()
    assert [d["num_classes"] for d in body["data"]] == [1, 1] and body["data"][0]["label"] == "LABEL_0"
    for payload in ({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, {"text_1": "a"}):
        answer = httpx.post(rerank_server.url + "/score", json=payload, timeout=60)
        assert answer.status_code == 400, answer.text
    empty = httpx.post(rerank_server.url + "/rerank", json={"query": "a", "documents": []}, timeout=60)
    assert empty.status_code == 400 and "documents must not be empty" in empty.json()["error"]["message"]


def test_bad_embedding_bodies_get_a_400_naming_the_field(embed_server):
    for body, words in (({"input": "a", "priority": 1}, "priority is not supported"),
                        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": [[1, 2], []]}, "input must not be empty")):
        answer = httpx.post(embed_server.url + "/v1/embeddings", headers=auth(), json=body, timeout=60)
        assert answer.status_code == 400 and words in answer.json()["error"]["message"], answer.text


@pytest.fixture(scope="module")
def classify_server(classify_checkpoint, tmp_path_factory):  # noqa: F811
    yield from running_server(classify_checkpoint, ["--max-model-len", "64", "--dtype", "float32"],
                              tmp_path_factory.mktemp("classify_server") / "server.log")


def test_a_classifier_of_several_labels_classifies_but_does_not_score(classify_server):
    body = {"input": [PROMPTS[0], PROMPTS[1]]}
    classified = httpx.post(classify_server.url + "/classify", json=body, timeout=60).json()
    assert [d["num_classes"] for d in classified["data"]] == [3, 3]
    routed = httpx.post(classify_server.url + "/invocations", json=body, timeout=60).json()
    assert [d["probs"] for d in routed["data"]] == [d["probs"] for d in classified["data"]]
    for path, payload, api in (("/score", {"text_1": "a", "text_2": "b"}, "Score"),
                               ("/rerank", {"query": "a", "documents": ["b"]}, "Rerank")):
        answer = httpx.post(classify_server.url + path, json=payload, timeout=60)
        assert answer.status_code == 400 and f"does not support {api} API" in answer.json()["error"]["message"]
        assert "3 label(s)" in answer.json()["error"]["message"]


@pytest.fixture(scope="module")
def chunked_server(embed_checkpoint, tmp_path_factory):  # noqa: F811
    pooler = {"pooling_type": "MEAN", "enable_chunked_processing": True, "max_embed_len": 100}
    yield from running_server(embed_checkpoint, ["--max-model-len", "32", "--dtype", "float32",
                                                 "--pooler-config", json.dumps(pooler)],
                              tmp_path_factory.mktemp("chunked_server") / "server.log")


def test_chunked_processing_averages_chunk_embeddings_weighted_as_vllm(chunked_server, embed_checkpoint):  # noqa: F811
    from transformers import AutoModel

    ids = [(7 * i) % 200 + 1 for i in range(70)]  # chunks of --max-model-len 32: 32 + 32 + 6 tokens
    body = httpx.post(chunked_server.url + "/v1/embeddings", json={"input": ids, "encoding_format": "float"},
                      timeout=60).json()
    model = AutoModel.from_pretrained(embed_checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():  # each chunk alone: MEAN of its states, normalized; then weighted by its tokens
        chunks = [F.normalize(model(torch.tensor([ids[i:i + 32]])).last_hidden_state[0].mean(0), dim=-1)
                  for i in range(0, 70, 32)]
    expected = (chunks[0] * 32 + chunks[1] * 32 + chunks[2] * 6) / 70
    assert body["usage"]["prompt_tokens"] == 70
    assert body["data"][0]["embedding"] == pytest.approx(expected.tolist(), abs=1e-4)
    too_long = httpx.post(chunked_server.url + "/v1/embeddings", json={"input": list(range(1, 102))}, timeout=60)
    assert too_long.status_code == 400
    assert ("This model's maximum embedding input length is 100 tokens. However, you requested 101 tokens"
            in too_long.json()["error"]["message"])
