"""The sampler (tengyun/layers/sampler.py), every test on each way it draws: PyTorch's ops, and the
CPU's compiled sample_rows (csrc/sampling.cpp) on each instruction-set copy this CPU runs."""

import math

import pytest
import torch

from tengyun.layers.sampler import Sampler
from tengyun.layers.sampling.filters import apply_min_p, apply_top_k, apply_top_p
from tengyun.layers.sampling.metadata import SamplingMetadata, step_seed
from tengyun.layers.sampling.penalties import apply_logit_bias, apply_penalties
from tengyun.layers.kernels import KernelBundle
from tengyun.sampling_params import SamplingParams

from test_cpu_paged_attention import kernels  # noqa: F401 - the build-or-skip fixture

CPU = torch.device("cpu")
NEG_INF = float("-inf")
DRAWS = ("torch", "avx512", "avx2", "generic")  # the PyTorch ops, then the kernel's copies
_draw = {"sample_rows": None}  # what make_sampler binds: set per test by the fixture below


@pytest.fixture(autouse=True, params=DRAWS)
def draw_with(request):
    """Every test once with PyTorch's draw and once per compiled copy this CPU has."""
    if request.param == "torch":
        yield request.param
        return
    from tengyun.platforms.cpu import native as cpu_kernels

    best = request.getfixturevalue("kernels").isa()
    try:
        torch.ops.tengyun.paged_attention_isa(request.param)
    except RuntimeError:
        pytest.skip(f"this CPU lacks {request.param}")
    _draw["sample_rows"] = torch.ops.tengyun.sample_rows.default
    assert cpu_kernels.load_error() is None
    yield request.param
    _draw["sample_rows"] = None
    torch.ops.tengyun.paged_attention_isa(best)


def make_sampler() -> Sampler:
    sampler = Sampler()
    sampler.bind_kernels(KernelBundle(attention=None, linear=None, layer_ops=None, gated_delta_rule=None,
                                      sample_rows=_draw["sample_rows"]))
    return sampler


def run(logits, params, prompts=None, outputs=None):
    B, V = logits.shape
    prompts = prompts if prompts is not None else [[] for _ in range(B)]
    outputs = outputs if outputs is not None else [[] for _ in range(B)]
    md = SamplingMetadata.build(params, prompts, outputs, V, CPU)
    return make_sampler()(logits, md)


def log_probs(*p):
    return torch.tensor([math.log(x) for x in p])


def sampled_set(row_logits, n=4000, **kw):
    """Sample one row n times (as n batch rows) -> set of token ids drawn."""
    logits = row_logits.unsqueeze(0).repeat(n, 1)
    out = run(logits, [SamplingParams(temperature=1.0, **kw) for _ in range(n)])
    return set(out.sampled_token_ids.tolist())


# ---- greedy -------------------------------------------------------------------------------


def test_greedy_rows_take_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    out = run(logits, [SamplingParams(temperature=0.0) for _ in range(8)])
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_ranks is None


def test_all_greedy_batch_draws_no_random_numbers():
    torch.manual_seed(1)
    logits = torch.randn(4, 30)
    before = torch.get_rng_state()
    run(logits, [SamplingParams(temperature=0.0, top_k=3, top_p=0.5) for _ in range(4)])
    assert torch.equal(torch.get_rng_state(), before)


def test_mixed_batch_greedy_rows_argmax_random_rows_sample():
    logits = torch.zeros(2, 5)
    logits[:, 3] = 1.0
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)]
    logits[1, 3], logits[1, 4] = 0.0, 5.0
    out = run(logits, params)
    assert out.sampled_token_ids.tolist() == [3, 4]


def test_input_logits_not_modified():
    logits = torch.randn(3, 20)
    copy = logits.clone()
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5, min_tokens=2),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, presence_penalty=1.0),
        SamplingParams(temperature=1.0, seed=3, logit_bias={4: 2.0}),
    ]
    for p in params:
        p.all_stop_token_ids = {0}
    run(logits, params, prompts=[[1, 2]] * 3, outputs=[[3]] * 3)
    assert torch.equal(logits, copy)


