"""DataParallelClient: N engine replicas (--data-parallel-size N) behind one API server, with the
interface of one engine (AsyncEngineBase), so the server's routes never know there are several.

    API process                          engine processes (forked before the server starts)
    generate() -> least-loaded replica -> LocalReplica i  --pipes--> LLMEngine i (own ranks, KV)
                                       -> RemoteReplica j --TCP----> LLMEngine j on a --headless node
    abort(id)  -> the replica that took id
    step listeners <- DataParallelStats (the replicas' stats summed, and each one's, by index)

Replicas 0..L-1 (L = --data-parallel-size-local) run on this node; L..N-1 on --headless nodes,
which connect to this node's --data-parallel-rpc-port (engine/data_parallel_link.py) and are
then replicas like the others (engine/data_parallel_replica.py): routed to, counted, warmed up,
named when they die or their node goes away.

Each replica is a whole engine: its own scheduler, KV cache and tp x pp ranks (CPU: the node's
cores split between all replicas' ranks, executor/). Replicas share nothing, so a request's
output is what one engine gives it; a request with n > 1 is one engine request, its sequences on
one replica.

Routing: each new request goes to the live replica with the fewest requests in flight (waiting +
running as this server counts them: sent and not finished, exact at once where the replica's own
stats lag a step), then the lowest KV-cache usage its last step reported; ties go round-robin.

With --enable-expert-parallel the replicas share each MoE layer's experts and step together
(engine/data_parallel_wave.py): every request sent to one replica comes with StartWave(n) to all.

A replica that dies (its process killed, its engine loop failed) fails only its own requests
(with expert parallel the others fail too, at their next exchange): from then on dead_error names
it first (/health 503, new requests 503), the other replicas' requests in flight finish, and
``errored`` turns true (the server exits 1) once none is left. Pure Python.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from functools import partial
from collections.abc import Mapping
from typing import Any, AsyncIterator

from tengyun.engine.async_engine import AsyncEngineBase, EngineDeadError, StartWave
from tengyun.engine.data_parallel_link import ReplicaListener, describe_replicas
from tengyun.engine.data_parallel_replica import LocalReplica, RemoteReplica
from tengyun.engine.data_parallel_stats import combine
from tengyun.engine.engine_process import SHUTDOWN_GRACE_S, EngineProcessClient
from tengyun.outputs import RequestOutput, RequestProgress
from tengyun.sampling_params import SamplingParams
from tengyun.sizing.data_parallel import expert_exchange_address, local_replicas, replica_env, spans_nodes

logger = logging.getLogger(__name__)


def launch_replicas(config: Any, in_thread_reason: str | None, method: str = "fork") -> "DataParallelClient":
    """The server's --data-parallel-size engine processes, started now (``method`` "fork", or
    "spawn" where the device runtime does not survive fork); ``in_thread_reason``: the flag or
    environment asking for the engine in a thread of the server, which N replicas cannot: refused."""
    if in_thread_reason is not None:
        raise ValueError(f"--data-parallel-size {config.data_parallel_size} runs each replica in an engine process "
                         f"of its own, but {in_thread_reason} asks for the engine in a thread of the server: remove "
                         f"that, or use --data-parallel-size 1.")
    return DataParallelClient.launch(config, method)


class DataParallelClient(AsyncEngineBase):
    """One engine's interface over ``replicas`` (see the module doc); replica i is vLLM's engine i."""

    @classmethod
    def launch(cls, config: Any, method: str = "fork") -> "DataParallelClient":
        """Start this node's engine processes (--data-parallel-size-local of them, default all),
        each loading its replica on its own devices, and listen for the other nodes' replicas. With
        fork, call while this process has one thread (EngineProcessClient.launch); start() and
        wait_ready() follow."""
        listener = ReplicaListener(config) if spans_nodes(config) else None  # a taken port: before any fork
        envs = replica_environments(config, os.environ)
        local = [LocalReplica.launch(config, partial(_build_replica, env), method) for env in envs]
        remote = [RemoteReplica(config, index) for index in range(len(local), config.data_parallel_size)]
        logger.info("Data parallel: %d engine replicas in processes %s (%s)%s", len(local),
                    ", ".join(str(r.process.pid) for r in local), method,
                    f"; {describe_replicas(range(len(local), config.data_parallel_size))} from --headless nodes, "
                    f"listening on port {listener.port}" if listener else "")
        return cls(config, [*local, *remote], listener)

    def __init__(self, config: Any, replicas: list[EngineProcessClient], listener: ReplicaListener | None = None):
        self.replicas = replicas  # before the base class sets dead_error
        self._listener = listener
        super().__init__(config, latest_stats=None)
        self._owner: dict[str, int] = {}  # request_id -> index of the replica serving it
        self._cursor = 0  # where the round-robin among equally loaded replicas starts next
        self._wave = 0  # requests sent so far: the newest wave (engine/data_parallel_wave.py)
        self._deaths: list[int] = []  # replica indexes in the order they died
        for index, replica in enumerate(replicas):
            replica.add_step_listener(partial(self._on_replica_step, index))
            replica.on_dead = partial(self._deaths.append, index)
            if config.enable_expert_parallel:
                replica.on_add = self._start_wave

    # ----- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for replica in self.replicas:
            replica.start()
        if self._listener is not None:
            self._listener.start(self._attach)

    def waiting_for(self) -> str | None:
        """What start-up still waits for from other nodes (/health's 503 while starting), or None:
        'data-parallel replicas 2, 3 not connected yet (--headless nodes, to port 13345)'."""
        missing = [str(r.index) for r in self.replicas if isinstance(r, RemoteReplica) and r.address is None]
        if not missing:
            return None
        return (f"data-parallel replica{'s' if len(missing) > 1 else ''} {', '.join(missing)} not connected yet "
                f"(--headless nodes, to port {self._listener.port})")

    def _attach(self, index: int, conn: Any, address: str) -> bool:
        """From the listener: a welcomed connection for remote replica ``index``."""
        replica = self.replicas[index] if index < len(self.replicas) else None
        return isinstance(replica, RemoteReplica) and replica.attach(conn, address)

    async def wait_ready(self) -> None:
        """Until every replica has loaded; raises what the first failing one raised."""
        await asyncio.gather(*(replica.wait_ready() for replica in self.replicas))
        first = self.replicas[0]
        self.tokenizer_class = first.tokenizer_class
        self.memory_reports = [dict(report, engine=index) for index, replica in enumerate(self.replicas)
                               for report in replica.memory_reports]
        self.latest_stats = combine([replica.latest_stats for replica in self.replicas], 0)

    def shutdown(self, timeout: float = SHUTDOWN_GRACE_S) -> None:
        """Stop every replica at once (each: Shutdown, then killed after ``timeout`` s)."""
        if self._listener is not None:
            self._listener.close()
        threads = [threading.Thread(target=replica.shutdown, args=(timeout,), daemon=True) for replica in self.replicas]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout + 10.0)

    @property
    def process(self) -> Any:
        """Replica 0's engine process (the server's tengyun_engine_process_* metrics describe it)."""
        return self.replicas[0].process

    @property
    def start_error(self) -> BaseException | None:
        return next((r.start_error for r in self.replicas if r.start_error is not None), None)

    @property
    def dead_error(self) -> str | None:
        """The first replica to die, named, then any that died after it (under expert parallel the
        others fail in their next exchange): 'data-parallel engine 1 (pid 4242): The engine process
        exited ...; then engine 0 (pid 4241): The engine loop died: ...'; a remote replica's
        'engine 2 (pid 5120 on 10.0.0.2): The connection to its node 10.0.0.2 closed ...'. Replicas
        whose process or connection ended (``gone``) come first: a cause, whichever report arrived
        first (replica 0's failed exchange can beat replica 1's end of pipe to the event loop)."""
        dead = self._deaths + [i for i, replica in enumerate(self.replicas)
                               if replica.dead_error is not None and i not in self._deaths]  # failed to start
        dead.sort(key=lambda i: not self.replicas[i].gone)  # stable: in order of death within each kind
        parts = [f"engine {i} ({self.replicas[i].where}): {self.replicas[i].dead_error}" for i in dead]
        return "data-parallel " + "; then ".join(parts) if parts else None

    @dead_error.setter
    def dead_error(self, value: str | None) -> None:
        """The base class's initial None; a replica's own death is what counts."""

    @property
    def errored(self) -> bool:
        """A replica is dead and the live ones have nothing left in flight: time to exit."""
        return self.dead_error is not None and not any(
            replica.num_in_flight for replica in self.replicas if replica.dead_error is None)

    @property
    def is_healthy(self) -> bool:
        return all(replica.is_healthy for replica in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(replica.num_in_flight for replica in self.replicas)

    def replica_states(self) -> list[dict]:
        """Each replica for /health/detail: alive or why not, and its load."""
        states = []
        for index, replica in enumerate(self.replicas):
            stats = replica.latest_stats
            states.append({
                "engine": str(index), "pid": replica.pid, "node": getattr(replica, "address", None),
                "alive": replica.dead_error is None,
                "error": replica.dead_error, "in_flight": replica.num_in_flight,
                **({"running": stats.num_running, "waiting": stats.num_waiting,
                    "kv_cache_usage": stats.kv_cache_usage} if stats is not None else {})})
        return states

    # ----- requests -----------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       arrival_time: float | None = None, first_turn: int = 0,
                       lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        """AsyncEngineBase.generate on the least-loaded live replica."""
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        index = self._least_loaded()
        self._owner[request_id] = index
        try:
            stream = self.replicas[index].generate(request_id, prompt, params, arrival_time, first_turn, lora_request)
            async with contextlib.aclosing(stream):  # closed early: the replica aborts it at once
                async for output in stream:
                    yield output
        finally:
            self._owner.pop(request_id, None)

    def _least_loaded(self) -> int:
        """Fewest requests in flight, then lowest KV usage; equals in round-robin order from the cursor.
        In flight [2, 1, 1], KV [.1, .4, .2] -> 2; [0, 0], cursor 1 -> 1, then cursor 0 -> 0."""
        n = len(self.replicas)
        order = [(self._cursor + k) % n for k in range(n) if self.replicas[(self._cursor + k) % n].dead_error is None]

        def load(index: int) -> tuple[int, float]:
            replica = self.replicas[index]
            return replica.num_in_flight, replica.latest_stats.kv_cache_usage if replica.latest_stats else 0.0

        best = min(order, key=load)  # the first of the least loaded in this order
        self._cursor = (best + 1) % n
        return best

    def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        by_replica: dict[int, list[str]] = {}
        for rid in ids:
            if rid in self._owner:
                by_replica.setdefault(self._owner[rid], []).append(rid)
        for index, owned in by_replica.items():
            self.replicas[index].abort(owned)

    def abort_all(self) -> None:
        for replica in self.replicas:
            replica.abort_all()

    def replica_for(self, request_id: str) -> int | None:
        """The replica serving ``request_id`` while it is in flight."""
        return self._owner.get(request_id)

    def _start_wave(self) -> None:
        """A request went to some replica: every live replica steps with it (StartWave)."""
        self._wave += 1
        for replica in self.replicas:
            if replica.dead_error is None:
                replica._send(StartWave(self._wave))

    # ----- event loop side ----------------------------------------------------------------
    def _on_replica_step(self, index: int, progress: list[RequestProgress], stats: Any) -> None:
        if any(replica.latest_stats is None for replica in self.replicas):
            return  # still loading: the host starts listening once all are ready
        self.latest_stats = combine([replica.latest_stats for replica in self.replicas], index)
        for listener in self._listeners:
            try:
                listener(progress, self.latest_stats)
            except Exception:  # a metrics bug must not break serving
                logger.exception("Step listener %r failed", listener)


def replica_environments(config: Any, environ: Mapping[str, str]) -> list[dict[str, str]]:
    """Each of this node's replicas' environment, set in its engine process before anything touches
    a device (its rank processes inherit it): its slice of the visible devices (the platform's
    visible-devices variable; the node's i-th replica takes devices [i * R, (i + 1) * R) of those
    visible, R = tp x pp), and under expert parallel its index and where the replicas meet.
    CUDA_VISIBLE_DEVICES="4,5,6,7", -dp 2 -tp 2 -> "4,5" and "6,7"; unset -> "0,1" and "2,3".
    CPU: no variable. A --headless node's replicas 2, 3 take its first devices likewise."""
    from tengyun.platforms import platform_class

    indexes, ranks = local_replicas(config), config.world_size
    n = len(indexes)
    envs: list[dict[str, str]] = [{} for _ in range(n)]
    name = platform_class(config.device_type).visible_devices_env
    if name:
        visible = environ[name].split(",") if environ.get(name) else [str(i) for i in range(n * ranks)]
        if len(visible) < n * ranks:
            raise ValueError(f"--data-parallel-size {n} x {ranks} device(s) per replica needs {n * ranks} devices, "
                             f"but {name}={environ[name]} lists {len(visible)}: list more, or lower the sizes.")
        for i, env in enumerate(envs):
            env[name] = ",".join(visible[i * ranks:(i + 1) * ranks])
    if config.enable_expert_parallel:  # the replicas' workers meet for the expert exchange
        address = expert_exchange_address(config) or f"127.0.0.1:{config.data_parallel_rpc_port or _free_port()}"
        for index, env in zip(indexes, envs):
            env.update(replica_env(index, config.data_parallel_size, address))
    return envs


def _build_replica(env: dict[str, str], config: Any) -> Any:
    """In a replica's engine process: its environment (replica_environments), then the engine."""
    from tengyun.engine.llm_engine import LLMEngine

    os.environ.update(env)
    return LLMEngine.from_config(config)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

