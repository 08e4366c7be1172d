"""--runner pooling against HF transformers on tiny random Qwen3 checkpoints, float32: embeddings
(Qwen3Model), a sequence classifier, and the Qwen3-Reranker conversion of a causal LM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pooling_checkpoints import (  # noqa: F401  (fixtures)
    ENGINE, RERANKER_OVERRIDES, classify_checkpoint, embed_checkpoint, reranker_checkpoint, tied_reranker_checkpoint,
)
from tengyun import LLM
from tengyun.pooling_params import PoolingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
           "def add(a, b):\n    return a + b\n", "人工智能正在改变世界。"]
LONG = " ".join(PROMPTS[:3])  # ~60 tokens: several chunks at --max-num-batched-tokens 16


def hf_hidden(folder, text: str) -> torch.Tensor:
    """HF Qwen3Model's last hidden states [T, H] of ``text``."""
    from transformers import AutoModel, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0]


@pytest.fixture(scope="module")
def embedder(embed_checkpoint):  # noqa: F811
    llm = LLM(str(embed_checkpoint), **ENGINE)
    yield llm
    llm.llm_engine.shutdown()


def test_auto_runner_pools_a_qwen3model_checkpoint(embedder):
    config = embedder.llm_engine.config
    assert (config.runner, config.convert, config.pooling.pooling_type) == ("pooling", "embed", "LAST")


def test_embeddings_match_hf_last_token_normalized(embedder, embed_checkpoint):  # noqa: F811
    outputs = embedder.embed(PROMPTS)
    for text, output in zip(PROMPTS, outputs):
        reference = F.normalize(hf_hidden(embed_checkpoint, text)[-1], dim=-1)
        ours = torch.tensor(output.outputs.embedding)
        assert ours.shape == (64,)
        assert 1 - F.cosine_similarity(ours, reference, dim=0).item() < 1e-4
        assert torch.allclose(ours.norm(), torch.tensor(1.0), atol=1e-5)


def test_batched_embeddings_equal_one_by_one(embedder):
    batched = [o.outputs.embedding for o in embedder.embed(PROMPTS)]
    single = [embedder.embed(p)[0].outputs.embedding for p in PROMPTS]
    for a, b in zip(batched, single):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


def test_chunked_prefill_embeds_as_unchunked(embed_checkpoint, embedder):  # noqa: F811
    whole = embedder.embed(LONG)[0].outputs.embedding
    chunked = LLM(str(embed_checkpoint), **ENGINE, max_num_batched_tokens=16, enable_prefix_caching=False)
    try:
        assert len(chunked.get_tokenizer()(LONG)["input_ids"]) > 2 * 16
        assert torch.allclose(torch.tensor(chunked.embed(LONG)[0].outputs.embedding), torch.tensor(whole), atol=1e-5)
    finally:
        chunked.llm_engine.shutdown()


def test_mean_pooling_over_chunks_matches_hf_mean(embed_checkpoint):  # noqa: F811
    llm = LLM(str(embed_checkpoint), **ENGINE, max_num_batched_tokens=16,
              pooler_config='{"pooling_type": "MEAN", "normalize": false}')
    try:
        ours = torch.tensor(llm.embed(LONG)[0].outputs.embedding)
    finally:
        llm.llm_engine.shutdown()
    assert torch.allclose(ours, hf_hidden(embed_checkpoint, LONG).mean(dim=0), atol=1e-4)


def test_encode_returns_one_normalized_row_per_token(embedder, embed_checkpoint):  # noqa: F811
    data = embedder.encode(PROMPTS[1], pooling_task="encode")[0].outputs.data
    reference = F.normalize(hf_hidden(embed_checkpoint, PROMPTS[1]), dim=-1)
    assert data.shape == reference.shape
    assert torch.allclose(data, reference, atol=1e-4)
    by_default = embedder.encode(PROMPTS[1])[0].outputs.data  # vLLM 0.11: "embed" on an embedding model
    assert torch.allclose(by_default, reference[-1], atol=1e-4)


def test_prefix_cache_serves_a_repeated_prompt_with_the_same_embedding(embedder):
    first = embedder.embed(LONG)[0]
    again = embedder.embed(LONG)[0]
    assert again.num_cached_tokens >= 16
    assert torch.allclose(torch.tensor(first.outputs.embedding), torch.tensor(again.outputs.embedding), atol=1e-5)
    assert embedder.llm_engine.scheduler.block_manager.usage == 0.0  # every block given back