def test_unused_stages_are_absent_from_metadata():
    md = SamplingMetadata.build([SamplingParams(temperature=0.8)] * 2, [[1], [2]], [[], []], 10, CPU)
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert md.output_token_ids is None and md.min_tokens_rows is None
    assert md.max_num_logprobs is None and md.seeded_rows == [] and md.logit_bias_rows is None
    # Filters on greedy rows are irrelevant and dropped too.
    md = SamplingMetadata.build([SamplingParams(temperature=0, top_k=2, top_p=0.5, min_p=0.2)], [[]], [[]], 10, CPU)
    assert md.all_greedy and md.top_k is None and md.top_p is None and md.min_p is None


# ---- filters ------------------------------------------------------------------------------


def test_top_k_keeps_exactly_k_largest():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 2.5], [0.1, 3.0, 2.0, -1.0, 2.5], [5.0, 4.0, 3.0, 2.0, 1.0]])
    out = apply_top_k(logits, torch.tensor([2, 0, 1]), max_top_k=2)
    kept = [set(torch.nonzero(r > NEG_INF).flatten().tolist()) for r in out]
    assert kept == [{1, 4}, {0, 1, 2, 3, 4}, {0}]
    assert torch.equal(out[0, [1, 4]], logits[0, [1, 4]])


def test_top_p_keeps_smallest_set_reaching_p():
    logits = log_probs(0.5, 0.3, 0.15, 0.05).repeat(3, 1)
    out = apply_top_p(logits, torch.tensor([0.75, 0.85, 1.0]))
    kept = [set(torch.nonzero(r > NEG_INF).flatten().tolist()) for r in out]
    assert kept == [{0, 1}, {0, 1, 2}, {0, 1, 2, 3}]
    # Tiny p still keeps the most likely token.
    assert torch.nonzero(apply_top_p(logits[:1], torch.tensor([1e-9]))[0] > NEG_INF).flatten().tolist() == [0]


@pytest.mark.parametrize("ties", [False, True])
def test_top_k_rows_sample_from_their_candidates_as_from_the_whole_vocabulary(ties):
    """Where every random row has a top_k, the sampler works on the best max_top_k logits (more
    where a tie at a k-th logit reaches past them): the same tokens as the whole-vocabulary path
    on the same uniforms, with temperature, top_p, min_p, a greedy row, and bf16-like ties."""
    from tengyun.layers.sampling.draw import _sample_vocabulary, _top_k_candidates
    from tengyun.layers.sampling.draw import sample_random as _sample_random

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(40, 3000, generator=gen) * 3
    if ties:
        logits = (logits * 4).round() / 4  # many equal values at every k-th
    params = [SamplingParams(temperature=0.0) if i == 7 else
              SamplingParams(temperature=0.5 + (i % 4) * 0.3, top_k=1 + i % 25, top_p=(1.0, 0.8, 0.5)[i % 3],
                             min_p=0.05 if i % 5 == 0 else 0.0) for i in range(40)]
    md = SamplingMetadata.build(params, [[]] * 40, [[]] * 40, 3000, CPU)
    vals, _ = _top_k_candidates(logits, md)
    assert (vals.shape[1] > md.max_top_k) == ties
    random_rows = torch.tensor([i != 7 for i in range(40)])
    for seed in range(5):
        torch.manual_seed(seed)
        got = _sample_random(logits, md)
        torch.manual_seed(seed)
        want = _sample_vocabulary(logits, md)
        assert torch.equal(got[random_rows], want[random_rows])


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2)
    out = apply_min_p(probs, torch.tensor([0.5, 0.2]))
    keep = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    assert torch.equal(out, probs * keep)


def test_sampling_with_top_k_top_p_min_p_draws_only_kept_tokens():
    row = log_probs(0.3, 0.25, 0.2, 0.15, 0.1)
    assert sampled_set(row) == {0, 1, 2, 3, 4}
    assert sampled_set(row, top_k=2) == {0, 1}
    assert sampled_set(row, top_p=0.7) == {0, 1, 2}  # .3 + .25 = .55 < .7 <= .75
    assert sampled_set(row, min_p=0.6) == {0, 1, 2}  # >= .18
    assert sampled_set(row, top_k=4, top_p=0.5) == {0, 1}


