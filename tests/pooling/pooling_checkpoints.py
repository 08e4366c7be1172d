"""Tiny random Qwen3 pooling checkpoints, saved by HF transformers (the reference):
an embedding model (Qwen3Model), a 3-label classifier (Qwen3ForSequenceClassification), and a
causal LM whose tokenizer knows "no" and "yes" (the Qwen3-Reranker conversion)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import ARCH_CONFIGS, TINY_VOCAB, make_tiny_checkpoint

QWEN3_FIELDS = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                    initializer_range=0.3, bos_token_id=0, eos_token_id=0, head_dim=32, tie_word_embeddings=False)
RERANKER_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                      "is_original_qwen3_reranker": True}
ENGINE = dict(dtype="float32", kv_cache_memory="32MiB", enforce_eager=True, max_model_len=128)


def save_hf_model(model, folder: Path, tokenizer_dir: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def qwen3_config(architecture: str, **extra):
    from transformers import Qwen3Config

    return Qwen3Config(**{**QWEN3_FIELDS, **extra, "architectures": [architecture]})


@pytest.fixture(scope="session")
def embed_checkpoint(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    import torch
    from transformers import Qwen3Model

    torch.manual_seed(1)
    model = Qwen3Model(qwen3_config("Qwen3Model")).eval()
    return save_hf_model(model, tmp_path_factory.mktemp("tiny_qwen3_embed"), tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def classify_checkpoint(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    import torch
    from transformers import Qwen3ForSequenceClassification

    torch.manual_seed(2)
    config = qwen3_config("Qwen3ForSequenceClassification", num_labels=3, pad_token_id=0)
    model = Qwen3ForSequenceClassification(config).eval()
    return save_hf_model(model, tmp_path_factory.mktemp("tiny_qwen3_cls"), tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def reranker_checkpoint(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """The tiny Qwen3 causal LM with "no" and "yes" added to its tokenizer (ids below TINY_VOCAB)."""
    return make_reranker(tmp_path_factory.mktemp("tiny_qwen3_reranker"), tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tied_reranker_checkpoint(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """As reranker_checkpoint, with the LM head tied to the embedding (as Qwen3-Reranker-0.6B's)."""
    return make_reranker(tmp_path_factory.mktemp("tiny_qwen3_reranker_tied"), tiny_tokenizer_dir,
                         tie_word_embeddings=True)


def make_reranker(folder: Path, tiny_tokenizer_dir: Path, **overrides) -> Path:
    from transformers import AutoTokenizer

    folder = make_tiny_checkpoint(folder, tiny_tokenizer_dir, "qwen3", **overrides)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["no", "yes"])
    assert len(tokenizer) <= TINY_VOCAB
    tokenizer.save_pretrained(folder)
    assert ARCH_CONFIGS["qwen3"]["architectures"] == ["Qwen3ForCausalLM"]
    return folder
