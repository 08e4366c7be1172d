"""Build the work copy of vLLM's OpenAI entrypoint tests that runs against `tengyun serve`.

    python3 adapt.py --sdist /tmp/vept/vllm-0.11.0 --work /tmp/vept/work --hf-home /tmp/vept/hf-home \
        --tmpdir /tmp/vept/tmp --tengyun-python /work/main/.venv/bin/python

1. copies tests/ and examples/ (chat templates the tests read) of the unpacked sdist into --work;
   vllm/ is not copied, so `import vllm` in a test finds the installed wheel, not the sdist;
2. puts stand_in_utils.py over tests/utils.py and stand_in_conftest.py over tests/conftest.py,
   and writes a pytest.ini (vLLM's markers, which live in its pyproject.toml);
3. rewrites the model ids in the test files to the two models that run here offline
   (MODEL_MAP: string literals only, nothing else in a test changes), and writes the list of
   changed lines to --work/MODEL_REWRITES.txt;
4. makes an offline Hugging Face cache (--hf-home) holding both models under their hub ids
   (config, tokenizer and weights linked from Tengyun's converted folders), so the tests' own
   client-side `get_tokenizer(MODEL_NAME)` / `AutoTokenizer` / `ModelConfig` work with
   HF_HUB_OFFLINE=1, and the same under --tmpdir/qwen3_06b, the cache_dir that
   test_token_in_token_out.py passes to vLLM's download_weights_from_hf;
5. makes the pooling stand-ins (POOLING_STAND_INS) under --stand-ins: folders of the two models
   whose config.json says what the swapped-out model's does (a sequence classifier, a
   Qwen3-Reranker-style cross-encoder, a bare decoder that embeds), as `--hf-overrides` would
   (weights linked, nothing else changed): vLLM's tests serve those models without
   `--runner pooling`, because their architecture says they pool;
6. makes, for each hub LoRA repo the tests download (LORA_MAP), a real PEFT adapter for the
   stand-in of the adapter's base model (make_lora_adapter.py, run with --tengyun-python, which
   has peft), cached under --lora-cache, and writes --work/lora_adapters.json (repo id -> folder),
   which the stand-in conftest answers `snapshot_download` with.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QWEN = "Qwen/Qwen2.5-Coder-0.5B-Instruct"

# vLLM test model -> the embedded model that stands in for it. Qwen ids go to the Qwen model
# (same tokenizer family, Qwen chat template with tools), and so does zephyr-7b-beta, whose tests
# ask for a 10100-token context (SmolLM2 has 8192, Qwen2.5-Coder 32768, zephyr 32768); the rest
# (small Llama-like or OPT/GPT-2 models with at most 8192 tokens in their tests) to SmolLM2.
MODEL_MAP = {
    "HuggingFaceH4/zephyr-7b-beta": QWEN,
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": SMOL,
    "meta-llama/Llama-3.2-1B-Instruct": SMOL,
    "meta-llama/Llama-3.2-1B": SMOL,
    "facebook/opt-125m": SMOL,
    "openai-community/gpt2": SMOL,
    "gpt2": SMOL,
    "intfloat/multilingual-e5-small": SMOL,  # test_optional_middleware: its subject is the middleware
    "HuggingFaceTB/SmolVLM-256M-Instruct": SMOL,  # test_openai_schema: its subject is the OpenAPI schema
    "Qwen/Qwen2.5-1.5B-Instruct": QWEN,
    "Qwen/Qwen2-1.5B-Instruct": QWEN,
    "Qwen/Qwen3-0.6B": QWEN,
    "Qwen/QwQ-32B": QWEN,
    "openai/gpt-oss-20b": QWEN,
    "ibm-research/PowerMoE-3b": SMOL,  # test_multi_api_servers: its subject is --api-server-count
    # pooling (tests/entrypoints/pooling): embedding models served with --runner pooling
    "sentence-transformers/all-MiniLM-L12-v2": SMOL,
    "Snowflake/snowflake-arctic-embed-m-v1.5": SMOL,
    # ... and models whose architecture pools: the stand-in folders below ({stand_ins} is --stand-ins)
    "jason9693/Qwen2.5-1.5B-apeach": "{stand_ins}/Qwen2.5-Coder-0.5B-Instruct-classify",
    "BAAI/bge-reranker-base": "{stand_ins}/Qwen2.5-Coder-0.5B-Instruct-rerank",
    "BAAI/bge-reranker-v2-m3": "{stand_ins}/Qwen2.5-Coder-0.5B-Instruct-rerank",
    "BAAI/bge-base-en-v1.5": "{stand_ins}/SmolLM2-135M-Instruct-embed",
    "internlm/internlm2-1_8b-reward": "{stand_ins}/SmolLM2-135M-Instruct-reward",
}
# stand-in folder -> (the model it is made of, config.json changes). classify: two labels from the
# LM head's rows of "no" / "yes", named as the original's config.json names its labels
# (jason9693/Qwen2.5-1.5B-apeach is a 2-label Qwen2 classifier, "Default" / "Spoiled");
# rerank: the Qwen3-Reranker recipe (one label, sigmoid(yes - no); the bge rerankers are 1-label
# cross-encoders); embed: the decoder without its head (bge-base-en-v1.5 is a BertModel); reward:
# one value per token from the LM head's row of "yes" (internlm2-1_8b-reward gives one per token).
POOLING_STAND_INS = {
    "Qwen2.5-Coder-0.5B-Instruct-classify": (QWEN, {"architectures": ["Qwen2ForSequenceClassification"],
                                                   "classifier_from_token": ["no", "yes"],
                                                   "id2label": {"0": "Default", "1": "Spoiled"}}),
    "Qwen2.5-Coder-0.5B-Instruct-rerank": (QWEN, {"architectures": ["Qwen2ForSequenceClassification"],
                                                 "classifier_from_token": ["no", "yes"],
                                                 "is_original_qwen3_reranker": True}),
    "SmolLM2-135M-Instruct-embed": (SMOL, {"architectures": ["LlamaModel"]}),
    "SmolLM2-135M-Instruct-reward": (SMOL, {"architectures": ["LlamaForRewardModeling"],
                                            "classifier_from_token": ["yes"]}),
}
# hub LoRA repo the tests download -> the hub model it was trained on (its stand-in gets the adapter)
LORA_MAP = {"typeof/zephyr-7b-beta-lora": "HuggingFaceH4/zephyr-7b-beta"}
TEST_DIRS = ["tests/entrypoints/openai", "tests/v1/entrypoints/openai", "tests/entrypoints/pooling"]
PYTEST_INI = """[pytest]
markers =
    slow_test
    skip_global_cleanup
    core_model
    hybrid_model
    cpu_model
    split
    distributed
    skip_v1
    optional
