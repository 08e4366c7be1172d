"""Decode graphs on CPU: the decode forward recorded once per batch size as a TorchScript trace and
replayed by TorchScript's C++ interpreter, so a small decode step pays no Python per layer.

Why: at batch 1 the compiled kernels leave ~2 ms of a SmolLM2 step (~11 ms at float32, ~7 at
bfloat16) to Python (module calls, argument checks, dispatch), as CUDA graphs remove launch
overhead on a GPU. A trace, like a CUDA graph, records the ops one forward ran: Python control
flow is frozen at what it was for the captured batch size, which is what decode graphs already
require of a forward (worker/decode_graphs.py). Unlike a CUDA graph it allocates each replay's
intermediates afresh and keeps no addresses, only tensors (weights, caches, the static inputs)
by reference.

Two limits, both checked: oneDNN's packed weights are opaque tensors a trace cannot hold, so
only batch sizes whose linears all run a compiled kernel (the small-batch or AMX tile kernel,
cpu/kernels/linear.py) or a quantised kernel are captured (a size whose trace fails is left
eager); and collectives between tensor-parallel ranks (gloo) are not ops a trace records, so
graphs stay off there.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import torch

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _own_compilation_unit():
    """Trace into a compilation unit of the trace's own. torch.jit.trace puts a traced function
    in TorchScript's global unit (torch.jit._state._python_cu, which it looks up at each call;
    its _compilation_unit argument is read for modules only), and there the function and every
    tensor it holds as a constant (weights) stayed until the process ended: a dropped engine
    kept them. The returned function holds its own unit, so both go with it."""
    from torch.jit import _state

    saved, _state._python_cu = _state._python_cu, torch.jit.CompilationUnit()
    try:
        yield
    finally:
        _state._python_cu = saved


def trace_decode_forward(forward, state: list[torch.Tensor], warm_ups: int = 1):
    """``forward() -> Tensor`` (reading the decode graphs' static buffers) -> a function that
    replays it and returns a fresh output tensor; None when it cannot be traced (one debug line
    says why). ``state``: every tensor the forward writes in place (KV caches, recurrent state).
    They enter the trace as its inputs: a trace treats any other tensor it meets as a constant,
    and drops a write to a constant that nothing in the same forward reads back (the cache
    update of a layer). Runs the forward ``warm_ups`` times first, so that what a module builds
    on its first call is built before the trace and not recorded into it. The first batch size
    captured needs that; the others find it built (SmolLM2 and Qwen2.5-Coder: the same 11 traces,
    op for op, with 0 warm-ups or 2), and each forward skipped saves a forward of that size at
    start-up."""
    for _ in range(warm_ups):
        forward()
    state = tuple(state)
    try:
        with warnings.catch_warnings():
            # Shape checks become trace-time constants, as intended: the batch size is fixed.
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            warnings.filterwarnings("ignore", message=".*torch.jit.trace. is deprecated", category=DeprecationWarning)
            with _own_compilation_unit():
                traced = torch.jit.trace(lambda *_: forward(), state, check_trace=False)
    except (RuntimeError, AttributeError) as error:  # AttributeError: a torch without TorchScript
        logger.debug("Decode forward not traceable (%s); that batch size stays eager", error)
        return None
    except Exception as error:  # noqa: BLE001 - a trace must never stop the engine from serving
        logger.warning("Tracing the decode forward failed (%s: %s); that batch size stays eager",
                       type(error).__name__, error)
        return None

    def replay() -> torch.Tensor:
        with torch.jit.optimized_execution(False):  # the plain interpreter: no profiling runs
            return traced(*state)

    replay()  # the interpreter's first run builds its code; keep that out of a request
    return replay
