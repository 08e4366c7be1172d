"""Stand-in for vLLM's top-level tests/conftest.py (adapt.py copies it over that file).

vLLM's own builds GPU test runners (vllm.LLM, HF models, dist cleanup after every test); the
OpenAI entrypoint tests need none of it. This one:
- answers `huggingface_hub.snapshot_download` for LoRA adapter repos with an empty folder, so a
  server fixture that asks for one can start (LoRA flags are dropped by the stand-in
  RemoteOpenAIServer; the LoRA tests themselves are skipped below);
- skips, with the reason shown in the report, the tests that are out of scope or that do not
  exercise a server at all (listed in SKIPS).
"""

from __future__ import annotations

import tempfile

import huggingface_hub
import pytest

_real_snapshot_download = huggingface_hub.snapshot_download


def _snapshot_download(repo_id: str, *args, **kwargs):
    if "lora" in repo_id.lower():
        return tempfile.mkdtemp(prefix="stand-in-lora-")
    return _real_snapshot_download(repo_id, *args, **kwargs)


huggingface_hub.snapshot_download = _snapshot_download

# (substring of the test's node id, reason). Whole files out of scope are not collected at all
# (run.sh names them); these are single tests inside files that are run.
SKIPS = [
    ("zephyr-lora", "out of scope: LoRA adapter"),
    ("test_models.py::test_check_models", "out of scope: asserts the LoRA adapter's /v1/models entry"),
    ("test_metrics.py::test_metrics_exist_run_batch",
     "out of scope: vLLM's run_batch CLI on an embedding model (no server fixture)"),
    ("test_prompt_validation.py::test_load_prompt_embeds",
     "not a server test: vLLM's BaseRenderer called in-process"),
    ("test_serving_chat.py::test_async_serving_chat_init", "not a server test: vLLM's OpenAIServingChat in-process"),
    ("test_serving_chat.py::test_serving_chat_", "not a server test: vLLM's OpenAIServingChat in-process"),
]


def pytest_collection_modifyitems(config, items):
    for item in items:
        for pattern, reason in SKIPS:
            if pattern in item.nodeid:
                item.add_marker(pytest.mark.skip(reason=reason))
                break
