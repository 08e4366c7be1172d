"""--enable-expert-load-metrics: tokens routed to each expert of each MoE layer, counted on the
device and read once per step, equal HF's router top-k picks; exported on /metrics as
tengyun:expert_load_tokens_total{layer, expert}; refused for a model without experts."""

from __future__ import annotations

import os
import sys
from collections import Counter

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tengyun import LLM, SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "entrypoints", "openai"))
from remote_server import running_server  # noqa: E402
from test_moe_grouped import HostReads, _inputs, _layer  # noqa: E402

PROMPT = [(13 * j) % 290 + 1 for j in range(12)]
ARGS = dict(block_size=8, max_model_len=64, kv_cache_memory="1MiB", dtype="float32")


def _hf_top_k_counts(folder, prompt: list[int], top_k: int) -> Counter:
    """{(layer, expert): positions of ``prompt`` HF's router sends to it}."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_router_logits=True)
    counts = Counter()
    sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]  # qwen3_moe: [0]
    for layer, logits in zip(sparse, out.router_logits, strict=True):
        for expert in torch.topk(logits.float(), top_k, dim=-1).indices.flatten().tolist():
            counts[layer, expert] += 1
    return counts


def test_expert_load_equals_hf_router_top_k_picks(tiny_checkpoints):
    folder = tiny_checkpoints["qwen3_moe"]
    llm = LLM(str(folder), enable_expert_load_metrics=True, **ARGS)
    before = llm.llm_engine.get_stats().expert_load
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))  # the prompt's 12 positions, once
    after = llm.llm_engine.get_stats().expert_load
    counted = Counter({key: tokens - before.get(key, 0) for key, tokens in after.items()})
    assert +counted == _hf_top_k_counts(folder, PROMPT, top_k=2)
    assert LLM(str(folder), **ARGS).llm_engine.get_stats().expert_load is None  # off by default


def test_counting_adds_no_host_read_to_the_moe_forward():
    layer = _layer(torch.float32)
    layer.expert_load = torch.zeros(8, dtype=torch.int64)
    x, logits = _inputs(torch.float32, 5)
    with HostReads() as reads:
        layer(x, logits)
    assert reads.calls == [] and int(layer.expert_load.sum()) == 5 * 2
    assert not layer.supports_graph_capture  # a recorded graph would stop adding


def test_a_model_without_experts_is_refused(tiny_checkpoints):
    with pytest.raises(ValueError, match="--enable-expert-load-metrics counts the tokens routed to MoE experts"):
        LLM(str(tiny_checkpoints["llama"]), enable_expert_load_metrics=True, **ARGS)


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory, tiny_tokenizer_dir):
    from conftest import make_tiny_checkpoint
    from remote_server import MAX_MODEL_LEN

    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("server_qwen3_moe"), tiny_tokenizer_dir, "qwen3_moe",
                                  max_position_embeddings=MAX_MODEL_LEN)
    log = tmp_path_factory.mktemp("expert_load_server") / "server.log"
    yield from running_server(folder, ["--served-model-name", "moe", "--dtype", "float32",
                                       "--enable-expert-load-metrics"], log)


def _expert_load(server) -> dict[tuple[str, str], float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    family = families["tengyun:expert_load_tokens"]
    assert family.type == "counter"
    return {(s.labels["layer"], s.labels["expert"]): s.value for s in family.samples
            if s.name == "tengyun:expert_load_tokens_total" and s.labels["model_name"] == "moe"}


def test_server_exports_tokens_per_layer_and_expert(moe_server):
    assert _expert_load(moe_server) == {}  # nothing served yet (the warm-up does not count)
    client = openai.OpenAI(base_url=moe_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    answer = client.completions.create(model="moe", prompt=PROMPT, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    forwarded = answer.usage.prompt_tokens + answer.usage.completion_tokens - 1  # the last token is not run
    load = _expert_load(moe_server)
    assert {layer for layer, _ in load} == {"0"}  # layer 1 is dense (mlp_only_layers)
    assert sum(load.values()) == 2 * forwarded  # top 2: each token counts at two experts
