"""CpuPlatform's allocator settings, seen through glibc's own accounting (mallinfo2) and the
process's resident size: after after_load(), a 64 MiB tensor comes from the heap, not from a
fresh mmap that page-faults on every first touch, and freed blocks stay resident until the
process's last engine is released; unless the user set glibc's own malloc variables, which then
win. Run in a subprocess: the settings are process-wide."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

SCRIPT = """
import ctypes, ctypes.util, os, torch
from tengyun.platforms.cpu.platform import CpuPlatform

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2

def mmapped_by_a_64_mib_tensor():
    before = libc.mallinfo2().hblkhd  # bytes in mmapped chunks
    tensor = torch.ones(64 << 20, dtype=torch.uint8)
    return libc.mallinfo2().hblkhd - before

def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20

platform = CpuPlatform()
platform.init_process()  # before loading: blocks above 32 MiB are still mmapped (and given back)
print(mmapped_by_a_64_mib_tensor() >= 64 << 20)
platform.after_load()
print(mmapped_by_a_64_mib_tensor() == 0)
platform.after_load()  # a second engine in the process
block = torch.ones(256 << 20, dtype=torch.uint8)
del block  # freed: kept in the heap for reuse
kept = resident_mib()
platform.release()
print(resident_mib() > kept - 200)  # the other engine still runs: still kept
platform.release()  # the last one gone: the heap's free pages go back to the system
print(resident_mib() < kept - 200)
"""


def _has_mallinfo2() -> bool:
    name = ctypes.util.find_library("c")
    return bool(name) and hasattr(ctypes.CDLL(name), "mallinfo2")


@pytest.mark.skipif(not _has_mallinfo2(), reason="glibc >= 2.33 (mallinfo2) needed to observe the allocator")
def test_after_load_serves_large_blocks_from_the_heap_until_the_last_release():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True", "True"]


@pytest.mark.skipif(not _has_mallinfo2(), reason="glibc >= 2.33 (mallinfo2) needed to observe the allocator")
def test_glibcs_own_variable_keeps_large_blocks_mmapped_and_so_given_back():
    env = {**os.environ, "MALLOC_MMAP_MAX_": "65536"}  # glibc's default: what a memory-tight host asks for
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "True", "False"]  # mmapped: given back at its free
