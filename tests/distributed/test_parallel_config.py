"""Parallel settings: validation messages name the flag and a value that works; rank layout."""

from __future__ import annotations

import pytest

from tengyun.config import EngineConfig
from tengyun.model_spec import stage_layer_range
from tengyun.distributed.rank_info import RankInfo, node_ranks


def test_pp_layer_range_gives_earlier_stages_the_remainder():
    assert [stage_layer_range(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [stage_layer_range(2, r, 2) for r in range(2)] == [(0, 1), (1, 2)]


def test_rank_layout_keeps_tp_groups_inside_a_node():
    info = RankInfo(rank=5, local_rank=1, world_size=8, tp_size=4, pp_size=2, init_method="tcp://x:1", timeout_s=1)
    assert (info.tp_rank, info.pp_rank) == (1, 1)
    assert list(node_ranks(8, 2, 1)) == [4, 5, 6, 7]


def test_executor_backend_defaults_to_mp_for_more_than_one_rank():
    assert EngineConfig(tensor_parallel_size=2).executor_backend == "mp"
    assert EngineConfig().executor_backend == "uni"
    with pytest.raises(ValueError, match="use --distributed-executor-backend mp"):
        EngineConfig(pipeline_parallel_size=2, distributed_executor_backend="uni")


@pytest.mark.parametrize("args,message", [
    (dict(tensor_parallel_size=3, nnodes=2, master_port=29500), "cannot be split evenly over --nnodes 2"),
    (dict(nnodes=2, tensor_parallel_size=2), "--nnodes > 1 needs --master-port"),
    (dict(headless=True), "--headless runs workers only"),
    (dict(tensor_parallel_size=0), "--tensor-parallel-size must be >= 1"),
    (dict(distributed_timeout=0), "--distributed-timeout must be positive"),
])
def test_bad_parallel_flags_name_the_flag(args, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**args)


@pytest.mark.parametrize("args,message", [
    (dict(tensor_parallel_size=3),
     r"--tensor-parallel-size 3 does not divide num_attention_heads 4: use one of \[1, 2, 4\]"),
    (dict(pipeline_parallel_size=3), "--pipeline-parallel-size 3 is more than num_hidden_layers 2: use at most 2"),
])
def test_parallel_sizes_are_checked_against_the_model(tiny_checkpoints, args, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(tiny_checkpoints["llama"]), **args).finalize()
