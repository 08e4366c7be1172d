"""Pooling models, as vLLM's --runner pooling: which runner and conversion a checkpoint gets, and how
its pooler turns hidden states into an output. Torch-free: EngineConfig, the engine and `tengyun
plan` read it; tengyun/layers/pooler.py does the arithmetic.

    architecture                         --runner auto   --convert auto
    *ForCausalLM                         generate        (with --runner pooling) embed
    Qwen3Model, Qwen2Model, LlamaModel   pooling         embed
    *ForSequenceClassification           pooling         classify
    *ForRewardModeling, *RewardModel     pooling         reward

The pooler of each conversion, before --pooler-config and a sentence-transformers folder's
Pooling / Normalize modules change it (vLLM's defaults):
    embed      LAST, normalize                 -> one unit vector per prompt
    classify   LAST, activation (softmax over the labels; sigmoid with one label)
    reward     ALL, no normalize, no activation -> the score head's output per token
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

RUNNERS = ("auto", "generate", "pooling", "draft")
CONVERTS = ("auto", "none", "embed", "classify", "reward")
POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")
# Tasks each conversion serves (vLLM's PoolingTask names); "score" of an embedding model is the
# cosine similarity of two embeddings, computed by the caller.
TASKS = {"embed": ("embed", "encode", "score"), "classify": ("classify", "score", "encode"),
         "reward": ("encode", "reward")}
# Decoders saved without any head (Qwen3-Embedding's "Qwen3Model"); another *Model (GPT2LMHeadModel)
# is an architecture Tengyun does not run, refused by the model registry.
BARE_DECODERS = ("LlamaModel", "Qwen2Model", "Qwen3Model", "Qwen3MoeModel")
_POOLING_SUFFIXES = {"ForSequenceClassification": "classify", "ForRewardModeling": "reward",
                     "RewardModel": "reward", "ForTextEncoding": "embed", "EmbeddingModel": "embed"}
_DEFAULTS = {"embed": ("LAST", True, False), "classify": ("LAST", False, True), "reward": ("ALL", False, False)}
# sentence-transformers' 1_Pooling/config.json mode -> pooling type
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


@dataclass(frozen=True)
class PoolerConfig:
    """--pooler-config, vLLM 0.11's field names. None: the conversion's default."""

    pooling_type: str | None = None  # LAST / MEAN / CLS / ALL
    normalize: bool | None = None  # L2-normalise embeddings
    dimensions: int | None = None  # Matryoshka: the default output size of embeddings
    activation: bool | None = None  # classify: softmax / sigmoid over the labels
    softmax: bool | None = None  # vLLM's older name of activation
    enable_chunked_processing: bool | None = None  # embeddings: inputs longer than a chunk pooled per chunk
    max_embed_len: int | None = None  # embeddings: the longest input taken (with chunked processing)

    @classmethod
    def parse(cls, value: "PoolerConfig | Mapping[str, Any] | str | None") -> "PoolerConfig | None":
        """'{"pooling_type": "MEAN", "normalize": false}' (or the dict) -> PoolerConfig; ValueError naming the key."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        data = _json_object(value, "--pooler-config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"--pooler-config: {unknown[0]!r} is not a pooler setting Tengyun reads; use "
                             f"{', '.join(sorted(known))}.")
        config = cls(**data)
        if config.pooling_type is not None:
            object.__setattr__(config, "pooling_type", str(config.pooling_type).upper())
            if config.pooling_type not in POOLING_TYPES:
                raise ValueError(f"--pooler-config pooling_type must be one of {', '.join(POOLING_TYPES)}; "
                                 f"got {data['pooling_type']!r}.")
        for key in ("dimensions", "max_embed_len"):
            value = getattr(config, key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"--pooler-config {key} must be a positive integer; got {value!r}.")
        return config


def parse_hf_overrides(value: "Mapping[str, Any] | str | None") -> dict[str, Any]:
    """--hf-overrides '{"architectures": [...], ...}' (or the dict) -> dict; {} for None."""
    return {} if value is None else _json_object(value, "--hf-overrides")


