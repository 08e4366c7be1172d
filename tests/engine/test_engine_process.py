"""EngineProcessClient: the engine loop in a forked child process, driven over real pipes. The
child serves test_async_engine's FakeLLMEngine (one character per step), so these run in
seconds; tests/entrypoints runs the real server (a real model) over the same transport."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from test_async_engine import FakeLLMEngine
from tengyun.engine.async_engine import EngineDeadError
from tengyun.engine.engine_process import EngineProcessClient, engine_in_thread_reason, portable_error
from tengyun.sampling_params import SamplingParams


def _run(body, build=lambda config: FakeLLMEngine()):
    """Fork an engine process serving ``build(config)``, wait until it is ready, run body(client)."""

    async def main():
        client = EngineProcessClient.launch(config=None, build=build)
        try:
            client.start()
            await client.wait_ready()
            return await body(client)
        finally:
            client.shutdown(timeout=10)

    return asyncio.run(main())


async def _texts(client, request_id, max_tokens):
    stream = client.generate(request_id, [1, 2], SamplingParams(max_tokens=max_tokens))
    return [out.outputs[0].text async for out in stream]


def test_requests_stream_through_the_process_concurrently():
    async def body(client):
        assert client.is_healthy and client.process.pid != os.getpid()
        results = await asyncio.gather(*(_texts(client, f"r{i}", 3 + i) for i in range(4)))
        assert results == [["abcdefg"[:k] for k in range(1, 4 + i)] for i in range(4)]
        assert client.num_in_flight == 0 and client.latest_stats.num_running == 0

    _run(body)


def test_results_are_read_on_the_event_loop_with_no_reader_thread():
    """One wake-up per step result: the event loop reads the results pipe itself. A thread that
    read them and handed each over was a second wake-up, and on a small machine whose cores the
    engine's threads hold each one can wait a scheduler slice before a first token goes out."""
    async def body(client):
        loop_thread, readers = threading.get_ident(), []
        recv = client._results.recv

        def traced_recv():
            readers.append(threading.get_ident())
            return recv()

        client._results.recv = traced_recv
        assert await _texts(client, "r", 3) == ["a", "ab", "abc"]
        assert readers and set(readers) == {loop_thread}
        assert [t.name for t in threading.enumerate() if t.name.startswith("tengyun-engine")] == ["tengyun-engine-send"]

    _run(body)


def test_ready_names_the_engines_tokenizer_class_for_the_api_process():
    """The API process loads that class itself (tokenizer.get_tokenizer), without AutoTokenizer."""
    import json

    def build(config):
        engine = FakeLLMEngine()
        engine.tokenizer = json.JSONDecoder()  # any object: only its class is sent
        return engine

    async def body(client):
        assert client.tokenizer_class == "json.decoder:JSONDecoder"

    _run(body, build)


def test_a_rejected_request_gets_its_error_and_the_others_keep_running():
    async def body(client):
        long = asyncio.create_task(_texts(client, "ok", 20))
        with pytest.raises(ValueError, match="prompt must not be empty"):
            async for _ in client.generate("bad", [], SamplingParams(max_tokens=2)):
                pass
        assert len(await long) == 20 and client.is_healthy

    _run(body)


def test_closing_a_stream_early_aborts_the_request_in_the_engine_process():
    async def body(client):
        stream = client.generate("early", [1], SamplingParams(max_tokens=10**6))
        async for out in stream:
            if len(out.outputs[0].text) == 3:
                break
        await stream.aclose()
        for _ in range(300):  # the abort's step reports the engine idle again
            if client.latest_stats.num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert client.latest_stats.num_running == 0 and client.num_in_flight == 0

    _run(body)


def test_a_start_up_error_reaches_wait_ready_with_its_type_and_text():
    def build(config):
        raise ValueError("--kv-cache-memory 16KiB holds no KV block; raise it.")

    async def main():
        client = EngineProcessClient.launch(config=None, build=build)
        client.start()
        try:
            with pytest.raises(ValueError, match="--kv-cache-memory 16KiB"):
                await client.wait_ready()
            assert isinstance(client.start_error, ValueError) and client.errored
        finally:
            client.shutdown(timeout=10)
        assert client.wait_exit(0) == 0  # it exited by itself after reporting

    asyncio.run(main())


def test_a_killed_engine_process_fails_streams_with_how_it_died():
    async def body(client):
        stream = client.generate("victim", [1], SamplingParams(max_tokens=10**6))
        await stream.__anext__()
        os.kill(client.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited unexpectedly \\(killed by SIGKILL"):
            async for _ in stream:
                pass
        assert not client.is_healthy
        with pytest.raises(EngineDeadError):
            await _texts(client, "after", 2)

    _run(body)


def test_sigterm_and_sigint_leave_the_engine_process_serving():
    async def body(client):
        os.kill(client.process.pid, signal.SIGTERM)  # systemd signals the whole group; the server drains
        os.kill(client.process.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground group
        assert await _texts(client, "still", 3) == ["a", "ab", "abc"]
        assert client.wait_exit(0) is None  # still running

    _run(body)


def test_the_engine_process_stops_when_the_api_process_is_gone():
    async def body(client):
        client._requests.close()  # what the API process's exit does to the engine process's pipe
        assert client.wait_exit(10) == 0  # read end of file as Shutdown: engine.shutdown(), exit 0

    _run(body)


def test_shutdown_stops_the_process():
    async def body(client):
        await _texts(client, "one", 2)
        return client

    client = _run(body)
    assert client.wait_exit(0) == 0


class NeedsTwoArguments(Exception):
    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


def test_portable_error_keeps_picklable_errors_and_sends_the_text_of_others():
    error = ValueError("n must be at least 1.")
    assert portable_error(error) is error
    copy = portable_error(NeedsTwoArguments("bad thing", 7))
    assert type(copy) is RuntimeError and str(copy) == "NeedsTwoArguments: bad thing"


def test_engine_in_thread_reason(monkeypatch):
    monkeypatch.setattr("tengyun.engine.engine_process.threading.active_count", lambda: 1)
    for name in ("TENGYUN_ENABLE_MULTIPROCESSING", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(name, raising=False)
    assert engine_in_thread_reason(fork_safe=True) is None
    assert "survive fork" in engine_in_thread_reason(fork_safe=False)
    monkeypatch.setattr("tengyun.engine.engine_process.threading.active_count", lambda: 3)
    assert "3 threads are running" in engine_in_thread_reason(fork_safe=True)
    monkeypatch.setattr("tengyun.engine.engine_process.threading.active_count", lambda: 1)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert engine_in_thread_reason(fork_safe=True) == "VLLM_ENABLE_V1_MULTIPROCESSING=0"
    monkeypatch.setenv("TENGYUN_ENABLE_MULTIPROCESSING", "1")  # Tengyun's own name wins
    assert engine_in_thread_reason(fork_safe=True) is None
    monkeypatch.setenv("TENGYUN_ENABLE_MULTIPROCESSING", "yes")
    with pytest.raises(ValueError, match="TENGYUN_ENABLE_MULTIPROCESSING must be 0 or 1"):
        engine_in_thread_reason(fork_safe=True)
