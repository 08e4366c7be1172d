"""--speculative-config method mtp on a tiny Qwen3.5 whose checkpoint carries ``mtp.*`` tensors
(config.json mtp_num_hidden_layers 1): the head's drafts equal a reference built from HF's own
Qwen3.5 modules; greedy tokens and logprobs are those without speculation (drafts rejected, and
with a head that copies the target, accepted) under chunked prefill and preemption; with TP 2 and
PP 2 worker processes, the drafts and tokens of one process. Qwen3-Next's head (same names, its
own decoder layer) passes the same checks."""

from __future__ import annotations

import json
import shutil
import tempfile

import pytest
import torch
from safetensors.torch import save_file

from conftest import QWEN3_5_MOE, QWEN3_5_TEXT, make_tiny_qwen3_5, randomize_norms_and_routers
from tengyun import LLM, SamplingParams

from spec_checks import assert_same_tokens_and_logprobs

PROMPTS = [[7, 7, 9, 7, 7, 9, 7], [5, 17, 29, 41, 5, 17, 29, 41, 5, 17], list(range(10, 50)),
           [100, 7, 101, 9, 102, 7, 103, 9]]
# Qwen3-Next as the releases: every layer MoE (the MTP layer too), every 2nd layer full attention.
NEXT = dict(QWEN3_5_TEXT, **QWEN3_5_MOE, decoder_sparse_step=1, mlp_only_layers=[], full_attention_interval=2)
SMALL = dict(block_size=8, max_model_len=104, num_gpu_blocks_override=13, max_num_batched_tokens=16, max_num_seqs=8)


