"""One CPU per OpenMP thread of the CPU model thread, as vLLM's CPU worker binds its threads
(``VLLM_CPU_OMP_THREADS_BIND``, default ``auto``).

Unbound, Linux moves the model's OpenMP threads between cores. Served, the API process and the
client wake on these cores after every step; the scheduler then may stack two OpenMP threads on one
core for a time slice, and every op's closing barrier waits for the one that is not running. SmolLM2
in bfloat16 served at concurrency 64 on 2 vCPUs (Intel Xeon with AMX): decode steps of 64 sequences
took 51-53 ms in the engine against 44 ms with no server around them, 49 ms with the threads bound
(GOMP_CPU_AFFINITY); this binding made 900-910 output tok/s against 866-872 unbound, alternated
(benchmarks/README.md, "Bound OpenMP threads").

How: the pool's worker threads (1 .. n-1) are placed by ``torch.ops.tengyun.set_openmp_worker_affinity``,
which runs in each of them, before the first step and again after the count changes or a pool is
released. Thread 0 is the model thread itself, which also runs the engine's Python between steps:
it is pinned only for the step (``ThreadBinding.step``) and gets its own affinity back after, so
threads and processes it starts between steps (an offline ``LLM`` user's, a test's) inherit what it
had, not one CPU.

``TENGYUN_CPU_OMP_THREADS_BIND`` (vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` is read when it is unset):

- ``auto`` (default): the first logical CPU of each physical core the process may use, in order,
  where there are exactly as many such cores as threads; else no binding (a log line says why):
  more threads would share cores, and fewer mean the other cores are someone else's (data-parallel
  replicas on one host each take cores / replicas threads of the same cores, and binding would
  stack them all on the first ones);
- ``nobind``: threads go where Linux puts them, as before 2026-12-05;
- a CPU list, ``0-3`` or ``0,2,4-5``: thread i on the i-th CPU listed; CPUs the process may not use,
  or fewer CPUs than threads, are errors that name the variable.

Only a count equal to the planned one is pinned: when the thread tuner (runtime/threads.py) drops a
thread because another process holds a core, the remaining threads may use every planned CPU, so
the busy one can be left to its owner.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

BIND_ENV = "TENGYUN_CPU_OMP_THREADS_BIND"
VLLM_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
SYS_CPU = Path("/sys/devices/system/cpu")


def bind_setting() -> tuple[str, str]:
    """(the variable the setting came from, its value): ours, else vLLM's, else ("", "auto")."""
    for name in (BIND_ENV, VLLM_BIND_ENV):
        value = os.environ.get(name, "").strip()
        if value:
            return name, value
    return "", "auto"


def parse_cpu_list(text: str, name: str) -> list[int]:
    """Parse "0-3,6" -> [0, 1, 2, 3, 6] (order kept, no repeats). ValueError naming ``name`` otherwise."""
    cpus: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{name}={text!r}: expected 'auto', 'nobind' or a CPU list such as '0-3' or '0,2,4-5'")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise ValueError(f"{name}={text!r}: the range {part.strip()!r} runs backwards")
        cpus.extend(cpu for cpu in range(lo, hi + 1) if cpu not in cpus)
    return cpus


def one_cpu_per_core(allowed: list[int], sys_cpu: Path = SYS_CPU) -> list[int]:
    """The first allowed logical CPU of each physical core (package, core id), in CPU order; the
    allowed list as it is where sysfs does not say."""
    seen: set[tuple[str, str]] = set()
    firsts = []
    for cpu in sorted(allowed):
        topology = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            core = ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
        except OSError:
            return sorted(allowed)
        if core not in seen:
            seen.add(core)
            firsts.append(cpu)
    return firsts


