"""Kernel choice as data: per op kind, an ordered list of candidates; the first that can runs.

Each platform lists its candidates (``Platform.kernel_candidates(kind)``); a candidate answers
``can_implement(query) -> None | reason`` and, for quantised linears, ``nbytes(query, out, in_,
in_total)``: the bytes one rank holds, which `tengyun plan` counts. The worker builds the chosen
candidate's kernel; the planner asks the same table for bytes, so the two cannot drift. The log
names each choice and, at debug level, why every earlier candidate could not run.

Asking is cheap and builds nothing: a candidate's checks read flags, the scheme and whether the
compiled library loads; only ``build`` constructs the kernel (and imports its module).

    cpu, quant_linear, GPTQ 4-bit group 128 served in float32:
      cpu_w8a8 -> "not a W8A8 scheme"; cpu_gguf -> "not a GGUF block type";
      cpu_int8_layout -> "8-bit weight-only served in bfloat16 only";
      cpu_int4pack -> "torch's int4 matmul takes bfloat16 activations only"; reference -> chosen
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

KINDS = ("attention", "linear", "quant_linear", "layer_ops", "sampler", "gated_delta_rule", "lora", "moe")


@dataclass(frozen=True)
class KernelQuery:
    """What a kernel is asked to do; torch-free."""

    dtype: str  # activations and dense weights: "bfloat16", "float16", "float32"
    block_size: int | None = None  # attention: tokens per KV block
    kv_cache_dtype: str | None = None  # attention: the cache's dtype name
    scheme: Any = None  # quant_linear: the LinearScheme (tengyun/quantization/scheme.py)


def always(query: KernelQuery) -> str | None:
    """A candidate that runs everywhere (the plain-PyTorch fallback at the end of each list)."""
    return None


@dataclass(frozen=True)
class KernelCandidate:
    name: str
    can_implement: Callable[[KernelQuery], str | None]  # None: it can; else why not, for the log
    build: Callable[[KernelQuery], Any]  # the kernel object (imports torch and the kernel's module)
    # quant_linear: (query, out, in_, in_total) -> bytes one rank holds for an out x in_ layer
    # (in_total: the whole layer's inputs where a row-parallel rank holds a slice); None elsewhere
    nbytes: Callable[[KernelQuery, int, int, int | None], int] | None = None
    describe: Callable[[KernelQuery], str] | None = None  # the chosen one's detail for the log line


@dataclass(frozen=True)
class Choice:
    kind: str
    candidate: KernelCandidate
    passed_over: tuple[tuple[str, str], ...]  # (candidate name, why it could not), in list order

    @property
    def name(self) -> str:
        return self.candidate.name

    def detail(self, query: KernelQuery) -> str:
        """Why this one: the first passed-over candidate's reason, else the candidate's own detail."""
        if self.passed_over:
            return self.passed_over[0][1]
        return self.candidate.describe(query) if self.candidate.describe else "first choice"

    def explain(self) -> str:
        """'cpu_int4pack (cpu_w8a8: not a W8A8 scheme; cpu_gguf: not a GGUF block type)'"""
        lost = "; ".join(f"{name}: {reason}" for name, reason in self.passed_over)
        return f"{self.name}" + (f" ({lost})" if lost else "")


def choose(kind: str, candidates: list[KernelCandidate], query: KernelQuery) -> Choice:
    """The first candidate of ``candidates`` that can implement ``query``, with why the earlier
    ones could not. Every list ends in a candidate that always can; an empty choice is a bug."""
    passed_over = []
    for candidate in candidates:
        reason = candidate.can_implement(query)
        if reason is None:
            return Choice(kind, candidate, tuple(passed_over))
        passed_over.append((candidate.name, reason))
    raise LookupError(f"no {kind} kernel can run {query}: " + "; ".join(f"{n}: {r}" for n, r in passed_over))

