#!/usr/bin/env bash
# Seconds one GGUF conversion takes in a fresh process and a fresh cache (transformers' import
# included): benchmarks/gguf_convert_time.sh REPO_DIR smollm2_gguf|qwen_coder_gguf True|False
# (REPO_DIR: a checkout with .venv, e.g. a git worktree of an older commit to compare against;
# True: kept quantised, --quantization gguf). Prints "<dir name> <model> dense|kept <seconds>".
set -euo pipefail
cd "$1" && TENGYUN_CACHE_DIR=$(mktemp -d) .venv/bin/python -c "
import logging, time; logging.basicConfig(level=logging.WARNING)
from tengyun.models import model_source as m
path = getattr(m, '$2')(); t = time.perf_counter(); m.convert_gguf(path, keep_quantized=$3)
print('$1'.split('/')[-1], '$2', 'kept' if $3 else 'dense', '%.1f s' % (time.perf_counter() - t))" 2>&1 | tail -1
