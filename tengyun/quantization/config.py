"""Which quantisation format a checkpoint is in, and the registry of the formats Tengyun reads.

Detected as vLLM does: config.json's ``quantization_config.quant_method`` names the format;
``--quantization`` forces one (it must agree with config.json when config.json names one; a
format whose description lives in a side file, such as ModelSlim's quant_model_description.json,
is read from the model folder). A format registers ``(quantization_config dict, model folder) ->
QuantConfig`` in QUANT_METHODS; the QuantConfig says per checkpoint module which LinearScheme it
holds (scheme.py). Torch-free: `tengyun plan` reads it too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from tengyun.model_spec import text_model_name
from tengyun.quantization.scheme import LinearScheme


class QuantizationError(ValueError):
    """A checkpoint's quantisation that Tengyun cannot run, or that disagrees with its tensors."""


@dataclass(frozen=True)
class QuantGroup:
    targets: tuple[str, ...]  # "Linear" (every linear layer), a module name, or "re:<regex>"
    scheme: LinearScheme | None  # None: the targets are stored unquantised (GPTQModel's "-:" dynamic entries)


@dataclass(frozen=True)
class QuantConfig:
    method: str  # the registry key, e.g. "compressed-tensors"
    groups: tuple[QuantGroup, ...]
    ignore: tuple[str, ...] = ()  # module names or "re:<regex>" kept unquantised (e.g. "lm_head")
    # The embedding and LM head may be stored quantised too, by their module names
    # (model.embed_tokens, lm_head): a GGUF's token_embd / output, as vLLM's GGUF loader keeps
    # them. Other formats quantise linear layers only (vLLM's ParallelLMHead is not a LinearBase),
    # except that compressed-tensors stores an untied LM head quantised when a group's targets name
    # it (head_scheme).
    vocab_layers: bool = False
    named_head: bool = False  # the LM head is quantised where a target names it (not "Linear")
    # The checkpoint modules fused into one layer (q/k/v_proj -> qkv_proj) may be stored in different
    # schemes, each then held as its own shard (a GGUF's Q4_K_M: Q6_K v_proj, Q4_K q_proj), as vLLM's
    # GGUF loader allows. Other formats give them one scheme (vLLM refuses a mix as well).
    mixed_shards: bool = False

    def scheme_for(self, module: str) -> LinearScheme | None:
        """The scheme of the linear layer the checkpoint stores as ``module``
        (model.layers.0.mlp.down_proj); None: it is stored unquantised. The first group whose
        targets match decides."""
        if self.ignores(module):
            return None
        for group in self.groups:
            if any(target == "Linear" or _matches(module, target) for target in group.targets):
                return group.scheme
        return None

    def head_scheme(self, module: str) -> LinearScheme | None:
        """The scheme an untied LM head stored as ``module`` (lm_head) is held in; None: dense. A
        GGUF's (vocab_layers) as any module; compressed-tensors' where a group's targets name it by
        name or "re:" pattern and the ignore list does not, as vLLM matches its ParallelLMHead
        ("Linear" targets linear layers only; llm-compressor's default ignore list holds lm_head)."""
        if self.vocab_layers:
            return self.scheme_for(module)
        if not self.named_head or self.ignores(module):
            return None
        for group in self.groups:
            if any(target != "Linear" and _matches(module, target) for target in group.targets):
                return group.scheme
        return None

    def renamed(self, rename: Callable[[str], str]) -> "QuantConfig":
        """This config with its explicit module names (targets and ignore list; not "Linear" or
        "re:" patterns) as ``rename`` maps checkpoint names to Tengyun's, as vLLM maps a quant
        config's names through its model's hf_to_vllm_mapper."""
        def names(patterns: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(p if p == "Linear" or p.startswith("re:") else rename(p) for p in patterns)

        return replace(self, groups=tuple(QuantGroup(names(g.targets), g.scheme) for g in self.groups),
                       ignore=names(self.ignore))

    def ignores(self, module: str) -> bool:
        """Does the ignore list keep checkpoint module ``module`` unquantised?"""
        return any(_matches(module, pattern) for pattern in self.ignore)

    @property
    def kernels(self) -> tuple[str, ...]:
        """The kernel kinds this checkpoint's layers need (LinearScheme.kernel)."""
        return tuple(sorted({g.scheme.kernel for g in self.groups if g.scheme is not None}))

    def describe(self) -> str:
        return "; ".join(sorted({g.scheme.description for g in self.groups if g.scheme is not None}))


def _matches(name: str, pattern: str) -> bool:
    """compressed-tensors / vLLM target matching: "re:<regex>" matches from the start, anything
    else matches the whole name."""
    return bool(re.match(pattern[3:], name)) if pattern.startswith("re:") else name == pattern


def _compressed_tensors(quant: Mapping[str, Any], folder: Path | None) -> QuantConfig:
    from tengyun.quantization import compressed_tensors

    return compressed_tensors.from_config(quant)


# quant_method (--quantization) -> reader of its quantization_config
QUANT_METHODS: dict[str, Callable[[Mapping[str, Any], Path | None], QuantConfig]] = {
    "compressed-tensors": _compressed_tensors,
}


# ----- AutoAWQ (GEMM) and AutoGPTQ / GPTQModel: tengyun/quantization/awq.py, gptq.py ---------------
def _side_file(quant: Mapping[str, Any], folder: Path | None, name: str) -> Mapping[str, Any]:
    """config.json's section, or (older AutoGPTQ / AutoAWQ folders, with --quantization) ``name``
    beside it."""
    if quant or folder is None or not (Path(folder) / name).is_file():
        return quant
    import json

    return json.loads((Path(folder) / name).read_text())


def _awq(quant: Mapping[str, Any], folder: Path | None) -> QuantConfig:
    from tengyun.quantization import awq

    return awq.from_config(_side_file(quant, folder, "quant_config.json"))


def _gptq(quant: Mapping[str, Any], folder: Path | None) -> QuantConfig:
    from tengyun.quantization import gptq

    return gptq.from_config(_side_file(quant, folder, "quantize_config.json"))


QUANT_METHODS.update(awq=_awq, gptq=_gptq)


def _gguf(quant: Mapping[str, Any], folder: Path | None) -> QuantConfig:
    from tengyun.quantization import gguf

    return gguf.from_config(quant, folder)


QUANT_METHODS["gguf"] = _gguf  # a .gguf converted keeping its blocks (tengyun/quantization/gguf.py)


def quantization_section(hf_config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """config.json's quantization_config (top level, or in a multimodal model's text_config)."""
    section = hf_config.get("quantization_config") or (hf_config.get("text_config") or {}).get("quantization_config")
    return section if isinstance(section, Mapping) else None


def detect_quantization(hf_config: Mapping[str, Any], forced: str | None = None,
                        folder: Path | None = None) -> QuantConfig | None:
    """config.json (and --quantization ``forced``) -> the checkpoint's QuantConfig; None when it
    is not quantised. Raises QuantizationError naming the field and the supported values."""
    section = quantization_section(hf_config)
    side = side_file_method(folder)
    stated = (section.get("quant_method") or side or "unknown") if section else side
    if forced and stated and forced != stated:
        raise QuantizationError(
            f"--quantization {forced} disagrees with config.json's quantization_config.quant_method "
            f"{stated!r}: drop --quantization (the checkpoint says what it holds) or pass --quantization {stated}.")
    method = forced or stated
    if method is None:
        return None
    if method not in QUANT_METHODS:
        raise QuantizationError(
            f"quantization method {method!r} (config.json quantization_config.quant_method, or --quantization) "
            f"is not supported; Tengyun reads: {', '.join(sorted(QUANT_METHODS))}.")
    # a multimodal checkpoint names its text layers model.language_model.*: Tengyun's text model's names
    return QUANT_METHODS[method](section or {}, folder).renamed(text_model_name)


# ----- Ascend msModelSlim: quant_model_description.json beside the weights (modelslim.py) ---------
def _ascend(quant: Mapping[str, Any], folder: Path | None) -> QuantConfig:
    from tengyun.quantization import modelslim

    return modelslim.from_folder(folder)


QUANT_METHODS["ascend"] = _ascend
# a side file in the model folder that names the method when config.json names none (vLLM-Ascend's
# --quantization ascend, which SGLang and vLLM-Ascend on NPUs detect from the file)
SIDE_FILE_METHODS = {"quant_model_description.json": "ascend"}


def side_file_method(folder: Path | str | None) -> str | None:
    if folder is None:
        return None
    return next((method for name, method in SIDE_FILE_METHODS.items() if (Path(folder) / name).is_file()), None)