def test_temperature_sharpens_and_flattens():
    row = torch.tensor([0.0, 1.0])
    assert sampled_set(row) == {0, 1}
    n = 4000
    cold = run(row.repeat(n, 1), [SamplingParams(temperature=0.01)] * n).sampled_token_ids
    assert set(cold.tolist()) == {1}
    hot = run(row.repeat(n, 1), [SamplingParams(temperature=100.0)] * n).sampled_token_ids
    assert abs(hot.float().mean().item() - 0.5) < 0.05  # ~uniform; at T=1 it is 0.73


def test_extreme_uniform_draws_never_pick_a_filtered_token():
    from tengyun.layers.sampling.draw import sample_from_probs

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 3)
    u = torch.tensor([0.0, 1.0 - 1e-16, 0.9999999], dtype=torch.float64)
    assert sample_from_probs(probs, u).tolist() == [1, 3, 3]
    assert sample_from_probs(probs, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)).tolist() == [1, 3, 3]

def test_random_rows_follow_the_distribution():
    torch.manual_seed(0)
    n = 20000
    logits = log_probs(0.5, 0.3, 0.2).repeat(n, 1)
    out = run(logits, [SamplingParams(temperature=1.0)] * n)
    freq = torch.bincount(out.sampled_token_ids, minlength=3).float() / n
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.02)


# ---- penalties ----------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_multiplies_negative_on_prompt_and_output():
    logits = torch.tensor([[2.0, -2.0, 4.0, -4.0, 1.0]])
    md = SamplingMetadata.build([SamplingParams(repetition_penalty=2.0)], [[0, 1]], [[2, 3, 3]], 5, CPU)
    assert apply_penalties(logits, md).tolist() == [[1.0, -4.0, 2.0, -8.0, 1.0]]


def test_presence_and_frequency_penalties_apply_to_output_tokens_only():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),  # no penalties: untouched even in a penalised batch
    ]
    md = SamplingMetadata.build(params, [[0], [0]], [[1, 2, 2], [1, 2, 2]], 4, CPU)
    # token 0: prompt only; token 1: once -> 1 - .5 - .25; token 2: twice -> 1 - .5 - .5
    assert apply_penalties(logits, md).tolist() == [[1.0, 0.25, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    assert run(logits, [SamplingParams(temperature=0)], outputs=[[0]]).sampled_token_ids.item() == 0
    out = run(logits, [SamplingParams(temperature=0, frequency_penalty=1.5)], outputs=[[0]])
    assert out.sampled_token_ids.item() == 1


# ---- min_tokens ---------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0]])  # 2 = EOS, 3 = a stop token id

    def greedy(num_out):
        p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[3])
        p.all_stop_token_ids = {2}
        return run(logits, [p], outputs=[[1] * num_out]).sampled_token_ids.item()

    assert greedy(2) == 1
    assert greedy(3) == 2


# ---- logit_bias ---------------------------------------------------------------------------


def test_logit_bias_adds_to_its_own_row_as_transformers_sequence_bias_does():
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(3, 12)
    biases = [{3: 5.0, 7: -100.0}, None, {0: 0.25, 11: 100.0}]  # a batch mixes biased and unbiased rows
    md = SamplingMetadata.build([SamplingParams(logit_bias=b) for b in biases], [[]] * 3, [[]] * 3, 12, CPU)
    got = apply_logit_bias(logits, md.logit_bias_rows, md.logit_bias_token_ids, md.logit_bias_values)
    for row, bias in enumerate(biases):
        want = logits[row:row + 1]
        if bias:
            hf = SequenceBiasLogitsProcessor([[[token], value] for token, value in bias.items()])
            want = hf(torch.zeros(1, 1, dtype=torch.long), want.clone())
        assert torch.equal(got[row], want[0])
    assert apply_logit_bias(torch.tensor([[1.0, 2.0, 3.0]] * 2), torch.tensor([0, 0]), torch.tensor([0, 2]),
                            torch.tensor([5.0, -1.0])).tolist() == [[6.0, 2.0, 2.0], [1.0, 2.0, 3.0]]


def test_logit_bias_steers_greedy_rows_and_leaves_raw_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0]])
    params = [SamplingParams(temperature=0, logprobs=1, logit_bias={"2": 2.5}), SamplingParams(temperature=0)]
    out = run(logits, params)
    assert out.sampled_token_ids.tolist() == [2, 1]
    # logprobs are the model's, before any bias (vLLM's default raw_logprobs)
    assert torch.allclose(out.logprobs[0], torch.log_softmax(logits[0], -1)[[2, 1]])
    assert out.sampled_ranks.tolist()[0] == 2


