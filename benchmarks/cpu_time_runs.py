"""benchmarks/quant_runs.py with the process's CPU time (time.process_time, every thread) in place
of wall time, so that a run on a shared, oversubscribed machine still measures the work per
token: "decode tok/s" becomes decoded tokens per CPU second. Meaningful at one thread only
(--threads 1, OMP_NUM_THREADS=1): idle threads that spin would count. Same arguments and RESULT
line as quant_runs.py; quant.py's logs print each run's full command to copy.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/cpu_time_runs.py --system tengyun \\
        --model FOLDER --workload WORKLOAD.jsonl --threads 1 --dtype bfloat16 [...]
"""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant_runs  # noqa: E402

if __name__ == "__main__":
    quant_runs.time = types.SimpleNamespace(perf_counter=time.process_time)  # only quant_runs' own stamps
    quant_runs.main()
