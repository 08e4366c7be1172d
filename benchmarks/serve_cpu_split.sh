#!/bin/bash
# Where the CPU goes during one saturated serve run: the server (API) process, the engine
# process and the `tengyun bench serve` client, in CPU seconds (utime + stime from /proc).
# SmolLM2-135M (the HF folder Tengyun converts from the PyPI GGUF), bfloat16, 64 x 128/128
# random token ids, all requests at once, as benchmarks/compare's serve runs.
#
#   benchmarks/serve_cpu_split.sh [extra `tengyun serve` flags, e.g. --disable-frontend-multiprocessing]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
PY=.venv/bin/python
MODEL=$($PY -c "from tengyun.models.model_source import resolve_model as r; print(r('HuggingFaceTB/SmolLM2-135M-Instruct', 'auto').folder)" 2>/dev/null)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
$PY - "$WORK/workload.jsonl" <<'EOF'
import json, random, sys
rng = random.Random(0)
with open(sys.argv[1], "w") as f:
    for _ in range(64):
        f.write(json.dumps({"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(128)], "output_len": 128}) + "\n")
EOF
PORT=$($PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
$PY -m tengyun.entrypoints.cli.main serve "$MODEL" --host 127.0.0.1 --port "$PORT" --served-model-name bench \
    --kv-cache-memory 1GiB --dtype bfloat16 --disable-uvicorn-access-log "$@" > "$WORK/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 120); do curl -sf "127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
ENGINE=$(grep -o "Engine: in process [0-9]*" "$WORK/server.log" | grep -o "[0-9]*$" || true)
cpu_s() { awk '{printf "%.2f", ($14 + $15) / 100}' "/proc/$1/stat"; }
api0=$(cpu_s $SERVER); engine0=${ENGINE:+$(cpu_s "$ENGINE")}
/usr/bin/time -f "client: %U s user + %S s system (its start-up included), %e s wall" \
    $PY -m tengyun.entrypoints.cli.main bench serve --base-url "http://127.0.0.1:$PORT" --model "$MODEL" \
    --served-model-name bench --dataset "$WORK/workload.jsonl" --num-prompts 64 --ignore-eos --disable-tqdm 2>&1 \
    | grep -E "Output token throughput|Median TTFT|client:"
echo "server (API) process: $(echo "$(cpu_s $SERVER) - $api0" | bc) s"
[ -n "$ENGINE" ] && echo "engine process: $(echo "$(cpu_s "$ENGINE") - $engine0" | bc) s"
kill -INT $SERVER
wait $SERVER || true
