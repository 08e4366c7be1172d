"""The sampler's per-row tensors kept across steps (worker/sampling_inputs.py): rebuilt only when
the sampling rows change or a row's inputs change per step, and always equal to a fresh build."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from tengyun import LLM, SamplingParams
from tengyun.layers.sampling.metadata import SamplingMetadata
from tengyun.worker.sampling_inputs import SamplingInputs

CPU = torch.device("cpu")
V = 50


@dataclass
class Row:
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams


def _same(a: SamplingMetadata, b: SamplingMetadata) -> bool:
    for f in fields(SamplingMetadata):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _fresh(rows: list[Row]) -> SamplingMetadata:
    return SamplingMetadata.build([r.params for r in rows], [r.token_ids[: r.num_prompt_tokens] for r in rows],
                                  [r.token_ids[r.num_prompt_tokens:] for r in rows], V, CPU)


def _steps(rows: list[Row], inputs: SamplingInputs, steps: int) -> int:
    """Run ``steps`` decode steps (each row gains a token) -> builds; every step equals a fresh build."""
    before = inputs.builds
    for step in range(steps):
        assert _same(inputs.metadata(list(range(len(rows))), rows, None), _fresh(rows))
        for r in rows:
            r.token_ids.append(step % V)
    return inputs.builds - before


def test_a_steady_batch_builds_once():
    rows = [Row([1, 2, 3], 3, SamplingParams(temperature=0.7, top_p=0.9, logit_bias={4: 2.0})),
            Row([5], 1, SamplingParams(temperature=0.0, logprobs=2))]
    inputs = SamplingInputs(V, CPU)
    assert _steps(rows, inputs, 6) == 1
    rows.append(Row([9, 9], 2, SamplingParams(top_k=3)))  # a request joins: one new build, then kept again
    assert _steps(rows, inputs, 4) == 1
    assert _steps(rows[1:], inputs, 3) == 1  # one leaves


def test_rows_whose_inputs_change_each_step_rebuild_until_they_stop_changing():
    inputs = SamplingInputs(V, CPU)
    assert _steps([Row([1, 2], 2, SamplingParams(repetition_penalty=1.3, presence_penalty=0.5))], inputs, 4) == 4
    assert _steps([Row([1], 1, SamplingParams(temperature=0.8, seed=7))], inputs, 4) == 4
    # min_tokens=3: masked at 0, 1, 2 outputs, unmasked at 3 (rebuilt), then kept
    assert _steps([Row([1], 1, SamplingParams(min_tokens=3, stop_token_ids=[4]))], inputs, 7) == 5


def test_the_engine_reuses_the_metadata_and_samples_as_before(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["llama"]), block_size=8, max_model_len=64, kv_cache_memory="1MiB")
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = [SamplingParams(temperature=0.9, top_k=20, max_tokens=12, ignore_eos=True, seed=s) for s in (1, 2)]
    unseeded = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    inputs = llm.llm_engine.executor.runner.sampling_inputs
    before = inputs.builds
    greedy = llm.generate(prompts, unseeded)
    assert inputs.builds - before <= 3  # 12 steps; the batch composition changed at most at prefill
    seeded = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], params)]
    assert seeded == [o.outputs[0].token_ids for o in llm.generate(prompts[:2], params)]  # seeds still per step
    assert all(len(o.outputs[0].token_ids) == 12 for o in greedy)