def planned_cpus(threads: int, world_size: int, allowed: list[int] | None = None,
                 setting: tuple[str, str] | None = None, sys_cpu: Path = SYS_CPU) -> tuple[list[int] | None, str]:
    """(CPU of thread i for i < threads, or None: no binding; why, for the log). ValueError for a
    setting that cannot be met."""
    name, value = setting or bind_setting()
    where = f"{name}={value}" if name else "auto (the default)"
    allowed = sorted(os.sched_getaffinity(0)) if allowed is None else allowed
    if value == "nobind":
        return None, f"{where}: OpenMP threads unbound"
    if "|" in value:
        raise ValueError(f"{name}={value!r}: per-rank CPU lists ('|') are not supported; give 'auto', 'nobind' "
                         "or one CPU list")
    if world_size > 1:
        if value != "auto":
            raise ValueError(f"{name}={value!r}: a CPU list binds one rank's threads, and this engine has "
                             f"{world_size} ranks; use 'auto' or 'nobind'")
        return None, f"{where}: OpenMP threads unbound ({world_size} ranks share this host's cores)"
    if value == "auto":
        cores = one_cpu_per_core(allowed, sys_cpu)
        if len(cores) != threads:  # more: threads would share cores; fewer: other engines' (data parallel)
            return None, (f"{where}: OpenMP threads unbound ({_count(threads, 'thread')}, "
                          f"{_count(len(cores), 'core')} this process may use; a CPU list binds them anyway)")
        return cores, f"{where}: one core each"
    cpus = parse_cpu_list(value, name)
    outside = [cpu for cpu in cpus if cpu not in allowed]
    if outside:
        raise ValueError(f"{name}={value!r}: CPU {outside[0]} is not one this process may use "
                         f"({format_cpus(allowed)})")
    if len(cpus) < threads:
        raise ValueError(f"{name}={value!r} lists {len(cpus)} CPUs for {threads} OpenMP threads: list at least "
                         f"{threads}, or set OMP_NUM_THREADS={len(cpus)}")
    return cpus[:threads], f"{where}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def format_cpus(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


_pool_generation = 0  # OpenMP pools released in this process (runtime/threads.py release_openmp_pool)


def pool_released() -> None:
    """A thread's OpenMP pool ended: libgomp starts new threads in its next parallel region, which
    every binding must place again."""
    global _pool_generation
    _pool_generation += 1


class ThreadBinding:
    """The model thread's pool on ``cpus`` (thread i on cpus[i]): run each step inside
    ``step(threads)`` in the model thread."""

    def __init__(self, cpus: list[int]):
        self.cpus = cpus
        self._placed: tuple[int, int] | None = None  # (thread count, pool generation) the workers were placed for

    @contextlib.contextmanager
    def step(self, threads: int) -> Iterator[None]:
        """Place the pool's workers for ``threads`` threads (pinned at the planned count, else free
        over every planned CPU), and at the planned count pin the calling (model) thread to cpus[0]
        for the block, giving it its own affinity back after. Workers are placed again whenever the
        count changes or a pool was released since (another engine built in this thread releases
        it): a new pool's threads would otherwise start from the pinned model thread, all on
        cpus[0]. Placing them every step instead measured slower served (906 and 940 against 947
        and 942 output tok/s, SmolLM2 at concurrency 64, AMX VM, alternated)."""
        if self._placed != (threads, _pool_generation):
            import torch

            if threads > 1:
                torch.ops.tengyun.set_openmp_worker_affinity(threads, self.cpus, threads == len(self.cpus))
            self._placed = (threads, _pool_generation)
        if threads != len(self.cpus):
            yield
            return
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {self.cpus[0]})
        try:
            yield
        finally:
            os.sched_setaffinity(0, before)


def model_thread_binding(threads: int, world_size: int) -> ThreadBinding | None:
    """The binding for a CPU model thread of ``threads`` OpenMP threads (None: unbound), logged in
    one line. Raises ValueError for a setting that cannot be met."""
    if not hasattr(os, "sched_setaffinity"):
        logger.info("OpenMP threads unbound: this OS sets no thread affinity")
        return None
    cpus, why = planned_cpus(threads, world_size)
    if cpus is None:
        logger.info("%s", why)
        return None
    from tengyun.platforms.cpu import native

    error = native.load_error()
    if error is not None:
        logger.info("OpenMP threads unbound: %s", error)
        return None
    logger.info("OpenMP threads bound, %s: CPUs %s", why, ", ".join(map(str, cpus)))
    return ThreadBinding(cpus)

