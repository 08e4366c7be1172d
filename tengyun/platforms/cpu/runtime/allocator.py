"""glibc's allocator, tuned for a process that runs model steps: freed activation buffers stay in
the heap (no fresh page faults each step) while a CPU worker is loaded, glibc's defaults again once
the process's last one is released. Where the user set glibc's own malloc variables, theirs win."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_KEEP_BYTES = 32 << 20  # the largest mmap threshold glibc accepts on 64-bit
_GLIBC_MMAP_MAX = 65536  # glibc's defaults, back once the process's last worker is released
_GLIBC_THRESHOLD = 128 << 10  # M_MMAP_THRESHOLD's and M_TRIM_THRESHOLD's


# glibc's own allocator variables: where the user set one, Tengyun leaves the allocator to them
# (e.g. MALLOC_MMAP_MAX_=65536, glibc's default, gives large freed blocks back to the system).
_GLIBC_MALLOC_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def _user_malloc_settings() -> str | None:
    """The glibc malloc variable the user set (GLIBC_TUNABLES' glibc.malloc.* included), if any."""
    named = next((name for name in _GLIBC_MALLOC_ENV if name in os.environ), None)
    if named is None and "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        named = "GLIBC_TUNABLES"
    return named


@functools.cache
def _say_allocator_left_to(variable: str) -> None:
    logger.info("%s is set: keeping glibc's allocator settings as given (Tengyun's heap reuse is off)", variable)


def _mallopt(*settings: tuple[int, int]) -> bool:
    """glibc's mallopt(param, value) for each setting -> whether all took (False off glibc, or
    where the user set glibc's own malloc variables: theirs win, one log line says so)."""
    user = _user_malloc_settings()
    if user is not None:
        _say_allocator_left_to(user)
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        ok = all(libc.mallopt(param, value) for param, value in settings)
    except (OSError, AttributeError, TypeError):
        ok = False
    if not ok:
        logger.debug("mallopt unavailable (not glibc?); keeping the default allocator settings")
    return ok


def give_back_free_pages() -> None:
    """glibc's malloc_trim(0): free pages anywhere in the heap go back to the system."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        logger.debug("malloc_trim unavailable (not glibc?)")


def keep_freed_buffers() -> None:
    """Freed blocks up to 32 MiB stay in the heap and it is trimmed only past 1 GiB (before loading)."""
    _mallopt((_M_MMAP_THRESHOLD, _KEEP_BYTES), (_M_TRIM_THRESHOLD, 1 << 30))


def no_new_mmaps() -> None:
    """Every block from the heap, none mmapped afresh (once weights and caches are in place)."""
    _mallopt((_M_MMAP_MAX, 0))


def restore_defaults() -> None:
    """glibc's defaults again, and the heap's free pages given back (malloc_trim)."""
    _mallopt((_M_MMAP_MAX, _GLIBC_MMAP_MAX), (_M_MMAP_THRESHOLD, _GLIBC_THRESHOLD),
             (_M_TRIM_THRESHOLD, _GLIBC_THRESHOLD))
    give_back_free_pages()
