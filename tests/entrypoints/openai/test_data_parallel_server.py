"""`--data-parallel-size 2`: two engine replicas behind one server, on a tiny Qwen3-MoE (and
Qwen3.5-MoE with --enable-expert-parallel, the replicas then sharing the experts).
Requests sent together are spread over both replicas (least load) and get one engine's greedy
tokens and top-5 logprobs; metrics carry vLLM's engine label per replica; a replica killed with
SIGKILL turns /health 503 naming it while the other replica's request finishes, then the server
exits 1."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from remote_server import MAX_MODEL_LEN, RemoteServer, server_model, start_server  # noqa: F401 (fixtures)

LONG = 1500  # tokens: surely still decoding when the other replica is killed (MAX_MODEL_LEN 2048)
PROMPTS = [[(11 * i + j) % 290 + 1 for j in range(n)] for i, n in enumerate((3, 17, 40, 9))]
TOP_K = 5


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory, tiny_tokenizer_dir):
    from conftest import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("dp_qwen3_moe"), tiny_tokenizer_dir, "qwen3_moe",
                                max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def hybrid_moe_model(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny Qwen3.5-MoE (Gated DeltaNet and attention layers, 8 experts top-2 and a shared expert)."""
    import shutil

    from conftest import make_tiny_qwen3_5

    folder = tmp_path_factory.mktemp("dp_qwen3_5_moe")
    make_tiny_qwen3_5("qwen3_5_moe", max_position_embeddings=MAX_MODEL_LEN).save_pretrained(folder)
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture
def dp_server(moe_model, tmp_path):
    server = RemoteServer(moe_model, ["--data-parallel-size", "2", "--dtype", "float32",
                                      "--return-tokens-as-token-ids"], tmp_path / "server.log")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def _one_engine(folder) -> list[tuple[list[int], list[dict[int, float]]]]:
    """(tokens, top-5 logprobs per step) of each prompt from one engine in this process."""
    from tengyun import LLM, SamplingParams

    llm = LLM(str(folder), dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory="64MiB")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=TOP_K)
        outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    finally:
        llm.llm_engine.shutdown()
    return [(o.token_ids, [{t: e.logprob for t, e in step.items()} for step in o.logprobs]) for o in outputs]


