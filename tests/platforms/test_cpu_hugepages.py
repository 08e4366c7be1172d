"""The weights on 2 MiB pages (platforms/cpu/runtime/hugepages.py): which address ranges are moved
(only 2 MiB pages inside the weights' ranges whose pages are all resident), that the kernel then
holds them on huge pages (/proc smaps' AnonHugePages) without the resident size growing, and that
a CPU engine's worker hands its weights over once loaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tengyun.platforms.cpu.runtime import hugepages as cpu_hugepages
from tengyun.platforms.cpu.runtime.hugepages import HUGE_PAGE

PAGE = 4096


def _huge_bytes_of_mapping(address: int) -> int:
    """AnonHugePages of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's header: "start-end perms ..."
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    return 0


def _collapses_here() -> bool:
    buffer = torch.ones(8 << 20, dtype=torch.uint8)
    return cpu_hugepages.collapse(cpu_hugepages.weight_ranges([buffer])) > 0


needs_collapse = pytest.mark.skipif(not sys.platform.startswith("linux") or not _collapses_here(),
                                    reason="THP is off or the kernel has no MADV_COLLAPSE (Linux 6.1+)")


def test_only_whole_resident_huge_pages_are_moved():
    first = 64 * HUGE_PAGE
    resident = bytearray([1]) * (5 * HUGE_PAGE // PAGE)
    resident[2 * HUGE_PAGE // PAGE + 7] = 0  # the third 2 MiB page lacks one page
    resident[4 * HUGE_PAGE // PAGE] = 0x03  # reserved bits set beside the resident bit: resident
    runs = cpu_hugepages.resident_runs(first, bytes(resident), PAGE)
    assert runs == [(first, first + 2 * HUGE_PAGE), (first + 3 * HUGE_PAGE, first + 5 * HUGE_PAGE)]
    assert cpu_hugepages.resident_runs(first, bytes(HUGE_PAGE // PAGE - 1), PAGE) == []  # less than one


def test_weight_ranges_merge_views_and_neighbours_and_read_onednns_pointer():
    base = torch.zeros(1 << 20)
    views = [base[:10], base[100:], base.view(1024, 1024)]
    start = base.untyped_storage().data_ptr()
    assert cpu_hugepages.weight_ranges(views) == [(start, start + 4 * (1 << 20))]
    other = torch.zeros(1 << 20)
    assert len(cpu_hugepages.weight_ranges([base, other], gap=0)) == 2
    assert len(cpu_hugepages.weight_ranges([base, other], gap=1 << 62)) == 1
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(1024, 512), 64)
        assert packed.is_mkldnn
        (a, b), = cpu_hugepages.weight_ranges([packed])
        assert a == torch.ops.mkldnn.data_ptr(packed) and b - a == 1024 * 512 * 4


MOVES = """
import ctypes, mmap, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_cpu_hugepages import _huge_bytes_of_mapping
from tengyun.platforms.cpu.runtime import hugepages as cpu_hugepages

weight = torch.ones(16 << 20, dtype=torch.uint8)  # written: resident
moved = cpu_hugepages.collapse(cpu_hugepages.weight_ranges([weight]))
print(moved, _huge_bytes_of_mapping(weight.data_ptr()))
sparse = mmap.mmap(-1, 10 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # untouched: nothing resident
address = -(-ctypes.addressof(ctypes.c_char.from_buffer(sparse)) // (2 << 20)) * (2 << 20)
ctypes.memset(address, 1, 4 << 20)  # the first 4 of 8 aligned MiB touched
print(cpu_hugepages.collapse([(address, address + (8 << 20))]), _huge_bytes_of_mapping(address))
"""


@needs_collapse
def test_a_weight_moves_onto_huge_pages_and_a_sparse_range_does_not_grow():
    """In a fresh process (smaps counts a whole mapping's huge pages; a long-lived one holds others)."""
    out = subprocess.run([sys.executable, "-c", MOVES, str(Path(__file__).parent)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    (moved, held), (sparse_moved, sparse_held) = (map(int, line.split()) for line in out.stdout.split("\n")[:2])
    assert moved >= 12 << 20 and held >= moved  # at least the 2 MiB pages inside its 16 MiB
    assert sparse_moved == sparse_held == 4 << 20  # the touched half only: the untouched half not filled in


ENGINE = """
import sys
from tengyun import LLM
from tengyun.platforms.cpu.runtime.hugepages import thp_mode

def huge():
    text = open("/proc/self/smaps_rollup").read()
    return int(text.split("AnonHugePages:")[1].split()[0]) * 1024

before = huge()
llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory="4MiB", max_model_len=64)
print(thp_mode(), before, huge())
"""


@needs_collapse
def test_a_cpu_engine_puts_its_weights_on_huge_pages(tiny_tokenizer_dir, tmp_path):
    """A fresh process (THP "madvise": nothing else asks for huge pages) builds an engine whose
    MLP weights are 4 MiB each: afterwards it holds huge pages it did not before."""
    from conftest import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "model", tiny_tokenizer_dir, "llama", hidden_size=256,
                                  intermediate_size=4096, num_attention_heads=4, num_key_value_heads=2)
    out = subprocess.run([sys.executable, "-c", ENGINE, str(folder)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    mode, before, after = out.stdout.split()[-3:]
    if mode != "madvise":
        pytest.skip(f"THP mode {mode}: other memory may be on huge pages too")
    assert int(after) - int(before) >= 8 << 20, out.stderr


HOLE = """
import mmap, sys
import torch
from tengyun.platforms.cpu.runtime import hugepages as cpu_hugepages

# two 8 MiB anonymous mappings with an unmapped 8 MiB hole between them, taken as one range
block = mmap.mmap(-1, 24 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
import ctypes
base = ctypes.addressof(ctypes.c_char.from_buffer(block))
libc = ctypes.CDLL(None, use_errno=True)
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
start = -(-base // (2 << 20)) * (2 << 20)  # the holes and halves on 2 MiB boundaries
first, hole, second = start, start + (6 << 20), start + (12 << 20)
ctypes.memset(first, 1, 6 << 20)
ctypes.memset(second, 1, 6 << 20)
assert libc.munmap(ctypes.c_void_p(hole), 6 << 20) == 0
print(cpu_hugepages.collapse([(first, second + (6 << 20))]))
"""


@needs_collapse
def test_a_range_spanning_a_hole_between_mappings_still_moves_both_sides():
    out = subprocess.run([sys.executable, "-c", HOLE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == 12 << 20  # both 6 MiB sides, nothing of the hole
