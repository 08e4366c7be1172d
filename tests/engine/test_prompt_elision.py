"""A request's prompt crosses the engine process's results pipe once (engine/prompt_elision.py):
a real tiny engine in a forked process streams to EngineProcessClient, and every output read on
the API side holds the prompt the engine holds, while the messages in transit do not; then the
sender and keeper on their own for the orders a pipe can bring."""

from __future__ import annotations

import asyncio
import pickle

from tengyun import LLM
from tengyun.engine.async_engine import StepResult
from tengyun.engine.engine_process import EngineProcessClient
from tengyun.engine.prompt_elision import PromptKeeper, PromptSender
from tengyun.outputs import CompletionOutput, RequestOutput, RequestProgress
from tengyun.pooling_outputs import PoolingOutput, PoolingRequestOutput
from tengyun.sampling_params import RequestOutputKind, SamplingParams

PROMPTS = {"a": "The quick brown fox jumps over", "b": "Once upon a time", "c": [5, 6, 7, 8, 9, 10, 11]}


def test_streamed_outputs_hold_their_prompt_while_the_pipe_carries_it_once(tiny_checkpoints):
    folder = str(tiny_checkpoints["llama"])

    def build(config):
        return LLM(folder, block_size=8, max_model_len=64, max_num_seqs=4, kv_cache_memory="1MiB").llm_engine

    reference = LLM(folder, block_size=8, max_model_len=64, max_num_seqs=4, kv_cache_memory="1MiB")
    expected_ids = {rid: reference.llm_engine._tokenize(p)[1] for rid, p in PROMPTS.items()}
    in_transit: list[StepResult] = []

    async def main():
        client = EngineProcessClient.launch(config=None, build=build)
        restore = client._prompts.restore

        def traced(message):
            in_transit.append(pickle.loads(pickle.dumps(message)))  # as it came out of the pipe
            return restore(message)

        client._prompts.restore = traced
        try:
            client.start()
            await client.wait_ready()
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

            async def collect(rid):
                return [out async for out in client.generate(rid, PROMPTS[rid], params)]

            streams = await asyncio.gather(*(collect(rid) for rid in PROMPTS))
            early = client.generate("early", "Abort me after two steps", params)  # closed early: aborted
            async for out in early:
                if len(out.outputs[0].token_ids) >= 1:
                    break
            await early.aclose()
            for _ in range(300):  # the abort's report comes with a later step
                if client.latest_stats.num_running == 0 and not len(client._prompts):
                    break
                await asyncio.sleep(0.01)
            return dict(zip(PROMPTS, streams)), len(client._prompts)
        finally:
            client.shutdown(timeout=10)

    streams, kept = asyncio.run(main())
    for rid, outputs in streams.items():
        assert len(outputs) == 8 and outputs[-1].finished
        for out in outputs:  # every output the API side reads: the engine's prompt, whole
            assert out.prompt_token_ids == expected_ids[rid]
            assert out.prompt == (PROMPTS[rid] if isinstance(PROMPTS[rid], str) else None)
    carried = [o for m in in_transit for o in m.outputs if o.request_id in PROMPTS and o.prompt_token_ids is not None]
    elided = [o for m in in_transit for o in m.outputs if o.request_id in m.elided_prompts]
    assert sorted(o.request_id for o in carried) == sorted([*PROMPTS, *PROMPTS])  # the first and the last
    assert len(elided) >= 3 * 6 and all(o.prompt is None and o.prompt_token_ids is None for o in elided)
    assert kept == 0  # finished and aborted requests forgotten


def _output(rid: str, tokens: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, f"prompt of {rid}", [1, 2, 3], [CompletionOutput(0, "x", [tokens])], finished)


def _progress(rid: str, finished: bool) -> RequestProgress:
    return RequestProgress(rid, 3, [1], [None], finished, metrics=None)


def _through(sender: PromptSender, keeper: PromptKeeper, outputs, progress=(), rejected=None) -> list:
    sent = sender.slim(StepResult(list(outputs), None, dict(rejected or {}), list(progress)))
    return keeper.restore(pickle.loads(pickle.dumps(sent))).outputs


def test_a_request_id_that_ends_and_starts_again_in_one_message_gets_its_new_prompt():
    sender, keeper = PromptSender(), PromptKeeper()
    _through(sender, keeper, [_output("x", 1)])
    assert _through(sender, keeper, [_output("x", 2)])[0].prompt == "prompt of x"
    # The old x aborted (its progress says finished) while a new x, another prompt, took its id.
    new = RequestOutput("x", "a new prompt", [9, 9], [CompletionOutput(0, "y", [3])], False)
    got = _through(sender, keeper, [new], progress=[_progress("x", True), _progress("x", False)])
    assert (got[0].prompt, got[0].prompt_token_ids) == ("a new prompt", [9, 9])
    assert _through(sender, keeper, [_output("x", 4, finished=True)])[0].prompt == "prompt of x"
    assert len(sender) == len(keeper) == 0


def test_pooled_outputs_and_rejections_pass_and_leave_nothing_behind():
    sender, keeper = PromptSender(), PromptKeeper()
    pooled = PoolingRequestOutput("p", PoolingOutput([0.5]), [1, 2], True)
    got = _through(sender, keeper, [pooled, _output("r", 1)], rejected={"q": ValueError("bad")})
    assert got[0] == pooled and got[1].prompt_token_ids == [1, 2, 3]
    _through(sender, keeper, [], rejected={"r": ValueError("gone")})
    assert len(sender) == len(keeper) == 0
