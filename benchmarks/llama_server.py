"""llama.cpp's own HTTP server (`llama-server`) as a served baseline: built once from the llama.cpp
sources vendored in the llama-cpp-python sdist that benchmarks/batch1_decode.py uses, so both
benchmarks run the same llama.cpp.

llama-cpp-python's own server takes one request at a time; `llama-server` batches continuously
over `-np` slots (one sequence each), which is how llama.cpp serves concurrent clients.

Set-up, once, under ${TENGYUN_CACHE_DIR:-~/.cache/tengyun}/bench-venvs/llama-server-VERSION[-noamx]:
`pip download` of the sdist (llama-cpp-python==LLAMA_CPP_VERSION), then cmake + ninja with Debian's
g++, static libraries, the target `llama-server` alone, no web UI, no TLS. Built `nice -n 10` with
2 jobs: ~15-20 min on 2 cores. ISA as batch1_decode.py chooses it: GGML_NATIVE, or AVX-512
without AMX where the CPU has AMX (AVX512_WITHOUT_AMX). Only `bin/llama-server` is kept.

The server runs a bf16 GGUF that batch1_decode.gguf_file wrote from the same HF folder, with
`--parallel SLOTS --ctx-size SLOTS * MAX_MODEL_LEN --kv-unified` (every slot can hold a whole
request), `--threads N --threads-batch N`, `--cont-batching`, and `--no-webui`. It answers vLLM's
`/v1/completions` (prompt as text, `max_tokens`, `ignore_eos`) and `/health`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from batch1_decode import AVX512_WITHOUT_AMX, LLAMA_CPP_VERSION, cache_root  # noqa: E402

CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
                 "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF")


def binary() -> Path:
    """The cached `llama-server` for this CPU, built on first use (see the module docstring)."""
    from tengyun.host.probe import cpu_flags

    amx = "amx_int8" in cpu_flags()  # ggml's AMX backend is its int8 one
    home = cache_root() / "bench-venvs" / f"llama-server-{LLAMA_CPP_VERSION}{'-noamx' if amx else ''}"
    server = home / "bin" / "llama-server"
    if server.is_file():
        return server
    scratch = Path(tempfile.mkdtemp(prefix="llama-server-build-"))
    print(f"building llama-server {LLAMA_CPP_VERSION} into {home} (once; ~15-20 min)", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", str(scratch)], check=True, capture_output=True)
    subprocess.run(["tar", "xzf", next(scratch.glob("*.tar.gz")), "-C", str(scratch)], check=True)
    source = next(scratch.glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
    isa = (AVX512_WITHOUT_AMX if amx else "-DGGML_NATIVE=ON").split()
    build = scratch / "build"
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", *CMAKE_OPTIONS, *isa], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["nice", "-n", "10", "cmake", "--build", str(build), "--target", "llama-server", "-j", "2"],
                   check=True, stdout=subprocess.DEVNULL)
    server.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(build / "bin" / "llama-server", server)
    shutil.rmtree(scratch, ignore_errors=True)
    return server


def command(gguf: Path, port: int, slots: int, max_model_len: int, threads: int, alias: str) -> list[str]:
    """`llama-server` on `gguf` with `slots` sequences of up to `max_model_len` tokens each."""
    return [str(binary()), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", alias,
            "--parallel", str(slots), "--ctx-size", str(slots * max_model_len), "--kv-unified", "--cont-batching",
            "--threads", str(threads), "--threads-batch", str(threads), "--no-webui"]


if __name__ == "__main__":
    print(binary())
