"""`tengyun plan` of a pooling model: no LM head among the weights, pooled rows instead of logits in
the activation estimate; the same resolve as the engine (a Qwen3Model pools under --runner auto,
--hf-overrides applied before the architecture is read)."""

from __future__ import annotations

import json
import subprocess
import sys

from pooling_checkpoints import QWEN3_FIELDS, RERANKER_OVERRIDES, embed_checkpoint, reranker_checkpoint  # noqa: F401
from tengyun.config import EngineConfig

FLAGS = ["--device", "cuda", "--dtype", "float16", "--max-num-seqs", "8", "--json"]  # activation counted


def plan(model, *flags: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", "plan", str(model), *FLAGS, *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_plan_of_a_pooling_model_has_no_lm_head_and_no_logits(reranker_checkpoint):  # noqa: F811
    generate = plan(reranker_checkpoint)
    pooling = plan(reranker_checkpoint, "--runner", "pooling")
    hidden, vocab = QWEN3_FIELDS["hidden_size"], QWEN3_FIELDS["vocab_size"]
    assert generate["stages"][0]["params"]["lm_head"] == vocab * hidden
    assert pooling["stages"][0]["params"]["lm_head"] == 0
    assert generate["activation_bytes"] - pooling["activation_bytes"] == 8 * (vocab - hidden) * 4
    assert pooling["stages"][0]["weight_bytes"] == generate["stages"][0]["weight_bytes"] - vocab * hidden * 2


def test_plan_reads_the_architecture_after_hf_overrides(reranker_checkpoint, embed_checkpoint):  # noqa: F811
    overridden = plan(reranker_checkpoint, "--hf-overrides", json.dumps(RERANKER_OVERRIDES))
    assert overridden["architecture"] == "Qwen3ForSequenceClassification"
    assert overridden["stages"][0]["params"]["lm_head"] == 0
    assert plan(embed_checkpoint)["stages"][0]["params"]["lm_head"] == 0  # Qwen3Model pools under auto


def test_the_engine_sizes_a_pooling_model_as_plan_does(embed_checkpoint):  # noqa: F811
    config = EngineConfig(str(embed_checkpoint), kv_cache_memory="64MiB", dtype="float32", max_num_seqs=8).finalize()
    assert config.sizing.pooling
    assert plan(embed_checkpoint)["max_concurrency"] >= 1
