"""Shared fixtures: a tiny byte-level BPE tokenizer and tiny random-weight HF checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TINY_VOCAB = 384
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "人工智能正在改变世界。北京是中国的首都。",
    "Hello world! 😀 Emoji and 中文 mixed text.",
] * 20

ARCH_CONFIGS = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False, head_dim=32),
    # 8 experts, top-2, renormalised; layer 1 stays dense (mlp_only_layers).
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], tie_word_embeddings=False,
                      head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, mlp_only_layers=[1]),
}


# Qwen3.5: 4 layers (3 Gated DeltaNet, 1 gated attention), 2 key / 4 value linear heads.
QWEN3_5_TEXT = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                    linear_conv_kernel_dim=4, max_position_embeddings=256, rms_norm_eps=1e-6,
                    initializer_range=0.1, bos_token_id=0, eos_token_id=0)
# Qwen3.5-MoE adds 8 experts, top-2, and a shared expert on every layer.
QWEN3_5_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
# Qwen3-Next: Qwen3.5-MoE's sizes, every 2nd layer full attention, layer 0 dense.
QWEN3_NEXT = dict(QWEN3_5_TEXT, **QWEN3_5_MOE, mlp_only_layers=[0], decoder_sparse_step=1, full_attention_interval=2)


def make_tiny_qwen3_5(arch: str = "qwen3_5", seed: int = 0, **overrides):
    """A tiny random HF Qwen3.5 (arch "qwen3_5") or Qwen3.5-MoE ("qwen3_5_moe") text model, fp32, eval mode."""
    import torch
    import transformers

    torch.manual_seed(seed)
    if arch == "qwen3_5":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**{**QWEN3_5_TEXT, **overrides}))
    else:
        config = transformers.Qwen3_5MoeTextConfig(**{**QWEN3_5_TEXT, **QWEN3_5_MOE, **overrides})
        model = transformers.Qwen3_5MoeForCausalLM(config)
    return randomize_norms_and_routers(model).eval()


def randomize_norms_and_routers(model):
    """Norms start at 0 (zero-centred) or 1 and routers near 0: give them values so a wrong
    formula shows."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                        bos_token="<|endoftext|>")
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    folder = tmp_path_factory.mktemp("tiny_tokenizer")
    tokenizer.save_pretrained(folder)
    assert len(tokenizer) <= TINY_VOCAB
    return folder


def make_tiny_checkpoint(folder: Path, tokenizer_dir: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Save a random HF model of ``arch`` (fp32, safetensors) with the tiny tokenizer."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, initializer_range=0.3, bos_token_id=0, eos_token_id=0,
    )
    fields.update(ARCH_CONFIGS[arch])
    fields.update(overrides)
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "qwen2":  # give the qkv bias non-zero values so a missing bias shows
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.3)
    model.save_pretrained(folder, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, tiny_tokenizer_dir) -> dict[str, Path]:
    return {
        arch: make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny_{arch}"), tiny_tokenizer_dir, arch)
        for arch in ARCH_CONFIGS
    }


@pytest.fixture(scope="session")
def tiny_hybrid_checkpoints(tmp_path_factory, tiny_tokenizer_dir) -> dict[str, Path]:
    """Saved tiny Qwen3.5 and Qwen3.5-MoE checkpoints with the tiny tokenizer."""
    import shutil

    folders = {}
    for arch in ("qwen3_5", "qwen3_5_moe"):
        folders[arch] = tmp_path_factory.mktemp(f"tiny_{arch}")
        make_tiny_qwen3_5(arch).save_pretrained(folders[arch])
        for f in tiny_tokenizer_dir.iterdir():
            shutil.copy(f, folders[arch] / f.name)
    return folders


def free_port_pair() -> int:
    """A port p with p + 1 free too: --master-port and the node link (--master-port + 1), below
    the kernel's ephemeral range, so no outgoing connection (the TCP store's clients, HTTP) takes
    p + 1 between this check and the server binding it (seen: a full-suite run lost it so)."""
    import random
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) \
        if Path("/proc/sys/net/ipv4/ip_local_port_range").is_file() else 32768
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low - 1)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("", port))
                b.bind(("", port + 1))
                return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def plan_and_worker(folder, dtype: str):
    """`tengyun plan` of ``folder`` for this CPU, with the engine's own sizes and KV budget, beside
    the engine's Worker on it (2 MiB of KV cache, 128 tokens, 4 sequences, blocks of 16): what tests
    comparing the plan with the runtime build. -> (plan, its QuantConfig, worker)."""
    from tengyun.config import EngineConfig
    from tengyun.ops.plan import PlanRequest, make_plan, read_model, read_quantization
    from tengyun.worker.worker import Worker

    config = EngineConfig(str(folder), dtype=dtype, kv_cache_memory="2MiB", max_model_len=128, max_num_seqs=4,
                          block_size=16).finalize()
    worker = Worker(config)
    hf_config, checkpoint_bytes, name = read_model(folder)
    quant = read_quantization(folder, hf_config)
    plan = make_plan(hf_config, PlanRequest(
        device="cpu", dtype=dtype, block_size=16, max_model_len=128, max_num_seqs=4,
        max_num_batched_tokens=config.max_num_batched_tokens, kv_cache_memory=config.kv_cache_budget_bytes()),
        checkpoint_bytes, name, quant)
    return plan, quant, worker
