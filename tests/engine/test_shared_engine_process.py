"""One engine process serving two API-side clients over real pipes (`--api-server-count`), with
test_async_engine's FakeLLMEngine (one character per step): the same request id from both is two
requests, each answer goes back to its sender, only client 0's step listeners see progress (all
of it), an idle client still gets the engine's stats, an abort ends only its sender's request,
and the engine process stops once both have left."""

from __future__ import annotations

import asyncio

from test_async_engine import FakeLLMEngine, _wait_until
from tengyun.engine.shared_engine_process import SharedEngineLaunch
from tengyun.sampling_params import SamplingParams


async def _texts(client, request_id: str, max_tokens: int) -> list[str]:
    stream = client.generate(request_id, [1, 2], SamplingParams(max_tokens=max_tokens))
    return [out.outputs[0].text async for out in stream]


def test_two_clients_share_one_engine_each_getting_its_own_answers():
    launch = SharedEngineLaunch(config=None, num_clients=2, build=lambda config: FakeLLMEngine())

    async def main():
        clients = [launch.client(0), launch.client(1)]
        seen: list[list[str]] = [[], []]
        for client, ids in zip(clients, seen):
            client.start()
            client.add_step_listener(lambda progress, stats, ids=ids: ids.extend(p.request_id for p in progress))
        await asyncio.gather(*(client.wait_ready() for client in clients))
        three, five = await asyncio.gather(_texts(clients[0], "same", 3), _texts(clients[1], "same", 5))
        assert three == ["a", "ab", "abc"] and five == ["a", "ab", "abc", "abcd", "abcde"]
        assert {"0:same", "1:same"} <= set(seen[0]) and seen[1] == []  # client 0 records for both

        aborted = asyncio.ensure_future(_texts(clients[1], "long", 600))
        kept = asyncio.ensure_future(_texts(clients[0], "long", 300))
        await _wait_until(lambda: clients[1].latest_stats.num_running == 2)
        aborted.cancel()  # an abort from client 1 names its own "long" only
        assert len(await kept) == 300
        await _wait_until(lambda: clients[1].latest_stats.num_running == 0)  # idle, it still hears the engine
        clients[0].shutdown()
        clients[1].shutdown()

    asyncio.run(main())
    launch.process.join(10)
    assert launch.process.exitcode == 0  # both left: it stopped by itself