def test_logit_bias_comes_before_the_repetition_penalty_as_in_vllm():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    logits = torch.tensor([[2.0, 1.8]])
    # bias then penalty: (2 + 1) / 2 = 1.5 < 1.8 -> token 1; the other way round, 2 / 2 + 1 = 2.0 -> token 0
    prompt = torch.tensor([[0]])
    biased = SequenceBiasLogitsProcessor([[[0], 1.0]])(prompt, logits.clone())
    want = RepetitionPenaltyLogitsProcessor(2.0)(prompt, biased)
    assert want.argmax(-1).item() == 1
    params = [SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={0: 1.0})]
    assert run(logits, params, prompts=[[0]]).sampled_token_ids.tolist() == [1]


def test_logit_bias_comes_before_temperature_and_top_p():
    # bias ln 3 on token 1: probs [.25, .75]; at temperature .5 they become [.1, .9], and top_p .8
    # drops token 0 (ascending cumsum .1 <= .2). Biasing after the temperature would keep both.
    logits = torch.zeros(2000, 2)
    params = [SamplingParams(temperature=0.5, top_p=0.8, logit_bias={1: math.log(3)})] * 2000
    assert set(run(logits, params).sampled_token_ids.tolist()) == {1}
    params = [SamplingParams(temperature=1.0, top_p=0.8, logit_bias={1: math.log(3)})] * 2000
    assert set(run(logits, params).sampled_token_ids.tolist()) == {0, 1}


