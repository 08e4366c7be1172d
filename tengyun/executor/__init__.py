"""Executors run the model for the engine: ``execute_model(SchedulerOutput) -> ModelRunnerOutput``,
``num_blocks``, ``num_state_slots`` and ``num_state_snapshots`` (0 without linear-attention layers),
``check_health()``, ``shutdown()``."""

from __future__ import annotations

from tengyun.config import EngineConfig


def create_executor(config: EngineConfig):
    """--distributed-executor-backend: "uni" (the Worker in this process) or "mp" (a process per rank)."""
    if config.executor_backend == "uni":
        from tengyun.worker.worker import Worker

        return Worker(config)
    from tengyun.executor.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(config)
