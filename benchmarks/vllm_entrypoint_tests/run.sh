#!/usr/bin/env bash
# Run the in-scope files of vLLM 0.11.0's tests/entrypoints/openai, tests/v1/entrypoints/openai and
# tests/entrypoints/pooling/openai
# (work copy made by adapt.py) against `tengyun serve`, one pytest per file, and summarize.
#   WORK=/tmp/vept/work OUT=/tmp/vept/results bash run.sh [FILE ...]
# Environment (defaults in brackets): WORK [/tmp/vept/work], OUT [/tmp/vept/results],
# VENV [/tmp/vllm-tests-venv], HF_HOME [/tmp/vept/hf-home], TMPDIR [/tmp/vept/tmp],
# TENGYUN_PYTHON [/work/main/.venv/bin/python], TENGYUN_SRC [unset: the installed tengyun],
# PER_TEST_TIMEOUT [240 s], PER_FILE_TIMEOUT [2400 s], STAND_IN_START_TIMEOUT [240 s: the server start wait].
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK=${WORK:-/tmp/vept/work}
OUT=${OUT:-/tmp/vept/results}
VENV=${VENV:-/tmp/vllm-tests-venv}
export HF_HOME=${HF_HOME:-/tmp/vept/hf-home} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TMPDIR=${TMPDIR:-/tmp/vept/tmp}
export TENGYUN_PYTHON=${TENGYUN_PYTHON:-/work/main/.venv/bin/python}
export TENGYUN_SRC=${TENGYUN_SRC:-}
PER_TEST_TIMEOUT=${PER_TEST_TIMEOUT:-240}
PER_FILE_TIMEOUT=${PER_FILE_TIMEOUT:-2400}
mkdir -p "$OUT" "$TMPDIR"

E=tests/entrypoints/openai
V=tests/v1/entrypoints/openai
P=tests/entrypoints/pooling/openai
# Out of scope, not collected (see README): LoRA beyond adapters on the stand-in model
# (test_lora_resolvers: vLLM's resolver plugins in-process; test_default_mm_loras: audio;
# test_tensorizer_entrypoint: tensorizer; tool_parsers/test_hermes_tool_parser: a trained hub adapter
# and its tokenizer), pooling beyond the server routes (pooling/llm: vLLM's LLM in-process,
# pooling/correctness: MTEB data sets, pooling/openai/test_embedding_dimensions: every test compares
# with HF on the original Matryoshka models, pooling/openai/test_vision_embedding: images),
# multimodal (test_audio, test_video, test_vision, test_transcription_validation,
# test_translation_validation, correctness/test_transcription_api_correctness,
# v1 test_completion_with_image_embeds, v1 responses/test_image), pooling (test_skip_tokenizer,
# test_run_batch), vLLM in-process unit tests (test_chat_template, test_cli_args,
# test_serving_models, tool_parsers/test_{hunyuan_a13b,llama3_json,llama4_pythonic,pythonic}_tool_parser),
# vLLM's plugin system (test_oot_registration), a hub data set (correctness/test_lmeval).
DEFAULT_FILES=(
  $E/test_basic.py $E/test_chat.py $E/test_chat_echo.py $E/test_chat_logit_bias_validation.py
  $E/test_chat_with_tool_reasoning.py $E/test_chunked_prompt.py $E/test_async_tokenization.py
  $E/test_completion_with_function_calling.py $E/test_completion_with_prompt_embeds.py
  $E/test_lora_adapters.py $E/test_metrics.py $E/test_models.py $E/test_optional_middleware.py $E/test_prompt_validation.py
  $E/test_return_token_ids.py $E/test_return_tokens_as_ids.py $E/test_root_path.py
  $E/test_token_in_token_out.py $E/test_tokenization.py $E/test_uds.py $E/test_shutdown.py
  $E/test_sleep.py $E/test_collective_rpc.py $E/test_serving_chat.py
  $E/test_response_api_with_harmony.py $E/test_response_api_mcp_tools.py
  $V/test_completion.py $V/test_chat_completion.py $V/test_multi_api_servers.py
  $V/responses/test_basic.py $V/responses/test_stateful.py $V/responses/test_structured_output.py
  $E/test_openai_schema.py
  $P/test_classification.py $P/test_embedding.py $P/test_embedding_long_text.py $P/test_pooling.py
  $P/test_rerank.py $P/test_score.py $P/test_truncation.py
)
FILES=("$@")
[ ${#FILES[@]} -eq 0 ] && FILES=("${DEFAULT_FILES[@]}")

cd "$WORK"
for f in "${FILES[@]}"; do
  name=$(echo "$f" | sed 's#^tests/##; s#/#__#g; s#\.py$##')
  echo "=== $f ($(date +%H:%M:%S))"
  timeout -k 30 "$PER_FILE_TIMEOUT" "$VENV/bin/python" -m pytest -p no:cacheprovider -rA \
    --timeout "$PER_TEST_TIMEOUT" --timeout-method signal \
    --junitxml "$OUT/$name.xml" "$f" >"$OUT/$name.log" 2>&1
  echo "    exit $? : $(grep -E '^=+ .*(passed|failed|error|skipped|deselected).* in ' "$OUT/$name.log" | tail -1)"
done
"$VENV/bin/python" "$HERE/summarize.py" "$OUT"