"""


def copy_tree(sdist: Path, work: Path) -> None:
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    shutil.copytree(sdist / "tests", work / "tests")
    shutil.copytree(sdist / "examples", work / "examples")
    shutil.copy(HERE / "stand_in_utils.py", work / "tests" / "utils.py")
    shutil.copy(HERE / "stand_in_conftest.py", work / "tests" / "conftest.py")
    (work / "pytest.ini").write_text(PYTEST_INI)


def rewrite_models(work: Path, stand_ins: Path) -> list[str]:
    model_map = {k: v.format(stand_ins=stand_ins) for k, v in MODEL_MAP.items()}
    pattern = re.compile(r"""(["'])(%s)\1""" % "|".join(re.escape(k) for k in sorted(MODEL_MAP, key=len, reverse=True)))
    changes = []
    for d in TEST_DIRS:
        for path in sorted((work / d).rglob("*.py")):
            text = path.read_text()
            lines = text.splitlines(keepends=True)
            out = []
            for n, line in enumerate(lines, 1):
                new = pattern.sub(lambda m: m.group(1) + model_map[m.group(2)] + m.group(1), line)
                if new != line:
                    changes.append(f"{path.relative_to(work)}:{n}: {line.strip()}  ->  {new.strip()}")
                out.append(new)
            path.write_text("".join(out))
    (work / "MODEL_REWRITES.txt").write_text("\n".join(changes) + "\n")
    return changes


def tengyun_folders(tengyun_python: str) -> dict[str, Path]:
    code = ("import json; from tengyun.models.model_source import resolve_model; "
            f"print(json.dumps({{m: str(resolve_model(m).folder) for m in {[SMOL, QWEN]!r}}}))")
    env = dict(os.environ)
    if env.get("TENGYUN_SRC"):  # the same source snapshot the servers will run
        env["PYTHONPATH"] = env["TENGYUN_SRC"]
    out = subprocess.run([tengyun_python, "-c", code], check=True, capture_output=True, text=True, env=env).stdout
    return {k: Path(v) for k, v in json.loads(out.strip().splitlines()[-1]).items()}


def tokenizer_config_v4(path: Path) -> dict:
    """Tengyun writes its converted tokenizer with transformers 5 ("TokenizersBackend"); the
    tests' transformers (4.55, vLLM 0.11's pin) knows the same fast tokenizer by the old name."""
    cfg = json.loads(path.read_text())
    if cfg.get("tokenizer_class") == "TokenizersBackend":
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    return cfg


def model_config_v4(path: Path) -> dict:
    """The converted config.json has no `architectures` (vLLM's ModelConfig requires it) and keeps
    rope_theta in transformers 5's rope_parameters; put both back as the hub's config.json has them."""
    cfg = json.loads(path.read_text())
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(cfg.get("model_type"))
    if arch and not cfg.get("architectures"):
        cfg["architectures"] = [arch]
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    return cfg


def make_hub_cache(hub: Path, folders: dict[str, Path], skip=lambda name: False) -> None:
    revision = "0" * 40
    for hub_id, folder in folders.items():
        repo = hub / ("models--" + hub_id.replace("/", "--"))
        if repo.exists():
            shutil.rmtree(repo)
        snap = repo / "snapshots" / revision
        snap.mkdir(parents=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision)
        for f in folder.iterdir():
            if f.is_file() and not skip(f.name):
                if f.name == "tokenizer_config.json":
                    (snap / f.name).write_text(json.dumps(tokenizer_config_v4(f), indent=2))
                elif f.name == "config.json":
                    (snap / f.name).write_text(json.dumps(model_config_v4(f), indent=2))
                else:
                    (snap / f.name).symlink_to(f)


def make_pooling_stand_ins(stand_ins: Path, folders: dict[str, Path]) -> None:
    for name, (model, changes) in POOLING_STAND_INS.items():
        out = stand_ins / name
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for f in folders[model].iterdir():
            if f.name == "tokenizer_config.json":
                (out / f.name).write_text(json.dumps(tokenizer_config_v4(f), indent=2))
            elif f.name == "config.json":
                (out / f.name).write_text(json.dumps({**model_config_v4(f), **changes}, indent=2))
            elif f.is_file():
                (out / f.name).symlink_to(f)


def make_lora_adapters(work: Path, hub: Path, lora_cache: Path, tengyun_python: str) -> dict[str, str]:
    """A PEFT adapter per LORA_MAP repo, made for the base model's stand-in (cached: made once)."""
    adapters = {}
    for repo_id, base in LORA_MAP.items():
        stand_in = MODEL_MAP[base]
        snapshot = next((hub / ("models--" + stand_in.replace("/", "--")) / "snapshots").iterdir())
        out = lora_cache / (repo_id.replace("/", "--") + "--for--" + stand_in.replace("/", "--"))
        if not (out / "adapter_model.safetensors").is_file():
            subprocess.run([tengyun_python, str(HERE / "make_lora_adapter.py"), "--base-config", str(snapshot),
                            "--out", str(out)], check=True)
        adapters[repo_id] = str(out)
    (work / "lora_adapters.json").write_text(json.dumps(adapters, indent=2) + "\n")
    return adapters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sdist", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--hf-home", type=Path, required=True)
    ap.add_argument("--tmpdir", type=Path, required=True)
    ap.add_argument("--tengyun-python", default="/work/main/.venv/bin/python")
    ap.add_argument("--stand-ins", type=Path, default=None, help="pooling stand-in folders [--work/../stand-ins]")
    ap.add_argument("--lora-cache", type=Path, default=Path.home() / ".cache" / "vllm-entrypoint-tests" / "lora")
    a = ap.parse_args()
    copy_tree(a.sdist, a.work)
    stand_ins = (a.stand_ins or a.work.parent / "stand-ins").resolve()
    changes = rewrite_models(a.work, stand_ins)
    folders = tengyun_folders(a.tengyun_python)
    make_pooling_stand_ins(stand_ins, folders)
    make_hub_cache(a.hf_home / "hub", folders)
    a.tmpdir.mkdir(parents=True, exist_ok=True)
    make_hub_cache(a.tmpdir / "qwen3_06b", {QWEN: folders[QWEN]},
                   skip=lambda n: n.startswith(("tokenizer", "vocab")) or n.endswith(".safetensors"))
    adapters = make_lora_adapters(a.work, a.hf_home / "hub", a.lora_cache, a.tengyun_python)
    print(f"work copy {a.work}: {len(changes)} model-id lines rewritten (MODEL_REWRITES.txt); "
          f"HF cache {a.hf_home} holds {', '.join(folders)}; LoRA adapters {adapters}")


if __name__ == "__main__":
    main()
