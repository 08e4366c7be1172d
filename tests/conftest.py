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


def read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())
