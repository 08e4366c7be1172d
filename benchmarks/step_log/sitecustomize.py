"""Each engine step's size and time, from inside a served engine: put this folder first on the
server's PYTHONPATH and set TENGYUN_STEP_LOG=PREFIX; each process that runs steps appends a line
per step to PREFIX.<pid>: end time (epoch s), tokens, sequences, decodes (sequences given one
token), seconds in Worker.execute_model. benchmarks/served_steps.py summarises the files.

    python benchmarks/serve_sweep.py --models qwen2.5-coder --systems tengyun --concurrency 64 --no-readme \\
        --tengyun-env TENGYUN_STEP_LOG=/tmp/steps PYTHONPATH=$PWD/benchmarks/step_log:$PWD
    python benchmarks/served_steps.py /tmp/steps.*

Python imports sitecustomize at start-up; this then waits for tengyun.worker.worker to be imported
(in the engine process) and wraps Worker.execute_model there, so the API process, which runs
without torch, imports nothing more. Without the variable it does nothing.
"""

import importlib.abc
import importlib.util
import os
import sys
import time

WORKER_MODULE = "tengyun.worker.worker"


def _wrap(worker_class) -> None:
    execute = worker_class.execute_model
    files: dict[int, object] = {}

    def logged(self, sched, *args, **kwargs):
        start = time.perf_counter()
        out = execute(self, sched, *args, **kwargs)
        seconds = time.perf_counter() - start
        pid = os.getpid()
        if pid not in files:
            files[pid] = open(f"{os.environ['TENGYUN_STEP_LOG']}.{pid}", "a", buffering=1)
        counts = sched.num_scheduled_tokens
        decodes = sum(1 for n in counts.values() if n == 1)
        files[pid].write(f"{time.time():.4f} {sched.total_num_scheduled_tokens} {len(counts)} {decodes} "
                         f"{seconds:.5f}\n")
        return out

    worker_class.execute_model = logged


class _WrapWorkerOnImport(importlib.abc.MetaPathFinder):
    """Finds tengyun.worker.worker as usual, then wraps its Worker once the module has run."""

    def find_spec(self, name, path, target=None):
        if name != WORKER_MODULE:
            return None
        sys.meta_path.remove(self)  # one wrap per process (a forked engine inherits the wrapped class)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            _wrap(module.Worker)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("TENGYUN_STEP_LOG"):
    sys.meta_path.insert(0, _WrapWorkerOnImport())
