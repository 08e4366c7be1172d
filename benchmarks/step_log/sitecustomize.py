"""Each engine step's size and time, from inside a served engine: put this folder first on the
server's PYTHONPATH and set TENGYUN_STEP_LOG=PREFIX; each process that runs steps appends a line
per step to PREFIX.<pid>: end time (epoch s), tokens, sequences, decodes (sequences given one
token), seconds in Worker.execute_model. benchmarks/served_steps.py summarises the files.

    python benchmarks/serve_sweep.py --models qwen2.5-coder --systems tengyun --concurrency 64 --no-readme \\
        --tengyun-env TENGYUN_STEP_LOG=/tmp/steps PYTHONPATH=$PWD/benchmarks/step_log:$PWD
    python benchmarks/served_steps.py /tmp/steps.*

Python imports sitecustomize at start-up, so this wraps the worker before the engine runs; without
the variable it does nothing (not even the import).
"""

import os
import time

if os.environ.get("TENGYUN_STEP_LOG"):
    from tengyun.worker import worker as _worker

    _execute = _worker.Worker.execute_model
    _files: dict[int, object] = {}

    def _logged(self, sched, *args, **kwargs):
        start = time.perf_counter()
        out = _execute(self, sched, *args, **kwargs)
        seconds = time.perf_counter() - start
        pid = os.getpid()
        if pid not in _files:
            _files[pid] = open(f"{os.environ['TENGYUN_STEP_LOG']}.{pid}", "a", buffering=1)
        counts = sched.num_scheduled_tokens
        decodes = sum(1 for n in counts.values() if n == 1)
        _files[pid].write(f"{time.time():.4f} {sched.total_num_scheduled_tokens} {len(counts)} {decodes} "
                          f"{seconds:.5f}\n")
        return out

    _worker.Worker.execute_model = _logged