def _samples(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _running(samples: dict, prefix: str, engine: str) -> float | None:
    for (name, labels), value in samples.items():
        if name == f"{prefix}:num_requests_running" and dict(labels).get("engine") == engine:
            return value
    return None


def _when(value, condition):
    return value if condition(value) else None


def _wait_for(predicate, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := predicate()):
            return value
        time.sleep(0.1)
    pytest.fail(f"never happened: {what}")


def _success(samples: dict, engine: str) -> float:
    return sum(value for (name, labels), value in samples.items()
               if name == "vllm:request_success_total" and dict(labels).get("engine") == engine)


def _check_same_as_one_engine(client, model: str, server_url: str, reference) -> None:
    """The PROMPTS sent together: both replicas take some, and every answer is one engine's."""
    answers: dict[int, object] = {}

    def complete(i: int) -> None:
        answers[i] = client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=8, temperature=0,
                                               logprobs=TOP_K, extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=complete, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    samples = _samples(server_url)
    assert _success(samples, "0") >= 1 and _success(samples, "1") >= 1
    for i, (tokens, top) in enumerate(reference):
        logprobs = answers[i].choices[0].logprobs
        assert [int(t.removeprefix("token_id:")) for t in logprobs.tokens] == tokens
        for step, want in enumerate(top):
            got = {int(t.removeprefix("token_id:")): v for t, v in logprobs.top_logprobs[step].items()}
            for token, logprob in want.items():
                assert got[token] == pytest.approx(logprob, abs=1e-4), (i, step, token)


def _stream_long(client, model: str, i: int, results: dict[int, object], n: int = 1) -> None:
    """Request i, streamed, ``n`` choices of LONG tokens greedy past EOS -> results[i]: "length" when
    every choice ended so, else the finish reasons seen, or the exception it ended with (a killed
    replica's request fails; the caller checks)."""
    try:
        chunks = client.completions.create(model=model, prompt=[1 + i, 2, 3], max_tokens=LONG, n=n, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        finished = [choice for c in chunks for choice in c.choices if choice.finish_reason]
        reasons = {choice.finish_reason for choice in finished}
        results[i] = "length" if reasons == {"length"} and len(finished) == n else reasons
    except Exception as e:  # noqa: BLE001 - recorded, checked by the caller
        results[i] = e


def _kill_replica_1_under_two_long_requests(client, model: str, server, kill=None):
    """Two streamed LONG-token requests, one per replica (the second goes to the less loaded), then
    SIGKILL to replica 1's engine process (server.killed_pid), or ``kill()`` where given (replica 1
    on another node) -> (threads, results, metrics then)."""
    results: dict[int, object] = {}
    threads = [threading.Thread(target=_stream_long, args=(client, model, i, results)) for i in range(2)]
    threads[0].start()
    _wait_for(lambda: _when(_samples(server.url), lambda s: _running(s, "vllm", "0") + _running(s, "vllm", "1") == 1),
              "a replica running the first request")
    threads[1].start()  # one replica has a request in flight: the least loaded is the other
    both = _wait_for(lambda: _when(_samples(server.url), lambda s: _running(s, "vllm", "0") == _running(s, "vllm", "1")
                                   == 1), "each replica running one request")
    server.killed_pid = httpx.get(server.url + "/health/detail", timeout=10).json()["data_parallel"][1]["pid"]
    kill() if kill is not None else os.kill(server.killed_pid, signal.SIGKILL)
    return threads, results, both


def test_two_replicas_answer_as_one_engine_route_label_and_survive_one_killed(dp_server, moe_model):
    server = dp_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    if "OMP_NUM_THREADS" not in os.environ:  # each replica's model thread takes half the cores
        assert server.log().count(f"OpenMP: {max(1, (os.cpu_count() or 1) // 2)} thread") == 2, server.log()
    _check_same_as_one_engine(client, model, server.url, _one_engine(moe_model))
    replicas = httpx.get(server.url + "/health/detail", timeout=10).json()["data_parallel"]
    assert [r["engine"] for r in replicas] == ["0", "1"] and all(r["alive"] for r in replicas)

    threads, results, both = _kill_replica_1_under_two_long_requests(client, model, server)
    assert _running(both, "vllm", "0") == 1 and _running(both, "tengyun", "0") == 1
    assert _running(both, "tengyun", "1") == 1
    pid = server.killed_pid
    health = _wait_for(lambda: _when(httpx.get(server.url + "/health", timeout=10), lambda r: r.status_code == 503),
                       "/health 503 after the kill")
    assert f"data-parallel engine 1 (pid {pid})" in health.text and "SIGKILL" in health.text
    detail = httpx.get(server.url + "/health/detail", timeout=10).json()
    assert [r["alive"] for r in detail["data_parallel"]] == [True, False]
    for thread in threads:
        thread.join(timeout=300)
    finished = [r for r in results.values() if r == "length"]  # replica 0's request: all LONG tokens
    assert len(finished) == 1 and sum(isinstance(r, Exception) for r in results.values()) == 1, results
    assert server.wait_exit(timeout=60) == 1
    assert f"data-parallel engine 1 (pid {pid})" in server.log()


def test_expert_parallel_across_two_replicas_answers_as_one_engine(hybrid_moe_model, tmp_path):
    """EP 2 over DP 2 x TP 1 on Qwen3.5-MoE: each replica holds 4 of the 8 experts; every MoE layer
    exchanges the replicas' tokens, so a replica with nothing to do steps with the other (its
    warm-up alone too). Killing one fails the other at its next exchange."""
    moe_model = hybrid_moe_model
    server = RemoteServer(moe_model, ["--data-parallel-size", "2", "--enable-expert-parallel", "--dtype", "float32",
                                      "--return-tokens-as-token-ids"], tmp_path / "server.log")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        _check_same_as_one_engine(client, model, server.url, _one_engine(moe_model))
        one = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})  # one replica busy, the other empty
        assert one.usage.completion_tokens == 8
        log = server.log()
        assert "replica 1 is expert-parallel rank 1 of 2" in log and "replica 0 is expert-parallel rank 0 of 2" in log
        threads, results, _ = _kill_replica_1_under_two_long_requests(client, model, server)
        for thread in threads:
            thread.join(timeout=300)
        assert all(isinstance(result, Exception) for result in results.values())
        # replica 0 fails in its next exchange: both requests fail, the server exits 1, nothing hangs
        assert server.wait_exit(timeout=120) == 1
        pid = server.killed_pid
        assert re.search(rf"error: data-parallel engine 1 \(pid {pid}\): .*SIGKILL.*; then engine 0 ", server.log())
    finally:
        server.stop()


SPAWN_REPLICAS = """
import sys
from tengyun.platforms.cpu.platform import CpuPlatform

CpuPlatform.fork_safe = False  # as on CUDA and Ascend: the replicas start as fresh interpreters
from tengyun.entrypoints.openai.api_server import main
sys.exit(main(sys.argv[1:]))
"""


def test_replicas_start_as_fresh_interpreters_where_the_device_runtime_does_not_survive_fork(start_server):
    server = start_server("--data-parallel-size", "2", python_code=SPAWN_REPLICAS).wait_ready()
    assert re.search(r"Data parallel: 2 engine replicas in processes \d+, \d+ \(spawn\)", server.log())
    name = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    for i in range(2):  # one on each replica
        body = {"model": name, "prompt": [1, 2, 3 + i], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
        assert answer["usage"]["completion_tokens"] == 4, answer


@pytest.mark.parametrize("flags,message", [
    (("-dp", "2", "-dpl", "1", "--data-parallel-start-rank", "1"), "--data-parallel-start-rank 1 runs replicas "
                                                                     "for another node's API server: add --headless"),
    (("--data-parallel-size", "2", "--disable-frontend-multiprocessing"), "--disable-frontend-multiprocessing"),
])
def test_data_parallel_layouts_not_run_are_refused_naming_the_flag(start_server, flags, message):
    server = start_server(*flags)
    assert server.wait_exit(timeout=120) == 2
    assert message in server.log()
