"""The compiled CPU kernels (tengyun/csrc/): built once, loaded lazily, optional.

``make setup`` builds them (``python -m tengyun.platforms.cpu.native --build``) with
``torch.utils.cpp_extension`` (g++, ninja, OpenMP) into
``$TORCH_EXTENSIONS_DIR/tengyun_cpu_kernels_<hash>/`` (default ``~/.cache/tengyun/torch_extensions``),
never into the repository. The hash covers the sources, the flags and the torch and Python versions, so
an edited source or another torch is a different folder: a stale library is never loaded.

At run time ``load()`` only loads a library that is already built (no compiler runs while an engine
starts); when there is none, or it fails to load, it returns why, the CPU platform picks the
pure-PyTorch attention (``torch_sdpa``) and logs that reason in one line.

Instruction sets: the build passes no ``-march`` flag, so the library loads on any x86-64 CPU and the
build host need not be the run host. paged_attention.cpp compiles the kernel three times, under
``#pragma GCC target`` for AVX-512 (F/BW/VL/DQ), for AVX2 + FMA + F16C, and as portable C++, and picks
the copy at load time from what the CPU reports (``__builtin_cpu_supports``): a CPU without AVX-512
runs the AVX2 or portable copy, never an illegal instruction. ``isa()`` says which one runs.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

NAME = "tengyun_cpu_kernels"
CSRC = Path(__file__).parents[2] / "csrc"
COMPILED = [CSRC / name for name in ("paged_attention.cpp", "layer_ops.cpp", "packed_gemv.cpp",  # translation units
                                     "amx_packed_gemm.cpp", "quant_gemv.cpp", "int8_gemv.cpp", "sampling.cpp",
                                     "moe_grouped.cpp", "thread_affinity.cpp", "bf16_weight_gemm.cpp",
                                     "prefill_attention_bf16.cpp")]
SOURCES = [*COMPILED, *(CSRC / name for name in ("cpu_isa.h", "paged_attention_impl.h", "paged_attention_vec.h",
                                                 "layer_ops_impl.h", "half_convert.h", "sampling_impl.h",
                                                 "paged_attention_bf16.h", "paged_attention_prefetch.h",
                                                 "paged_attention_threads.h"))]
# -O3 and OpenMP only: no -march (see the module docstring). libgomp.so.1 resolves to the copy torch
# already loaded, so the kernel's threads are torch's threads (torch.set_num_threads applies).
CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)


def extensions_root() -> Path:
    """Where builds live: $TORCH_EXTENSIONS_DIR, else ~/.cache/tengyun/torch_extensions."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "tengyun" / "torch_extensions"


def build_directory() -> Path:
    """This source + flags + torch + Python's folder under extensions_root()."""
    digest = hashlib.sha256()
    for path in SOURCES:
        digest.update(path.read_bytes())
    digest.update(" ".join([*CFLAGS, *LDFLAGS, torch.__version__, sys.version]).encode())
    return extensions_root() / f"{NAME}_{digest.hexdigest()[:16]}"


def library_path() -> Path:
    return build_directory() / f"{NAME}.so"


def build_tools_missing() -> str | None:
    """None when a C++ compiler ($CXX, else c++) and ninja are on PATH, else what is missing."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler} is not on PATH; apt-get install g++)"
    if not cpp_extension.is_ninja_available():
        return "no ninja (pip install ninja)"
    return None


def build(verbose: bool = False) -> Path:
    """Compile into build_directory() (a no-op when it is current) -> the library's path. Raises
    when there is no compiler, ninja or torch headers, or the source fails to compile."""
    from torch.utils import cpp_extension

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    # Fresh lists: cpp_extension.load appends to the ones it is given.
    cpp_extension.load(name=NAME, sources=[str(path) for path in COMPILED], extra_cflags=list(CFLAGS),
                       extra_ldflags=list(LDFLAGS), extra_include_paths=[str(CSRC)], build_directory=str(directory),
                       is_python_module=False, verbose=verbose)
    return library_path()


_loaded: Path | None = None  # a library registers the torch.ops.tengyun namespace once per process


def load() -> str | None:
    """Load the built library (once per process) -> None when its ops are ready, else why not
    (a sentence for the log). Never compiles."""
    global _loaded
    if _loaded is not None:
        return None
    path = library_path()
    if not path.is_file():
        return (f"the CPU kernels are not built (no {path}); run `python -m tengyun.platforms.cpu.native "
                "--build`, which `make setup` does")
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as error:
        return f"the CPU kernels at {path} failed to load ({error}); rebuild with --build"
    _loaded = path
    return None


@functools.cache
def load_error() -> str | None:
    """load(), remembered for the process: None when the kernels are usable."""
    return load()


def isa() -> str:
    """The instruction set the loaded kernels run: "avx512", "avx2" or "generic"."""
    return torch.ops.tengyun.paged_attention_isa("")


def paged_decode_attention(out, q, k_cache, v_cache, block_tables, seq_lens, scale: float,
                           query_start_loc=None) -> None:
    """out [T, Hq, D] <- attention of q [T, Hq, D] over the first seq_lens[b] tokens of each row's
    blocks; caches [N, block_size, Hkv, D], block_tables [B, max_blocks] int64, seq_lens [B] int64.
    query_start_loc None: one query token per sequence (T = B). Else [B + 1] int64: sequence b's
    query tokens are rows qsl[b] .. qsl[b + 1] - 1, the last ones of its context, each causal
    (token i of n sees seq_lens[b] - (n - 1 - i) tokens). The kernels must be loaded
    (load_error() is None)."""
    torch.ops.tengyun.paged_decode_attention(out, q, k_cache, v_cache, block_tables, seq_lens, scale, query_start_loc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="compile the kernels (a no-op when current)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.build:
        start = time.perf_counter()
        try:
            missing = build_tools_missing()
            if missing:
                raise RuntimeError(missing)
            path = build(verbose=args.verbose)
        except Exception as error:  # noqa: BLE001 - any build failure leaves the PyTorch path in place
            print(f"tengyun: CPU kernels not built ({type(error).__name__}: {error}); attention on CPU "
                  "will run the pure-PyTorch path", file=sys.stderr)
            return 0
        print(f"tengyun: CPU kernels built in {time.perf_counter() - start:.1f} s: {path}")
    error = load()
    print(f"tengyun: CPU kernels: {error or 'loaded, ' + isa()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