def test_score_of_an_embedding_model_is_the_cosine_similarity(embedder):
    a, b = (torch.tensor(o.outputs.embedding) for o in embedder.embed(PROMPTS[:2]))
    scores = embedder.score(PROMPTS[0], PROMPTS[:2])
    assert scores[0].outputs.score == pytest.approx(1.0, abs=1e-5)
    assert scores[1].outputs.score == pytest.approx(F.cosine_similarity(a, b, dim=0).item(), abs=1e-5)


def test_dimensions_refused_for_a_model_without_matryoshka(embedder):
    with pytest.raises(ValueError, match="does not support matryoshka representation"):
        embedder.embed(PROMPTS[0], pooling_params=PoolingParams(dimensions=16))


def test_matryoshka_dimensions_truncate_then_normalize(embed_checkpoint):  # noqa: F811
    llm = LLM(str(embed_checkpoint), **ENGINE, hf_overrides={"is_matryoshka": True})
    try:
        full = torch.tensor(llm.embed(PROMPTS[0], pooling_params=PoolingParams(normalize=False))[0].outputs.embedding)
        short = llm.embed(PROMPTS[0], pooling_params=PoolingParams(dimensions=16))[0].outputs.embedding
    finally:
        llm.llm_engine.shutdown()
    assert torch.allclose(torch.tensor(short), F.normalize(full[:16], dim=-1), atol=1e-5)


def test_prompt_over_max_model_len_refused_or_truncated(embedder):
    too_long = list(range(1, 130))
    with pytest.raises(ValueError, match="maximum context length is 128 tokens. However, you requested 129 tokens "
                                         "in the input for embedding generation"):
        embedder.embed(too_long)
    kept = embedder.embed(too_long, truncate_prompt_tokens=20)[0]
    assert kept.prompt_token_ids == too_long[-20:]
    assert kept.outputs.embedding == embedder.embed(too_long[-20:])[0].outputs.embedding


def test_pooling_model_refuses_generate(embedder):
    with pytest.raises(ValueError, match="--runner pooling"):
        embedder.generate("Hello")


def test_classifier_probs_match_hf_softmax(classify_checkpoint):  # noqa: F811
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    hf = AutoModelForSequenceClassification.from_pretrained(classify_checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(classify_checkpoint)
    llm = LLM(str(classify_checkpoint), **ENGINE)
    try:
        assert llm.llm_engine.config.convert == "classify"
        outputs = llm.classify(PROMPTS)
        raw = llm.classify(PROMPTS[0], pooling_params=PoolingParams(activation=False))[0].outputs.probs
    finally:
        llm.llm_engine.shutdown()
    for text, output in zip(PROMPTS, outputs):
        with torch.no_grad():
            logits = hf(torch.tensor([tokenizer(text)["input_ids"]])).logits[0]
        assert output.outputs.num_classes == 3
        assert torch.allclose(torch.tensor(output.outputs.probs), logits.softmax(-1), atol=1e-5)
        if text == PROMPTS[0]:
            assert torch.allclose(torch.tensor(raw), logits, atol=1e-4)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_qwen3_reranker_conversion_scores_as_the_yes_no_rule(tied, request):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = request.getfixturevalue("tied_reranker_checkpoint" if tied else "reranker_checkpoint")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), **ENGINE, runner="pooling", hf_overrides=RERANKER_OVERRIDES)
    try:
        assert (llm.llm_engine.config.convert, llm.llm_engine.config.pooling.num_labels) == ("classify", 1)
        scores = llm.score("Which city is the capital of France?", PROMPTS)
        batched = [o.outputs.score for o in scores]
        single = [llm.score("Which city is the capital of France?", p)[0].outputs.score for p in PROMPTS]
    finally:
        llm.llm_engine.shutdown()
    for document, output in zip(PROMPTS, scores):
        ids = tokenizer(text="Which city is the capital of France?", text_pair=document)["input_ids"]
        assert output.prompt_token_ids == ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        assert output.outputs.score == pytest.approx(logits[[no, yes]].softmax(-1)[1].item(), abs=1e-5)
    assert batched == pytest.approx(single, abs=1e-6)


def test_reward_conversion_scores_every_token_without_activation(classify_checkpoint):  # noqa: F811
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    hf = AutoModelForSequenceClassification.from_pretrained(classify_checkpoint, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(classify_checkpoint)(PROMPTS[1])["input_ids"]
    llm = LLM(str(classify_checkpoint), **ENGINE, convert="reward")
    try:
        data = llm.reward(PROMPTS[1])[0].outputs.data
    finally:
        llm.llm_engine.shutdown()
    with torch.no_grad():
        expected = hf.score(hf.model(torch.tensor([ids])).last_hidden_state[0])  # [T, 3]
    assert torch.allclose(torch.tensor(data), expected, atol=1e-4)
