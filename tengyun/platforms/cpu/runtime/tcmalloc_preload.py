"""tcmalloc under `tengyun serve` on CPU: the command re-executes itself once with tcmalloc in
LD_PRELOAD, the allocator vLLM's CPU guide asks its users to preload by hand.

Why: torch's CPU tensors and the engine's Python objects are allocated and freed every step;
with tcmalloc instead of glibc's malloc, SmolLM2 in bfloat16 served at concurrency 1 made 3-11%
more output tokens a second with a 4-10% earlier first token, and at concurrency 64 0-6% more
offline (Intel Xeon with AMX; benchmarks/README.md, "The allocator"). The library must already be
on the machine (Debian and Ubuntu: `apt install libtcmalloc-minimal4`); without it the server runs
on glibc's allocator and says how to install it.

$TENGYUN_CPU_ALLOCATOR: ``auto`` (default: tcmalloc where found, on CPU), ``tcmalloc`` (required:
exit 2 when it is missing), ``system`` (never preload). A process whose LD_PRELOAD already names
tcmalloc or jemalloc is left as it is, and so is one that reports an accelerator's device nodes
(/dev/nvidia0, /dev/davinci0) unless --device cpu is given.
"""

from __future__ import annotations

import ctypes.util
import glob
import logging
import os
import sys
from typing import Callable, Mapping

logger = logging.getLogger(__name__)

CHOICE_ENV = "TENGYUN_CPU_ALLOCATOR"
CHOICES = ("auto", "tcmalloc", "system")
PRELOADED_ENV = "TENGYUN_ALLOCATOR_PRELOADED"  # set on the re-executed process: the library it preloaded
INSTALL_HINT = "on Debian and Ubuntu: apt install libtcmalloc-minimal4"
_LIBRARIES = ("tcmalloc_minimal", "tcmalloc")  # ctypes.util.find_library names, first found wins
_ALREADY = ("tcmalloc", "jemalloc")  # an allocator the user preloads themselves
_ACCELERATOR_NODES = ("/dev/nvidia[0-9]*", "/dev/davinci[0-9]*")


def find_tcmalloc() -> str | None:
    """The tcmalloc library's name as the dynamic linker finds it (e.g. libtcmalloc_minimal.so.4)."""
    for name in _LIBRARIES:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def has_accelerator_nodes() -> bool:
    return any(glob.glob(pattern) for pattern in _ACCELERATOR_NODES)


def requested_device(serve_args: list[str]) -> str:
    """--device's value among the serve flags ("auto" when absent)."""
    for i, arg in enumerate(serve_args):
        if arg.startswith("--device="):
            return arg.split("=", 1)[1]
        if arg == "--device" and i + 1 < len(serve_args):
            return serve_args[i + 1]
    return "auto"


def user_allocator(env: Mapping[str, str]) -> str | None:
    """The allocator the user preloads themselves ("tcmalloc", "jemalloc"), if any."""
    preload = env.get("LD_PRELOAD", "")
    return next((name for name in _ALREADY if name in preload), None)


def serves_on_cpu(device: str, accelerators: Callable[[], bool] = has_accelerator_nodes) -> bool:
    """Whether a server for --device ``device`` runs on CPU: cpu, or auto with no accelerator's
    device node."""
    return device == "cpu" or (device == "auto" and not accelerators())


def allocator_choice(env: Mapping[str, str]) -> str:
    choice = env.get(CHOICE_ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"${CHOICE_ENV} must be one of {', '.join(CHOICES)}; got {env[CHOICE_ENV]!r}.")
    return choice


def preload_env(serve_args: list[str], env: Mapping[str, str],
                find: Callable[[], str | None] = find_tcmalloc,
                accelerators: Callable[[], bool] = has_accelerator_nodes) -> dict[str, str] | None:
    """The environment to re-execute `tengyun serve` under (tcmalloc first in LD_PRELOAD), or None
    when the process should run as it is. Raises ValueError when $TENGYUN_CPU_ALLOCATOR=tcmalloc
    and no tcmalloc is installed."""
    choice = allocator_choice(env)
    if choice == "system" or PRELOADED_ENV in env or user_allocator(env):
        return None
    if not serves_on_cpu(requested_device(serve_args), accelerators):
        return None
    library = find()
    if library is None:
        if choice == "tcmalloc":
            raise ValueError(f"${CHOICE_ENV}=tcmalloc but no tcmalloc library was found ({INSTALL_HINT}), "
                             f"or set {CHOICE_ENV}=system.")
        return None
    return {**env, "LD_PRELOAD": ":".join(filter(None, (library, env.get("LD_PRELOAD")))), PRELOADED_ENV: library}


def reexec_under_tcmalloc(serve_args: list[str]) -> None:
    """Replace this process (same pid, same command line) with one that preloads tcmalloc, when
    preload_env says so; returns otherwise. Call before anything starts a thread or a child."""
    new_env = preload_env(serve_args, os.environ)
    if new_env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, list(sys.orig_argv), new_env)
    except OSError as error:  # e.g. the interpreter's file replaced under a running venv: serve as it is
        logger.warning("could not re-execute under %s (%s); serving on glibc's malloc", new_env[PRELOADED_ENV], error)


def reexec_or_exit(serve_args: list[str]) -> None:
    """reexec_under_tcmalloc for a command's own command line, before it imports the server: a
    bad $TENGYUN_CPU_ALLOCATOR (ValueError) is printed as ``error: ...`` and exits 2, as a bad flag."""
    try:
        reexec_under_tcmalloc(serve_args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def log_allocator(device: str) -> None:
    """One line at start-up of a server for --device ``device``: which allocator it runs on, and
    how to get tcmalloc where it is missing."""
    preloaded = os.environ.get(PRELOADED_ENV)
    if preloaded:
        logger.info("CPU allocator: tcmalloc (%s, preloaded; %s=system turns it off)", preloaded, CHOICE_ENV)
        return
    user_preloaded = user_allocator(os.environ)
    if user_preloaded:
        logger.info("CPU allocator: %s (from your LD_PRELOAD)", user_preloaded)
        return
    if not serves_on_cpu(device) or allocator_choice(os.environ) != "auto":
        return
    library = find_tcmalloc()
    if library:  # a server started in-process (main(argv)), not from its own command line
        logger.info("CPU allocator: glibc malloc; %s is installed but not preloaded (LD_PRELOAD=%s)", library, library)
    else:
        logger.info("CPU allocator: glibc malloc; tcmalloc was not found (%s): a faster batch-1 decode and "
                    "first token on CPU with it (%s=system silences this)", INSTALL_HINT, CHOICE_ENV)
