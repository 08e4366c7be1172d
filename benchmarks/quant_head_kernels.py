"""The quantised kernels this machine's GGUF LM head, embedding and GPTQ 8-bit layers run, timed
against their dense bf16 counterparts (2 threads unless OMP_NUM_THREADS says otherwise; median of
10 calls, ms). Random weights of Qwen2.5-Coder-0.5B's shapes:

    PYTHONPATH=$PWD python benchmarks/quant_head_kernels.py

- head: a 151936 x 896 Q8_0 LM head through CpuGgufCompiledKernel vs oneDNN packed bf16;
- lookup: rows read from the compiled layout (Q8_0, Q4_0) vs F.embedding on a dense bf16 weight;
- gptq8: one 4864 x 896 GPTQ 8-bit layer (group 128) through CpuInt8WeightOnlyKernel vs the
  dequantizing reference.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "quantization"))
from awq_gptq_layouts import Format, quantize_layer  # noqa: E402

from tengyun.platforms.cpu import native as cpu_kernels  # noqa: E402
from tengyun.layers.quant_kernels import reference_kernel  # noqa: E402
from tengyun.platforms.cpu.platform import CpuPlatform  # noqa: E402
from tengyun.platforms.cpu.kernels.gguf import CpuGgufCompiledKernel  # noqa: E402
from tengyun.platforms.cpu.kernels.linear import CpuPackedLinearKernel  # noqa: E402
from tengyun.quantization.config import detect_quantization  # noqa: E402
from tengyun.quantization.gguf import scheme_for_type  # noqa: E402

VOCAB, HIDDEN = 151936, 896


def median_ms(fn, n: int = 10) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2] * 1e3


def q8_0_blocks(w: torch.Tensor) -> torch.Tensor:
    """w [rows, in] -> GGUF Q8_0 blocks uint8 [rows, in / 32, 34] (fp16 d, 32 int8)."""
    groups = w.view(w.shape[0], -1, 32)
    d = groups.abs().amax(-1, keepdim=True) / 127
    q = torch.round(groups / d).to(torch.int8)
    return torch.cat([d.half().view(torch.uint8).view(w.shape[0], -1, 2), q.view(torch.uint8)], -1).contiguous()


def head() -> None:
    w = torch.randn(VOCAB, HIDDEN) * 0.02
    kernel = CpuGgufCompiledKernel(scheme_for_type("Q8_0"))
    prepared = kernel.prepare({"qweight": q8_0_blocks(w)})
    dense = CpuPackedLinearKernel(torch.bfloat16)
    packed = dense.prepare(w.bfloat16())
    print("| rows | Q8_0 head ms | bf16 dense head ms |\n|---|---|---|")
    for rows in (1, 4, 8, 16, 32):
        x = torch.randn(rows, HIDDEN).bfloat16()
        print(f"| {rows} | {median_ms(lambda x=x: kernel.apply(x, prepared, None)):.2f} | "
              f"{median_ms(lambda x=x: dense.apply(x, packed, None)):.2f} |")


def lookup() -> None:
    dense = torch.randn(VOCAB, HIDDEN).bfloat16()
    print("\n| type | tokens | compiled-layout rows ms | F.embedding (bf16) ms |\n|---|---|---|---|")
    for type_name in ("Q8_0", "Q4_0"):
        kernel = CpuGgufCompiledKernel(scheme_for_type(type_name))
        blocks = q8_0_blocks(dense.float())  # Q4_0: the same fp16 d, nibbles from q's low bits
        if type_name == "Q4_0":
            blocks = torch.cat([blocks[..., :2], torch.randint(0, 256, (VOCAB, HIDDEN // 32, 16), dtype=torch.uint8)],
                               -1)
        read = kernel.row_reader(kernel.prepare({"qweight": blocks}), torch.bfloat16)
        for tokens in (1, 32, 4096):
            ids = torch.randint(0, VOCAB, (tokens,))
            print(f"| {type_name} | {tokens} | {median_ms(lambda read=read, ids=ids: read(ids)):.3f} | "
                  f"{median_ms(lambda ids=ids: F.embedding(ids, dense)):.3f} |")


def gptq8() -> None:
    fmt = Format("gptq", bits=8, group=128)
    scheme = detect_quantization({"quantization_config": fmt.quantization_config()}).groups[0].scheme
    stored, _ = quantize_layer(fmt, "m.p", 4864, HIDDEN, np.random.default_rng(0))
    tensors = {t.name: stored[f"m.p.{t.name}"].bfloat16() if t.dtype == "act" else stored[f"m.p.{t.name}"]
               for t in scheme.tensors if t.kept}
    kernel = CpuPlatform().quant_linear_kernel(scheme, torch.bfloat16)
    prepared, reference = kernel.prepare(dict(tensors)), reference_kernel(scheme)
    print(f"\n| rows | {type(kernel).__name__} ms | reference ms |\n|---|---|---|")
    for rows in (1, 16, 32):
        x = torch.randn(rows, HIDDEN).bfloat16()
        print(f"| {rows} | {median_ms(lambda x=x: kernel.apply(x, prepared, None)):.3f} | "
              f"{median_ms(lambda x=x: reference.apply(x, tensors, None), 3):.3f} |")


def main() -> None:
    if cpu_kernels.load_error() is not None:
        raise SystemExit(f"the compiled kernels are needed: {cpu_kernels.load_error()}")
    torch.manual_seed(0)
    head()
    lookup()
    gptq8()


if __name__ == "__main__":
    main()
