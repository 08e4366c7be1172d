"""Stand-in for vLLM's top-level tests/conftest.py (adapt.py copies it over that file).

vLLM's own builds GPU test runners (vllm.LLM, HF models, dist cleanup after every test); the
OpenAI entrypoint tests need none of it. This one:
- answers `huggingface_hub.snapshot_download` for the LoRA adapter repos the tests download with
  the real PEFT adapter adapt.py made for the stand-in model (lora_adapters.json beside tests/);
  a LoRA repo without one fails the test, naming it;
- skips, with the reason shown in the report, the tests that are out of scope or that do not
  exercise a server at all (listed in SKIPS);
- gives vLLM's `hf_runner` fixture, with HF transformers, to the tests that use it only to make
  their inputs (prompt embeddings) from the model the server runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub
import pytest

_real_snapshot_download = huggingface_hub.snapshot_download
_LORA_ADAPTERS = Path(__file__).resolve().parent.parent / "lora_adapters.json"


def _snapshot_download(repo_id: str, *args, **kwargs):
    adapters = json.loads(_LORA_ADAPTERS.read_text()) if _LORA_ADAPTERS.is_file() else {}
    if repo_id in adapters:
        return adapters[repo_id]
    if "lora" in repo_id.lower():
        raise FileNotFoundError(f"stand-in: no PEFT adapter made for LoRA repo {repo_id} (adapt.py LORA_MAP)")
    return _real_snapshot_download(repo_id, *args, **kwargs)


huggingface_hub.snapshot_download = _snapshot_download

# (substring of the test's node id, reason). Whole files out of scope are not collected at all
# (run.sh names them); these are single tests inside files that are run.
SKIPS = [
    ("test_metrics.py::test_metrics_exist_run_batch",
     "out of scope: vLLM's run_batch CLI on an embedding model (no server fixture)"),
    ("test_prompt_validation.py::test_load_prompt_embeds",
     "not a server test: vLLM's BaseRenderer called in-process"),
    ("test_serving_chat.py::test_async_serving_chat_init", "not a server test: vLLM's OpenAIServingChat in-process"),
    ("test_serving_chat.py::test_serving_chat_", "not a server test: vLLM's OpenAIServingChat in-process"),
]


# vLLM's hf_runner (HF transformers / sentence-transformers on the test's own model): a test that
# takes it compares the server's numbers with that model's, which the stand-in model cannot match
MODEL_SPECIFIC_FIXTURES = {"hf_runner": "model-specific: compares with HF transformers running the test's "
                                        "original model (the stand-in model gives other numbers)"}
# ... except files that take hf_runner only to make the request's inputs from the model the server runs
# (MODEL_NAME rewritten to the stand-in): there the HfRunner below runs HF transformers for real
HF_RUNNER_MAKES_INPUTS = ("test_completion_with_prompt_embeds.py",)


class HfRunner:
    """vLLM's HfRunner, the part the input-making tests use: HF transformers' AutoModelForCausalLM
    and the model's processor (its tokenizer, for a text model), on the CPU, in the dtype vLLM's
    runner picks for `dtype` (vLLM's own _get_and_verify_dtype: "auto" is bfloat16 for SmolLM2).
    get_prompt_embeddings(prompts) -> one [seq_len, hidden_size] tensor per prompt, as vLLM's: the
    model's input-embedding rows of the prompt's token ids (special tokens as the processor adds them)."""

    def __init__(self, model_name: str, dtype: str = "auto", **_ignored) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoProcessor
        from vllm.config.model import _get_and_verify_dtype

        self.model_name = model_name
        self.config = AutoConfig.from_pretrained(model_name)
        self.dtype = _get_and_verify_dtype(model_name, self.config, dtype=dtype, is_pooling_model=False)
        self.model = AutoModelForCausalLM.from_pretrained(model_name, torch_dtype=self.dtype)
        self.processor = AutoProcessor.from_pretrained(model_name, torch_dtype=self.dtype)
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)

    def get_prompt_embeddings(self, prompts: list[str]) -> list:
        # as vLLM's: outside no_grad, so the tensors the test sends still require grad
        return [self.model.get_input_embeddings()(self.processor(text=p, return_tensors="pt")["input_ids"]).squeeze(0)
                for p in prompts]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        del self.model


@pytest.fixture(scope="session")
def hf_runner():
    return HfRunner


def pytest_collection_modifyitems(config, items):
    for item in items:
        fixture = next((f for f in MODEL_SPECIFIC_FIXTURES if f in item.fixturenames), None)
        if fixture is not None and not any(name in item.nodeid for name in HF_RUNNER_MAKES_INPUTS):
            item.add_marker(pytest.mark.skip(reason=MODEL_SPECIFIC_FIXTURES[fixture]))
            continue
        for pattern, reason in SKIPS:
            if pattern in item.nodeid:
                item.add_marker(pytest.mark.skip(reason=reason))
                break