class ReferenceMtp(torch.nn.Module):
    """The MTP head from HF modules: fc over [norm(embed) | norm(hidden)], then a one-layer
    Qwen3.5 text model (a full-attention layer and its final norm) over inputs_embeds."""

    def __init__(self, arch: str = "qwen3_5", seed: int = 1):
        import transformers
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

        super().__init__()
        torch.manual_seed(seed)
        one_layer = {**QWEN3_5_TEXT, "num_hidden_layers": 1, "layer_types": ["full_attention"]}
        if arch == "qwen3_5":
            wrapper = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**one_layer))
        elif arch == "qwen3_5_moe":  # the MoE model's MTP layer is an MoE layer too
            wrapper = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**one_layer, **QWEN3_5_MOE))
        else:  # Qwen3-Next's: its own decoder layer, MoE as layer 0's rule says
            wrapper = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**{**NEXT, **one_layer}))
        self.wrapper = randomize_norms_and_routers(wrapper).eval()  # saved by HF: its checkpoint names
        self.body = self.wrapper.model
        hidden = QWEN3_5_TEXT["hidden_size"]
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, QWEN3_5_TEXT["rms_norm_eps"])
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, QWEN3_5_TEXT["rms_norm_eps"])
        with torch.no_grad():
            for norm in (self.pre_fc_norm_embedding, self.pre_fc_norm_hidden):
                norm.weight.normal_(0.0, 0.1)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The checkpoint's mtp.* tensors: the one-layer model's as HF saves them (per expert)."""
        from safetensors.torch import load_file

        with tempfile.TemporaryDirectory() as folder:
            self.wrapper.save_pretrained(folder)
            saved = load_file(f"{folder}/model.safetensors")
        out = {"mtp." + k[len("model."):]: v for k, v in saved.items()
               if k.startswith(("model.layers.", "model.norm."))}
        out["mtp.fc.weight"] = self.fc.weight
        out["mtp.pre_fc_norm_embedding.weight"] = self.pre_fc_norm_embedding.weight
        out["mtp.pre_fc_norm_hidden.weight"] = self.pre_fc_norm_hidden.weight
        return {k: v.detach().clone().contiguous() for k, v in out.items()}

    @torch.no_grad()
    def drafts(self, target, token_ids: list[int], k: int) -> list[int]:
        """K greedy drafts after ``token_ids`` (L tokens): the head over positions 0..L-2, then
        one position per further draft, reading its own previous output."""
        ids = torch.tensor([token_ids])
        hidden = target.model(ids).last_hidden_state[0, :-1]  # h_0 .. h_{L-2}, final-normed
        embeds = target.model.embed_tokens(ids[0, 1:])  # t_1 .. t_{L-1}
        rows, drafts = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1)), []
        for _ in range(k):
            out = self.body(inputs_embeds=rows[None]).last_hidden_state[0, -1]
            drafts.append(int(target.lm_head(out).argmax()))
            step = torch.cat([self.pre_fc_norm_embedding(target.model.embed_tokens(torch.tensor(drafts[-1]))),
                              self.pre_fc_norm_hidden(out)])
            rows = torch.cat([rows, self.fc(step)[None]])
        return drafts


def save_with_mtp(folder, tokenizer_dir, head_tensors: dict, arch: str = "qwen3_5"):
    """Qwen3.5 says mtp_num_hidden_layers 1 in config.json; Qwen3-Next says nothing (the engine
    counts mtp.layers.N in the checkpoint, as vLLM assumes one)."""
    target = make_tiny_qwen3_5(arch) if arch != "qwen3_next" else make_tiny_qwen3_next()
    target.save_pretrained(folder)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    save_file(head_tensors, folder / "mtp.safetensors")
    if arch != "qwen3_next":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    return target


def make_tiny_qwen3_next():
    import transformers

    torch.manual_seed(0)
    return randomize_norms_and_routers(transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**NEXT))).eval()


def copying_head(reference: ReferenceMtp) -> dict[str, torch.Tensor]:
    """A head whose output is its hidden input (fc = [0 | I], attention and MLP outputs zero,
    norms plain): the draft is the target's own prediction at the position before, so in a run
    of repeated tokens drafts hold."""
    tensors = reference.tensors()
    hidden = QWEN3_5_TEXT["hidden_size"]
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")) or "norm" in name and "layernorm" not in name:
            tensors[name] = torch.zeros_like(tensors[name])
    tensors["mtp.fc.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
    return tensors


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def mtp_checkpoint(request, tmp_path_factory, tiny_tokenizer_dir):
    reference = ReferenceMtp(request.param)
    folder = tmp_path_factory.mktemp(f"{request.param}_mtp")
    return folder, save_with_mtp(folder, tiny_tokenizer_dir, reference.tensors(), request.param).eval(), reference


def _mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafts_equal_the_hf_reference_head(mtp_checkpoint, k):
    folder, target, reference = mtp_checkpoint
    llm = LLM(str(folder), dtype="float32", block_size=8, max_model_len=104, kv_cache_memory="1MiB",
              speculative_config=_mtp(k))
    engine = llm.llm_engine
    engine.add_request("r", PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.seqs.values():
            if seq.proposed_token_ids:
                assert seq.proposed_token_ids == reference.drafts(target, seq.token_ids, k), seq.token_ids
                checked += 1
    assert checked >= 4


def test_the_head_catches_up_in_prefill_steps_that_sample_nothing(mtp_checkpoint):
    """A 40-token prompt in 16-token chunks: the head's KV of every prompt position is what one
    40-token step writes (steps without a sampled token run the head too)."""
    def head_kv(step_tokens: int | None) -> torch.Tensor:
        llm = LLM(str(mtp_checkpoint[0]), dtype="float32", block_size=8, max_model_len=104, kv_cache_memory="1MiB",
                  speculative_config=_mtp(1), max_num_batched_tokens=step_tokens)
        llm.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=1))
        layer = next(m for m in llm.llm_engine.executor.runner.mtp.head.modules() if hasattr(m, "k_cache"))
        return torch.stack([layer.k_cache, layer.v_cache])

    whole, chunked = head_kv(None), head_kv(16)
    assert whole.abs().sum() > 0
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-4)


def test_greedy_tokens_and_logprobs_unchanged_with_rejected_mtp_drafts(mtp_checkpoint):
    folder, _, _ = mtp_checkpoint
    _assert_same_as_without_speculation(str(folder), accepted_at_least=0)


def test_greedy_tokens_unchanged_with_accepted_mtp_drafts(tmp_path, tiny_tokenizer_dir):
    save_with_mtp(tmp_path, tiny_tokenizer_dir, copying_head(ReferenceMtp()))
    _assert_same_as_without_speculation(str(tmp_path), accepted_at_least=5)


def _assert_same_as_without_speculation(path: str, accepted_at_least: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    outputs = {}
    for spec in (None, _mtp(2)):
        llm = LLM(path, dtype="float32", speculative_config=spec, **SMALL)
        outputs[spec is not None] = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    stats, engine_stats = llm.llm_engine.scheduler.spec_stats, llm.llm_engine.get_stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens >= accepted_at_least
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    assert engine_stats.num_preemptions > 0 and engine_stats.kv_cache_usage == 0.0
    assert_same_tokens_and_logprobs(outputs[False], outputs[True])


def _drafts_and_tokens(path: str, spec: dict | None, **engine_args) -> tuple[list, dict, object]:
    """Every step's drafts (per request, as the engine holds them after the step), each request's
    greedy tokens, and the engine's stats."""
    llm = LLM(path, dtype="float32", speculative_config=spec, **{**SMALL, **engine_args})
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    drafts, tokens = [], {}
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
            drafts.append(sorted((seq.request_id, seq.proposed_token_ids) for seq in engine.seqs.values()))
        return drafts, tokens, engine.get_stats()
    finally:
        engine.shutdown()


