"""vLLM's --data-parallel-* values checked as typed, and the layouts `tengyun serve` does not run
refused naming the flag (no model needed); LLM(data_parallel_size=2) refused."""

from __future__ import annotations

import pytest

from tengyun import LLM
from tengyun.config import EngineConfig
from tengyun.engine.data_parallel_client import replica_environments
from tengyun.sizing.data_parallel import DATA_PARALLEL_ENV, serving_problem


@pytest.mark.parametrize("flags,message", [
    (dict(data_parallel_size=0), "--data-parallel-size must be >= 1"),
    (dict(data_parallel_size=2, data_parallel_size_local=3), "--data-parallel-size-local must be in 1..--data-"),
    (dict(data_parallel_size=2, data_parallel_start_rank=2), "--data-parallel-start-rank must be in 0..1"),
    (dict(data_parallel_rpc_port=70000), "--data-parallel-rpc-port must be in 1..65535"),
])
def test_bad_values_name_the_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **flags)


@pytest.mark.parametrize("flags,message", [
    (dict(data_parallel_size=4, data_parallel_size_local=2), "--data-parallel-size-local 2 < --data-parallel-size 4"),
    (dict(data_parallel_size=4, data_parallel_start_rank=2), "--data-parallel-start-rank 2 starts replicas"),
    (dict(data_parallel_size=2, tensor_parallel_size=2, nnodes=2, master_port=29500),
     "--data-parallel-size 2 with --nnodes 2"),
    (dict(data_parallel_size=2, master_port=29500), "--master-port with --data-parallel-size 2"),
    (dict(data_parallel_size=2, enable_expert_parallel=True, pipeline_parallel_size=2),
     "not run with --pipeline-parallel-size 2"),
])
def test_layouts_serve_does_not_run_are_refused_naming_the_flag(flags, message):
    assert message in serving_problem(EngineConfig(model="m", **flags))


def test_layouts_serve_runs_have_no_problem():
    assert serving_problem(EngineConfig(model="m", data_parallel_size=2, tensor_parallel_size=2,
                                        enable_expert_parallel=True)) is None


def test_offline_llm_refuses_data_parallel_naming_serve():
    with pytest.raises(ValueError, match=r"tengyun serve --data-parallel-size 2"):
        LLM("some/model", data_parallel_size=2)


def _layout(device_type: str, **flags):
    """The settings replica_environments reads, for a device this machine lacks (a finalized
    EngineConfig holds the device it selected)."""
    from types import SimpleNamespace

    config = EngineConfig(model="m", **flags)
    return SimpleNamespace(device_type=device_type, data_parallel_size=config.data_parallel_size,
                           world_size=config.world_size, enable_expert_parallel=config.enable_expert_parallel,
                           data_parallel_rpc_port=config.data_parallel_rpc_port)


def test_each_replica_gets_its_slice_of_the_visible_devices():
    layout = _layout("cuda", data_parallel_size=2, tensor_parallel_size=2)
    assert replica_environments(layout, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == [
        {"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    assert replica_environments(layout, {}) == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    npu = _layout("npu", data_parallel_size=2)
    assert replica_environments(npu, {}) == [{"ASCEND_RT_VISIBLE_DEVICES": "0"}, {"ASCEND_RT_VISIBLE_DEVICES": "1"}]
    assert replica_environments(_layout("cpu", data_parallel_size=2), {}) == [{}, {}]
    with pytest.raises(ValueError, match=r"needs 4 devices, but CUDA_VISIBLE_DEVICES=4,5 lists 2"):
        replica_environments(layout, {"CUDA_VISIBLE_DEVICES": "4,5"})


def test_expert_parallel_replicas_learn_their_index_and_where_to_meet():
    envs = replica_environments(_layout("cpu", data_parallel_size=2, enable_expert_parallel=True,
                                        data_parallel_rpc_port=13345), {})
    assert [env[DATA_PARALLEL_ENV] for env in envs] == ["0,2,127.0.0.1:13345", "1,2,127.0.0.1:13345"]
