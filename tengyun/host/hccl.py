"""The HCCL environment Tengyun relies on: the defaults it sets when the user did not (NPU ranks,
NpuPlatform.apply_hccl_defaults), and the checks `tengyun doctor` runs on whatever is set.

Pure functions of an environment mapping; sources are CANN's environment variable reference
(hiascend.com, "CANN 环境变量参考", HCCL section):

    HCCL_CONNECT_TIMEOUT  envref_07_0077: socket link set-up between devices; integer seconds in
                          [120, 7200], default 120 (8.x: the actual wait is the value + 20 s).
    HCCL_EXEC_TIMEOUT     envref_07_0078: how long a device waits for its peers inside a
                          collective; Atlas A2 / A3 [0, 2147483647] s (0: never), default 1836;
                          Atlas training (910A) and 300I Duo (0, 17340], rounded down to a multiple
                          of 68; with HCCL_OP_EXPANSION_MODE=AIV capped at 1091.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HcclDefault:
    name: str
    value: str
    low: int  # the documented range, inclusive
    high: int
    why: str


HCCL_DEFAULTS = (
    HcclDefault("HCCL_CONNECT_TIMEOUT", "1200", 120, 7200,
                "CANN's 120 s fails the link set-up when one node's ranks reach their first collective "
                "minutes after another's (weights loading from shared storage); Ascend's LLM deployment "
                "scripts use 1200. Tengyun bounds its own communicator set-up by --distributed-timeout too"),
    HcclDefault("HCCL_EXEC_TIMEOUT", "1200", 0, 2147483647,
                "the same budget for a peer inside a collective (the first forward waits for the slowest "
                "rank's load); CANN's 1836 s leaves a hung collective holding every card for half an hour. "
                "On Atlas training cards (910A) it is rounded down to a multiple of 68 s (1156 s)"),
)


def missing_defaults(env: dict[str, str]) -> dict[str, str]:
    """The defaults to set: those of HCCL_DEFAULTS the environment does not set.
    {} -> {"HCCL_CONNECT_TIMEOUT": "1200", "HCCL_EXEC_TIMEOUT": "1200"}."""
    return {d.name: d.value for d in HCCL_DEFAULTS if not env.get(d.name)}


def value_problem(name: str, value: str) -> str | None:
    """Why a set value is outside CANN's documented range; None when it is fine.
    ("HCCL_CONNECT_TIMEOUT", "60") -> "... 60 is outside [120, 7200] ..."."""
    default = next((d for d in HCCL_DEFAULTS if d.name == name), None)
    if default is None:
        return None
    try:
        number = int(value)
    except ValueError:
        return f"{name}={value!r} is not a whole number of seconds: HCCL rejects it; use e.g. {default.value}"
    if not default.low <= number <= default.high:
        return (f"{name}={number} is outside CANN's range [{default.low}, {default.high}] s: HCCL rejects it or "
                f"clamps it; use e.g. {default.value}")
    return None


def describe(env: dict[str, str]) -> list[tuple[str, str, str]]:
    """(name, value, where it comes from) for each variable of HCCL_DEFAULTS, as a rank would see
    it after the defaults: "set" by the user, else "Tengyun default"."""
    return [(d.name, env[d.name], "set") if env.get(d.name) else (d.name, d.value, "Tengyun default")
            for d in HCCL_DEFAULTS]
