#!/usr/bin/env bash
# CUDA-path check for a machine with an NVIDIA GPU (not run yet: no GPU was available when
# this was written). Runs the HF-parity tests with the engine on the GPU (device "auto"
# picks CUDA when torch sees one; the HF reference stays on the CPU) and the offline
# throughput benchmark, and records both under benchmarks/results/gpu-<date>.txt.
#   bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
out="benchmarks/results/gpu-$(date -u +%Y%m%d-%H%M).txt"
{
  echo "# $(date -u) $(git rev-parse --short HEAD)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
  "$PY" -m pytest -q -p no:cacheprovider tests/models/test_hf_parity.py tests/models/test_qwen3_5.py \
    tests/engine/test_llm_engine.py 2>&1 | tail -5
  "$PY" benchmarks/offline_throughput.py --systems tengyun --model smollm2 2>&1 | tail -5
} | tee "$out"
echo "recorded in $out"
