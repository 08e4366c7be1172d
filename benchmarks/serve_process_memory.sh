#!/bin/bash
# Resident memory of `tengyun serve`'s two processes on the default model (SmolLM2-135M) after one
# completion request: VmRSS and PSS (/proc/PID/smaps_rollup: a page shared by both counted once,
# split between them) of the server (API) process and of its engine process, and whether each
# maps libtorch.
#
#   benchmarks/serve_process_memory.sh [extra `tengyun serve` flags]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
PY=.venv/bin/python
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
PORT=$($PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
$PY -m tengyun.entrypoints.cli.main serve --host 127.0.0.1 --port "$PORT" --kv-cache-memory 256MiB \
    --max-model-len 2048 --disable-uvicorn-access-log "$@" > "$LOG" 2>&1 &
SERVER=$!
for _ in $(seq 240); do curl -sf "127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
curl -sf "127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d '{"max_tokens": 16,
    "temperature": 0, "messages": [{"role": "user", "content": "What is the capital of France?"}]}' > /dev/null
ENGINE=$(grep -o "Engine: in process [0-9]*" "$LOG" | grep -o "[0-9]*$")
echo "| process | VmRSS MiB | PSS MiB | maps libtorch |"
echo "|---|---|---|---|"
for pair in "API:$SERVER" "engine:$ENGINE"; do
    pid=${pair#*:}
    rss=$(awk '/^VmRSS:/ {printf "%.1f", $2 / 1024}' "/proc/$pid/status")
    pss=$(awk '/^Pss:/ {printf "%.1f", $2 / 1024}' "/proc/$pid/smaps_rollup")
    torch=$(grep -q libtorch "/proc/$pid/maps" && echo yes || echo no)
    echo "| ${pair%%:*} | $rss | $pss | $torch |"
done
kill "$SERVER"
wait "$SERVER" || true
