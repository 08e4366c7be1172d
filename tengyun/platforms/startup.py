"""Choosing the device at start-up, failing fast.

Each accelerator runtime is tried before any model work: torch_npu in a child process under
--device-init-timeout (a hung driver or ACL initialisation holds the GIL in C, so only a
separate process can be given up on), CUDA in-process. ``--device auto`` logs what it tried
and why each runtime was passed over; an explicit ``--device npu|cuda`` that cannot work, a
runtime that hangs, or a version combination `tengyun doctor` knows to be bad raises
DeviceStartupError naming the missing piece and the fix (the CLI exits 2 on it).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from tengyun.platforms.base import Platform

logger = logging.getLogger(__name__)

DEVICE_INIT_TIMEOUT_ENV = "TENGYUN_DEVICE_INIT_TIMEOUT"
DEFAULT_DEVICE_INIT_TIMEOUT_S = 120.0
SKIP_HINT = "pass --skip-version-check to start anyway"


class DeviceStartupError(RuntimeError):
    """The requested device cannot work here; the message names the missing piece and the fix."""


@dataclass(frozen=True)
class RuntimeProblem:
    what: str  # "torch_npu is not importable: ImportError: libascendcl.so: cannot open ..."
    fix: str  # what to install, source or check
    installed: bool  # the runtime is installed but does not work (auto logs a warning, not a note)


def device_init_timeout(flag_value: float | None) -> float:
    """--device-init-timeout, else $TENGYUN_DEVICE_INIT_TIMEOUT, else 120 s."""
    if flag_value is not None:
        return flag_value
    text = os.environ.get(DEVICE_INIT_TIMEOUT_ENV, "")
    try:
        value = float(text) if text else DEFAULT_DEVICE_INIT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"${DEVICE_INIT_TIMEOUT_ENV} must be seconds (try 120); got {text!r}.") from None
    if value <= 0:
        raise ValueError(f"${DEVICE_INIT_TIMEOUT_ENV} must be positive seconds (try 120); got {text!r}.")
    return value


def select_platform(requested: str, init_timeout_s: float, check_versions: bool = True) -> Platform:
    """The platform for --device ``requested`` ("auto" | "cpu" | "cuda" | "npu"), its runtime
    proven to start within ``init_timeout_s``; ``check_versions``: refuse known-bad versions."""
    from tengyun.platforms import platform_class

    if requested != "auto":
        cls = platform_class(requested)
        if check_versions:
            cls.check_versions()
        problem = cls.runtime_problem(init_timeout_s)
        if problem is not None:
            raise DeviceStartupError(f"--device {requested} was requested but {problem.what}: {problem.fix}.")
        logger.info("--device %s: %s runtime started", requested, requested)
        return cls()
    passed_over = []
    for device_type in ("npu", "cuda"):
        cls = platform_class(device_type)
        if check_versions and cls.runtime_installed():
            cls.check_versions()
        problem = cls.runtime_problem(init_timeout_s)
        if problem is None:
            logger.info("--device auto chose %s%s", device_type,
                        f" (passed over: {'; '.join(passed_over)})" if passed_over else "")
            return cls()
        passed_over.append(f"{device_type}: {problem.what}")
        if problem.installed:
            logger.warning("--device auto: %s is installed but unusable: %s; fix: %s", device_type,
                           problem.what, problem.fix)
    logger.info("--device auto chose cpu (tried %s)", "; ".join(passed_over))
    return platform_class("cpu")()


@dataclass(frozen=True)
class ChildProbe:
    """What a runtime probe child printed: 'STEP <what>' before each step, then a result line: 'OK ...',
    'UNAVAILABLE <why>' or another word the caller names (run_child_probe's ``results``); an exception
    leaves its traceback on stderr."""

    steps: list[str]  # steps started, in order; the last one is where it stopped
    result: str | None  # the 'OK' / 'UNAVAILABLE' line's text, None when it never got there
    error: str  # the last stderr line (the exception), "" if none
    timed_out: bool

    @property
    def last_step(self) -> str:
        return self.steps[-1] if self.steps else "starting Python"


def run_child_probe(code: str, timeout_s: float, results: tuple[str, ...] = ("OK", "UNAVAILABLE")) -> ChildProbe:
    """Run ``code`` in a child Python for at most ``timeout_s``. Output goes to files, not pipes,
    so a child stuck in the driver (unkillable until its ioctl returns) cannot block the read."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                logger.warning("the hung device probe (pid %d) did not exit after SIGKILL", proc.pid)
        out.seek(0)
        err.seek(0)
        lines, errors = out.read().splitlines(), err.read().strip().splitlines()
    steps = [line[5:] for line in lines if line.startswith("STEP ")]
    result = next((line for line in reversed(lines) if line.startswith(results)), None)
    return ChildProbe(steps, result, errors[-1] if errors else "", timed_out)