# The head runs on the last pipeline stage; at PP 2 that stage has no embedding, so the head loads
# its own copy. At TP 2 its attention heads, MLP (MoE: experts) split over the ranks; TP 2 x PP 2:
# both, the last stage's TP rank 1 learning the step's tokens from its TP rank 0.
@pytest.mark.parametrize("arch,head,tp,pp", [("qwen3_5", "copying", 2, 1), ("qwen3_5", "copying", 1, 2),
                                             ("qwen3_5", "copying", 2, 2), ("qwen3_5_moe", "random", 2, 1),
                                             ("qwen3_next", "random", 2, 1)])
def test_mtp_with_tp_and_pp_drafts_and_generates_as_one_process(tmp_path, tiny_tokenizer_dir, arch, head, tp, pp):
    reference = ReferenceMtp(arch)
    save_with_mtp(tmp_path, tiny_tokenizer_dir, copying_head(reference) if head == "copying" else reference.tensors(),
                  arch)
    _, expected, _ = _drafts_and_tokens(str(tmp_path), None)
    single_drafts, single_tokens, _ = _drafts_and_tokens(str(tmp_path), _mtp(2))
    drafts, tokens, stats = _drafts_and_tokens(str(tmp_path), _mtp(2), tensor_parallel_size=tp,
                                               pipeline_parallel_size=pp)
    assert tokens == single_tokens == expected
    assert drafts == single_drafts
    assert stats.spec_decode.num_draft_tokens > 0 and stats.num_preemptions > 0
    if head == "copying":
        assert 0 < stats.spec_decode.num_accepted_tokens < stats.spec_decode.num_draft_tokens


def test_the_heads_kv_cache_comes_out_of_the_kv_budget(mtp_checkpoint):
    """Tiny Qwen3.5 has one attention layer (Qwen3-Next two); the head adds one: the same budget
    holds 1/2 (2/3) of the blocks (the state slots come first and are the same)."""
    folder = str(mtp_checkpoint[0])
    blocks = {spec is not None: LLM(folder, dtype="float32", block_size=8, max_model_len=104, kv_cache_memory="1MiB",
                                    max_num_seqs=2,
                                    speculative_config=spec).llm_engine.get_stats().num_kv_blocks
              for spec in (None, _mtp(1))}
    layers = 2 if "next" in folder else 1
    assert blocks[True] in (blocks[False] * layers // (layers + 1), blocks[False] * layers // (layers + 1) + 1)


def test_server_with_mtp_answers_the_openai_client_as_without_it(mtp_checkpoint, tmp_path):
    """`--speculative-config '{"method": "mtp", ...}'` on the real API server, the openai SDK as client."""
    import sys
    from pathlib import Path

    import httpx
    import openai

    sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints" / "openai"))
    from remote_server import RemoteServer

    folder = mtp_checkpoint[0]
    server = RemoteServer(folder, ["--served-model-name", "m", "--speculative-config", json.dumps(_mtp(2)),
                                   "--max-model-len", "104", "--dtype", "float32"], tmp_path / "server.log")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        texts = [client.completions.create(model="m", prompt=prompt, max_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text for prompt in PROMPTS]
        scraped = httpx.get(server.url + "/metrics", timeout=30).text
    finally:
        server.stop()
    expected = LLM(str(folder), dtype="float32", max_model_len=104, kv_cache_memory="1MiB").generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert texts == [e.outputs[0].text for e in expected]
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"}' in scraped