def apply_hf_overrides(hf_config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """config.json with --hf-overrides merged in, as vLLM applies them: a key replaces the config's,
    except a dict over a dict (a sub-config such as text_config), which is merged key by key."""
    merged = dict(hf_config)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = apply_hf_overrides(merged[key], value)
        else:
            merged[key] = value
    return merged


def _json_object(value: "Mapping[str, Any] | str", flag: str) -> dict[str, Any]:
    if isinstance(value, Mapping):
        return dict(value)
    try:
        data = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON ({e}); give an object such as '{{\"key\": value}}'.") from None
    if not isinstance(data, dict):
        raise ValueError(f"{flag} must be a JSON object, got {value!r}.")
    return data


def resolve_runner(architecture: str, runner: str, convert: str) -> tuple[str, str]:
    """(runner, convert) for --runner / --convert auto, as vLLM decides them from the architecture.
    convert is "none" for a generating model. ValueError naming the flag for a combination that
    cannot run."""
    if runner == "draft":
        raise ValueError("--runner draft: a draft model runs through --speculative-config here; use --runner "
                         "generate (or auto).")
    suffix_convert = next((c for s, c in _POOLING_SUFFIXES.items() if architecture.endswith(s)), None)
    bare_model = architecture in BARE_DECODERS  # Qwen3Model: no head at all
    if runner == "auto":
        runner = "pooling" if suffix_convert or bare_model or convert not in ("auto", "none") else "generate"
    if runner == "generate":
        if suffix_convert or bare_model:
            raise ValueError(f"{architecture} has no language-model head to generate with: serve it with "
                             f"--runner pooling (embeddings, scores), or a *ForCausalLM checkpoint to generate.")
        if convert not in ("auto", "none"):
            raise ValueError(f"--convert {convert} turns the model into a pooling model: add --runner pooling.")
        return runner, "none"
    if convert in ("auto", "none"):
        convert = suffix_convert or "embed"
    return runner, convert


def base_architecture(architecture: str) -> str:
    """The *ForCausalLM class whose decoder a pooling architecture shares:
    Qwen3Model / Qwen3ForSequenceClassification -> Qwen3ForCausalLM."""
    if architecture in BARE_DECODERS:
        return architecture.removesuffix("Model") + "ForCausalLM"
    for suffix in (*_POOLING_SUFFIXES, "ForCausalLM"):
        if architecture.endswith(suffix):
            return architecture[: -len(suffix)] + "ForCausalLM"
    return architecture


@dataclass(frozen=True)
class PoolingModel:
    """How a pooling model turns its last hidden states into outputs, resolved once at start-up."""

    convert: str  # embed / classify / reward
    pooling_type: str  # LAST / MEAN / CLS / ALL
    normalize: bool  # embed: L2-normalise
    activation: bool  # classify: softmax over the labels (sigmoid with one)
    dimensions: int | None  # embed: default output size (--pooler-config dimensions); None: hidden size
    matryoshka_dimensions: tuple[int, ...] | None  # config.json matryoshka_dimensions; None: any (or none)
    is_matryoshka: bool  # requests may ask for `dimensions`
    num_labels: int  # classify / reward: rows of the score head
    id2label: tuple[str, ...]  # label names, by index
    classifier_from_token: tuple[str, ...] | None  # score head built from these tokens' LM-head rows
    original_qwen3_reranker: bool  # Qwen3-Reranker: one label, the rows of "yes" minus "no"
    chunked_processing: bool = False  # embed: /v1/embeddings pools a long input per chunk (embedding_chunks.py)
    max_embed_len: int | None = None  # embed, chunked: the longest input taken; None: --max-model-len

    @property
    def tasks(self) -> tuple[str, ...]:
        return TASKS[self.convert]

    def describe(self) -> str:
        what = {"embed": f"embeddings ({'normalized' if self.normalize else 'not normalized'})",
                "classify": f"{self.num_labels} label(s)", "reward": "rewards per token"}[self.convert]
        return f"--convert {self.convert}: {self.pooling_type} pooling, {what}"


def resolve_pooling_model(convert: str, hf_config: Mapping[str, Any], user: PoolerConfig | None,
                          folder: Path | None) -> PoolingModel:
    """The pooler of a model converted by ``convert``: the conversion's defaults, then a
    sentence-transformers folder's modules, then --pooler-config (``user``)."""
    pooling_type, normalize, activation = _DEFAULTS[convert]
    st_type, st_normalize = _sentence_transformers_pooling(folder) if folder is not None else (None, None)
    pooling_type = st_type or pooling_type
    normalize = normalize if st_normalize is None else st_normalize
    user = user or PoolerConfig()
    pooling_type = user.pooling_type or pooling_type
    normalize = normalize if user.normalize is None else user.normalize
    activation = next((v for v in (user.activation, user.softmax) if v is not None), activation)
    from_token = tuple(hf_config.get("classifier_from_token") or ()) or None
    reranker = bool(hf_config.get("is_original_qwen3_reranker"))
    if reranker and (from_token is None or len(from_token) != 2):
        raise ValueError('--hf-overrides is_original_qwen3_reranker needs classifier_from_token with two tokens, '
                         'as ["no", "yes"].')
    labels = hf_config.get("id2label") or {}
    num_labels = 1 if reranker else len(from_token) if from_token else int(hf_config.get("num_labels") or len(labels)
                                                                             or (1 if convert == "reward" else 2))
    matryoshka = hf_config.get("matryoshka_dimensions")
    return PoolingModel(
        convert=convert, pooling_type=pooling_type, normalize=bool(normalize), activation=bool(activation),
        dimensions=user.dimensions, matryoshka_dimensions=tuple(matryoshka) if matryoshka else None,
        is_matryoshka=bool(hf_config.get("is_matryoshka") or matryoshka), num_labels=num_labels,
        id2label=tuple(str(labels.get(str(i), labels.get(i, f"LABEL_{i}"))) for i in range(num_labels)),
        classifier_from_token=from_token, original_qwen3_reranker=reranker,
        chunked_processing=bool(user.enable_chunked_processing) and convert == "embed",
        max_embed_len=user.max_embed_len)


def _sentence_transformers_pooling(folder: Path) -> tuple[str | None, bool | None]:
    """(pooling type, normalize) from a sentence-transformers folder's modules.json; (None, None) without one."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None, None
    modules = json.loads(modules_file.read_text())
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    pooling_type = None
    for module in modules:
        if str(module.get("type", "")).endswith("Pooling"):
            config_file = folder / module.get("path", "") / "config.json"
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
            pooling_type = next((t for key, t in _ST_MODES.items() if config.get(key)), None)
    return pooling_type, normalize