# ---- logprobs -----------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_sorted_top_k():
    torch.manual_seed(0)
    logits = torch.randn(3, 40)
    params = [
        SamplingParams(temperature=0.5, logprobs=4, repetition_penalty=1.3, top_k=3),
        SamplingParams(temperature=0.0, logprobs=0, presence_penalty=2.0),
        SamplingParams(temperature=1.0),  # asks nothing; gets the columns anyway
    ]
    out = run(logits, params, prompts=[[1, 2]] * 3, outputs=[[5, 6]] * 3)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs.shape == (3, 5) and out.logprob_token_ids.shape == (3, 5)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    assert torch.equal(out.logprobs, raw.gather(1, out.logprob_token_ids))
    top = raw.topk(4, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    assert (out.logprobs[:, 1:-1] >= out.logprobs[:, 2:]).all()
    expected_rank = (raw > raw.gather(1, out.sampled_token_ids[:, None])).sum(-1) + 1
    assert torch.equal(out.sampled_ranks, expected_rank)


def test_logprobs_zero_returns_only_the_sampled_token():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    out = run(logits, [SamplingParams(temperature=0, logprobs=0)])
    assert out.logprob_token_ids.tolist() == [[1]]
    assert out.sampled_ranks.tolist() == [1]
    assert torch.allclose(out.logprobs, torch.log_softmax(logits, -1)[:, [1]])


# ---- seeds --------------------------------------------------------------------------------


def test_step_seed_is_pinned_and_depends_on_seed_and_step():
    # Pinned: changing the mix breaks reproducibility of seeded requests across versions.
    from tengyun.layers.sampling.metadata import _splitmix64

    assert _splitmix64(0) == 0xE220A8397B1DCDAF  # the reference splitmix64 stream's first value
    assert step_seed(0, 0) == 0xA706DD2F4D197E6F
    assert step_seed(42, 7) == step_seed(42, 7)
    seeds = {step_seed(s, n) for s in range(20) for n in range(20)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**64 for s in seeds)
    assert step_seed(-1, 0) == step_seed(2**64 - 1, 0)


def _seeded_token(batch_logits, params, outputs, row):
    return run(batch_logits, params, outputs=outputs).sampled_token_ids[row].item()


def test_seeded_row_is_independent_of_batch_composition_and_order():
    V = 1000
    torch.manual_seed(0)
    mine = torch.randn(V) * 0.1  # flat: a different draw almost surely gives another token
    others = torch.randn(3, V)
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    me = (mine, p, [7, 8, 9])
    a = (others[0], SamplingParams(temperature=0), [1])
    b = (others[1], SamplingParams(seed=5, top_k=3, logprobs=2), [1, 2])
    c = (others[2], SamplingParams(temperature=1.3, min_p=0.1, presence_penalty=0.5), [])

    tokens = set()
    for batch in ([me], [a, me, b], [me, c, a, b], [c, b, me], [b, me, me]):
        torch.manual_seed(len(batch))  # the global RNG must not matter either
        rows = [i for i, r in enumerate(batch) if r is me]
        out = run(torch.stack([r[0] for r in batch]), [r[1] for r in batch], outputs=[r[2] for r in batch])
        tokens |= {out.sampled_token_ids[i].item() for i in rows}
    assert len(tokens) == 1


def test_seeded_row_depends_only_on_seed_and_step():
    V = 1000
    mine = torch.zeros(1, V)
    draw = lambda seed, n: _seeded_token(mine, [SamplingParams(seed=seed)], [[0] * n], 0)  # noqa: E731
    # Reproducible (restart / preemption recompute): same seed and step -> same token.
    assert draw(7, 3) == draw(7, 3)
    # Different steps or seeds move the draw.
    assert len({draw(7, n) for n in range(6)}) > 3
    assert len({draw(s, 3) for s in range(6)}) > 3


def test_seeded_sample_is_inverse_cdf_of_a_uniform_from_step_seed():
    import numpy as np

    torch.manual_seed(0)
    logits = torch.randn(1, 300)
    p = SamplingParams(temperature=0.7, seed=11)
    gen = torch.Generator().manual_seed(step_seed(11, 4))
    u = torch.rand(1, dtype=torch.float64, generator=gen).item()
    cdf = np.cumsum(torch.softmax(logits[0] / 0.7, -1).double().numpy())
    expected = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    assert run(logits, [p], outputs=[[0] * 4]).sampled_token_ids.item() == expected


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_seeded_rows_keep_filters(temperature):
    row = log_probs(0.3, 0.25, 0.2, 0.15, 0.1)
    n = 500
    params = [SamplingParams(temperature=temperature, top_k=2, seed=s) for s in range(n)]
    out = run(row.repeat(n, 1), params)
    assert set(out.sampled_token_ids.tolist()) == {0, 1}


def test_token_bitmask_masks_only_the_constrained_rows():
    V = 40  # two int32 words per row
    logits = torch.arange(V, dtype=torch.float32).repeat(3, 1)  # argmax 39 on every row
    words = torch.zeros(1, 2, dtype=torch.int32)
    words[0, 0] = 1 << 5  # token 5
    words[0, 1] = 1 << 1  # token 33
    params = [SamplingParams(temperature=0.0)] * 3
    md = SamplingMetadata.build(params, [[]] * 3, [[]] * 3, V, CPU, token_bitmask=([1], words))
    assert make_sampler()(logits, md).sampled_token_ids.tolist() == [39, 33, 39]
    md = SamplingMetadata.build([SamplingParams(temperature=1.0, seed=s) for s in range(3)], [[]] * 3, [[]] * 3,
                                V, CPU, token_bitmask=([1], words))
    for _ in range(20):
        assert make_sampler()(logits, md).sampled_token_ids[1].item() in (5, 33)
