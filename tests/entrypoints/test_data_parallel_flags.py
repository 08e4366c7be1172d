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
    (dict(data_parallel_rpc_port=70000), "--data-parallel-rpc-port must be in 1..65534"),
    (dict(data_parallel_size=4, data_parallel_size_local=3, data_parallel_start_rank=2),
     r"runs replicas 2..4, past the last of --data-parallel-size 4 \(3\): pass --data-parallel-size-local 2 or less"),
])
def test_bad_values_name_the_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **flags)


@pytest.mark.parametrize("flags,message", [
    (dict(data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2),
     "--data-parallel-start-rank 2 runs replicas for another node's API server: add --headless"),
    (dict(data_parallel_size=4, data_parallel_size_local=2, headless=True),
     "--headless with --data-parallel-size 4 runs replicas for another node's API server, from "
     "--data-parallel-start-rank"),
    (dict(data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2, headless=True),
     "--headless with --data-parallel-size needs --data-parallel-address"),
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
    # vLLM's two-node layout: the API node, and a --headless node with the later replicas
    assert serving_problem(EngineConfig(model="m", data_parallel_size=4, data_parallel_size_local=2,
                                        data_parallel_address="10.0.0.1", data_parallel_rpc_port=13345)) is None
    assert serving_problem(EngineConfig(model="m", data_parallel_size=4, data_parallel_size_local=2, headless=True,
                                        data_parallel_start_rank=2, data_parallel_address="10.0.0.1")) is None


def test_offline_llm_refuses_data_parallel_naming_serve():
    with pytest.raises(ValueError, match=r"tengyun serve --data-parallel-size 2"):
        LLM("some/model", data_parallel_size=2)


def _layout(device_type: str, **flags):
    """The settings replica_environments reads, for a device this machine lacks (a finalized
    EngineConfig holds the device it selected)."""
    from types import SimpleNamespace

    config = EngineConfig(model="m", **flags)
    names = ("data_parallel_size", "data_parallel_size_local", "data_parallel_start_rank", "data_parallel_address",
             "data_parallel_rpc_port", "world_size", "enable_expert_parallel")
    return SimpleNamespace(device_type=device_type, **{name: getattr(config, name) for name in names})


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


def test_replicas_over_nodes_take_this_nodes_devices_and_meet_on_the_api_node():
    """-dp 4 -dpl 2 -dpr 2 -tp 2 on a headless node: replicas 2, 3 on its devices 0..3, meeting for the
    expert exchange at the API node's --data-parallel-address, --data-parallel-rpc-port + 1."""
    node = _layout("cuda", data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2,
                   tensor_parallel_size=2, enable_expert_parallel=True, data_parallel_address="10.0.0.1",
                   data_parallel_rpc_port=13345)
    assert replica_environments(node, {}) == [
        {"CUDA_VISIBLE_DEVICES": "0,1", DATA_PARALLEL_ENV: "2,4,10.0.0.1:13346"},
        {"CUDA_VISIBLE_DEVICES": "2,3", DATA_PARALLEL_ENV: "3,4,10.0.0.1:13346"}]
