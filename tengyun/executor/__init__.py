"""Executors run the model for the engine: ``execute_model(SchedulerOutput) -> ModelRunnerOutput``,
``num_blocks``, ``num_state_slots`` and ``num_state_snapshots`` (0 without linear-attention layers),
``check_health()``, ``shutdown()``."""

from __future__ import annotations

from tengyun.config import EngineConfig


def create_executor(config: EngineConfig):
    """--distributed-executor-backend: "uni" (the Worker in this process) or "mp" (a process per rank)."""
    if config.executor_backend == "uni":
        from tengyun.worker.worker import Worker

        _share_cores_between_replicas(config)
        return Worker(config)
    from tengyun.executor.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(config)


def _share_cores_between_replicas(config: EngineConfig) -> None:
    """--data-parallel-size N, one rank per replica, on CPU: this replica's model thread takes the
    node's cores / N OpenMP threads (the run-time tuner may lower it, never raise it), unless
    OMP_NUM_THREADS fixes the count."""
    from tengyun.executor.multiproc_executor import _threads_per_rank, local_replicas
    from tengyun.platforms import platform_class

    replicas = local_replicas(config)
    threads = _threads_per_rank(platform_class(config.device_type), replicas) if replicas > 1 else 0
    if threads:
        import torch

        torch.set_num_threads(threads)
