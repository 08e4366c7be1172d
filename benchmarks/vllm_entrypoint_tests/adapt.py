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
   test_token_in_token_out.py passes to vLLM's download_weights_from_hf.
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
}
TEST_DIRS = ["tests/entrypoints/openai", "tests/v1/entrypoints/openai"]
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


def rewrite_models(work: Path) -> list[str]:
    pattern = re.compile(r"""(["'])(%s)\1""" % "|".join(re.escape(k) for k in sorted(MODEL_MAP, key=len, reverse=True)))
    changes = []
    for d in TEST_DIRS:
        for path in sorted((work / d).rglob("*.py")):
            text = path.read_text()
            lines = text.splitlines(keepends=True)
            out = []
            for n, line in enumerate(lines, 1):
                new = pattern.sub(lambda m: m.group(1) + MODEL_MAP[m.group(2)] + m.group(1), line)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sdist", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--hf-home", type=Path, required=True)
    ap.add_argument("--tmpdir", type=Path, required=True)
    ap.add_argument("--tengyun-python", default="/work/main/.venv/bin/python")
    a = ap.parse_args()
    copy_tree(a.sdist, a.work)
    changes = rewrite_models(a.work)
    folders = tengyun_folders(a.tengyun_python)
    make_hub_cache(a.hf_home / "hub", folders)
    a.tmpdir.mkdir(parents=True, exist_ok=True)
    make_hub_cache(a.tmpdir / "qwen3_06b", {QWEN: folders[QWEN]},
                   skip=lambda n: n.startswith(("tokenizer", "vocab")) or n.endswith(".safetensors"))
    print(f"work copy {a.work}: {len(changes)} model-id lines rewritten (MODEL_REWRITES.txt); "
          f"HF cache {a.hf_home} holds {', '.join(folders)}")


if __name__ == "__main__":
    main()
