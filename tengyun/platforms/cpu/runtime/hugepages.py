"""The weights on 2 MiB pages (Linux transparent huge pages), once they are in place.

A decode step streams every weight from memory: SmolLM2-135M in bfloat16 reads ~260 MB a step,
in 4 KiB pages unless asked otherwise (Debian's default THP mode is "madvise", and glibc's malloc
asks only under ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``). The same weights in one process,
4 KiB against 2 MiB pages (benchmarks/huge_pages.py; benchmarks/README.md, "Weights on huge
pages"), medians: SmolLM2's linears and head at one row 13.66 -> 11.14 ms, Qwen2.5-Coder-0.5B's
41.41 -> 33.57 ms, SmolLM2's at 64 rows 63.67 -> 60.78 ms: fewer TLB misses, and the hardware
prefetchers, which stop at a 4 KiB page's end, run on. The KV cache stays on 4 KiB pages: the
decode attention measured no faster on huge pages (11.3-14.7 ms against 14.6-15.0).

``collapse(ranges)`` asks the kernel to move the 2 MiB-aligned parts of the weights' address
ranges onto huge pages (``madvise(MADV_COLLAPSE)``, Linux 6.1 and later; it copies, 0.3-1.6 GB/s
here), only where all their pages are resident (``mincore``): a collapse fills in the pages a
range lacks, which would grow the resident size. The ranges are not marked MADV_HUGEPAGE, so
later faults there stay 4 KiB pages. Where THP is "never", the kernel is older or the call
fails, nothing changes and one debug line says why.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MADV_COLLAPSE = 25  # linux/mman.h, Linux 6.1
HUGE_PAGE = 2 << 20
MERGE_GAP = 8 << 20  # weights closer than this are one range: what lies between is resident too (mincore checks)
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_LOW_BIT = bytes(byte & 1 for byte in range(256))  # mincore's "resident" bit; the others are reserved


def thp_mode() -> str:
    """The kernel's THP mode ("always", "madvise", "never"), "" where it has none (not Linux)."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return ""
    return next((word.strip("[]") for word in text.split() if word.startswith("[")), "")


def weight_ranges(tensors: Iterable[torch.Tensor], gap: int = MERGE_GAP) -> list[tuple[int, int]]:
    """CPU tensors -> the address ranges [start, end) of their storage, sorted; ranges less than
    ``gap`` bytes apart merged (views of one storage are one range; weights the allocator placed
    one after another, a header or a small block between them, one run). oneDNN's opaque packed
    weights count from their data pointer for their elements' bytes."""
    spans = []
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.numel():
            continue
        if t.is_mkldnn:
            start, size = torch.ops.mkldnn.data_ptr(t), t.numel() * t.element_size()
        else:
            start, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        spans.append((start, start + size))
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def resident_runs(first: int, resident: bytes, page: int) -> list[tuple[int, int]]:
    """``resident``: mincore's vector (a byte per page, bit 0 set when resident) for the range
    starting at ``first`` (2 MiB-aligned) -> its runs of whole 2 MiB pages all resident."""
    per, bits, runs = HUGE_PAGE // page, resident.translate(_LOW_BIT), []
    for i in range(0, len(bits) // per * per, per):
        if 0 in bits[i:i + per]:
            continue
        at = first + i * page
        if runs and runs[-1][1] == at:
            runs[-1][1] = at + HUGE_PAGE
        else:
            runs.append([at, at + HUGE_PAGE])
    return [(a, b) for a, b in runs]


def _residency(libc, first: int, last: int, page: int) -> bytes:
    """mincore's vector for [first, last), asked one 2 MiB page at a time: a merged range may span
    a hole between two mappings, where mincore fails (ENOMEM); that page then counts as absent."""
    vector, out = (ctypes.c_ubyte * (HUGE_PAGE // page))(), bytearray()
    for at in range(first, last, HUGE_PAGE):
        out += bytes(vector) if libc.mincore(ctypes.c_void_p(at), HUGE_PAGE, vector) == 0 else bytes(len(vector))
    return bytes(out)


def collapse(ranges: Iterable[tuple[int, int]]) -> int:
    """Move the wholly resident 2 MiB pages inside ``ranges`` onto huge pages -> bytes moved
    (0 where nothing could be)."""
    mode = thp_mode()
    if not sys.platform.startswith("linux") or mode in ("", "never"):
        logger.debug("Huge pages: THP is %s here; the weights stay on 4 KiB pages", mode or "absent")
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError as error:
        logger.debug("Huge pages: %s", error)
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page, moved = os.sysconf("SC_PAGE_SIZE"), 0
    for start, end in ranges:
        first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
        for a, b in resident_runs(first, _residency(libc, first, last, page), page):
            if libc.madvise(ctypes.c_void_p(a), b - a, MADV_COLLAPSE) == 0:
                moved += b - a
            elif ctypes.get_errno() == errno.EINVAL:
                logger.debug("Huge pages: this kernel has no MADV_COLLAPSE (Linux 6.1 and later)")
                return moved
    return moved
