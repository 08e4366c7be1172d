#!/usr/bin/env bash
# CUDA-path check for a machine with an NVIDIA GPU (not run yet: no GPU was available when
# this was written). Records under benchmarks/results/gpu-<date>.txt:
#  1. which optional kernels import (flash_attn, fla) and the torch / CUDA versions;
#  2. the HF-parity tests with the engine on the GPU (device "auto" picks CUDA; the HF reference
#     stays on the CPU; fp32 tiny models, so attention is torch_sdpa and decode graphs are off);
#  3. SmolLM2 in bfloat16, decode graphs on vs --enforce-eager (flash_attn and 256-token blocks
#     when flash_attn imports): greedy tokens compared, output tok/s of each;
#  4. the offline throughput benchmark;
#  5. (with 3) each engine's memory report: the profile step's peak through torch.cuda's allocator
#     statistics (worker/memory_profile.py), beside the estimate.
#   bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
out="benchmarks/results/gpu-$(date -u +%Y%m%d-%H%M).txt"
{
  echo "# $(date -u) $(git rev-parse --short HEAD)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c "import importlib.util as u, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.is_available(), 'flash_attn', bool(u.find_spec('flash_attn')), 'fla', bool(u.find_spec('fla')))"
  "$PY" -m pytest -q -p no:cacheprovider tests/models/test_hf_parity.py tests/models/test_qwen3_5.py \
    tests/engine/test_llm_engine.py 2>&1 | tail -5
  "$PY" - <<'PYEOF' 2>&1 | grep -v "^INFO"
import gc
import time

import torch
from tengyun import LLM, SamplingParams

prompts = [[(7 * i + j) % 20000 + 100 for j in range(64 + 8 * i)] for i in range(48)]
params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
results = {}
for eager in (True, False):
    llm = LLM("HuggingFaceTB/SmolLM2-135M-Instruct", dtype="bfloat16", enforce_eager=eager, max_model_len=512, gpu_memory_utilization=0.5)
    llm.generate(prompts[:2], params)  # warm-up
    print("memory:", llm.llm_engine.memory_reports)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    results[eager] = [o.outputs[0].token_ids for o in outputs]
    graphs = llm.llm_engine.executor.runner.decode_graphs
    print(f"enforce_eager={eager}: {48 * 64 / seconds:.1f} output tok/s; graphs: "
          f"{None if graphs is None else {s: n for s, n in graphs.steps.items() if n}}")
    llm.llm_engine.shutdown()
    del llm, graphs
    gc.collect()
    torch.cuda.empty_cache()
same = sum(a == b for a, b in zip(results[True], results[False]))
first16 = sum(a[:16] == b[:16] for a, b in zip(results[True], results[False]))
print(f"graphs vs eager: {same}/48 identical completions, {first16}/48 identical first 16 tokens")
PYEOF
  "$PY" benchmarks/offline_throughput.py --systems tengyun --model smollm2 2>&1 | tail -5
} | tee "$out"
echo "recorded in $out"
