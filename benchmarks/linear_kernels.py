"""Linear-layer kernels on CPU: F.linear vs oneDNN (plain and with the weight prepacked),
at SmolLM2-135M's shapes. Prints milliseconds per call (best of 3 rounds of 30 calls).

``--small-rows``: oneDNN vs the compiled small-batch kernel on the same packed weights
(platforms/cpu/kernels/linear.py) at 1-128 rows (``--rows``: any), through all 30 layers' four
projections of SmolLM2-135M (30 separate random weights, 212 MB in bf16: streamed from memory as in
a decode step, not from cache; ``--shapes qwen2.5-coder``: its 24 layers and LM head, 988 MB), median
of 15 passes taken in turn with oneDNN's (the VM's speed drifts); the row counts where the kernel
wins set MAX_SMALL_ROWS. Where oneDNN packs bfloat16 for AMX, a third column times the AMX tile
kernel (amx_packed_gemm.cpp) on the same weights; the row counts where it wins set AMX_TILE_ROWS.

``--bf16-weights``: where oneDNN packs no bfloat16 weight (AVX2 without AVX-512), the three ways a
layer can run: F.linear in bfloat16 (what bfloat16 ran before the compiled kernel), the compiled
bfloat16-weight kernel (platforms/cpu/kernels/bf16_weights.py) and oneDNN's packed float32 (what
``--dtype float32`` runs: twice the bytes), through the same 30 layers, 1-512 rows.

    python benchmarks/linear_kernels.py
    OMP_NUM_THREADS=2 python benchmarks/linear_kernels.py --small-rows
    OMP_NUM_THREADS=2 python benchmarks/linear_kernels.py --small-rows --shapes qwen2.5-coder --rows 64,128,256,512
    OMP_NUM_THREADS=2 python benchmarks/linear_kernels.py --bf16-weights
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from tengyun.layers.linear_kernel import OneDNNPackedLinearKernel

SHAPES = {"gate_up 576->3072": (3072, 576), "down 1536->576": (576, 1536), "lm_head 576->49152": (49152, 576)}


def _ms(fn, calls: int = 30) -> float:
    best = float("inf")
    for _ in range(3):
        fn()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e3)
    return best


LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
# --small-rows --shapes: each model's decoder layers [(N, K) for qkv, o, gate_up, down] and count, and
# its LM head (N, K) (tied to the embedding in both, so one pass over it per step).
MODEL_SHAPES = {
    "smollm2": (LAYER_SHAPES, 30, None),
    "qwen2.5-coder": ([(1152, 896), (896, 896), (9728, 896), (896, 4864)], 24, (151936, 896)),
}
SMALL_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def small_rows(row_counts: tuple[int, ...] = SMALL_ROWS, shapes: str = "smollm2") -> None:
    from tengyun.platforms.cpu.kernels.linear import CpuPackedLinearKernel, amx_tiles_fit, small_batch_kernel_fits

    layer_shapes, num_layers, head = MODEL_SHAPES[shapes]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {shapes}'s {num_layers} x "
          f"{len(layer_shapes)} layer weights{' and its LM head' if head else ''}")
    print("| dtype | rows | oneDNN ms | small-batch kernel ms | speed-up | kernel GB/s | AMX tiles ms | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        if not small_batch_kernel_fits(dtype):
            print(f"| {dtype} | - | - | - | kernel not available on this CPU/build | - |")
            continue
        kernel = CpuPackedLinearKernel(dtype, max_small_rows=1 << 30)
        layers = [[(k, kernel.prepare(torch.randn(n, k).to(dtype) * 0.02)) for n, k in layer_shapes]
                  for _ in range(num_layers)]  # [(K, packed weight)] per layer
        if head:
            layers.append([(head[1], kernel.prepare(torch.randn(*head).to(dtype) * 0.02))])
        nbytes = sum(w.out_features * k for layer in layers for k, w in layer) * torch.finfo(dtype).bits // 8
        for rows in row_counts:
            xs = {k: torch.randn(rows, k).to(dtype) for _, k in [*layer_shapes, *([head] if head else [])]}
            amx = dtype == torch.bfloat16 and amx_tiles_fit() and all(w.block == 32 for _, w in layers[0])
            times = _alternated(functools.partial(_pass_ms, kernel, layers, xs),
                                ("onednn", "small", *(("amx",) if amx else ())))
            onednn, small = times["onednn"], times["small"]
            tiles = f"{times['amx']:.2f} | {onednn / times['amx']:.2f}x" if amx else "- | -"
            print(f"| {str(dtype).removeprefix('torch.')} | {rows} | {onednn:.2f} | {small:.2f} | "
                  f"{onednn / small:.2f}x | {nbytes / small / 1e6:.0f} | {tiles} |")


def _alternated(run, kinds: tuple, rounds: int = 15, warmup_rounds: int = 0) -> dict:
    """Median ms of run(kind) for each kind, the kinds taking turns pass by pass (a shared VM's speed
    drifts within seconds; blocks of one kind's passes would carry that drift into the ratio). The
    first ``warmup_rounds`` rounds run every kind untimed."""
    times: dict = {kind: [] for kind in kinds}
    for round_ in range(warmup_rounds + rounds):
        for kind in kinds:
            elapsed = run(kind)
            if round_ >= warmup_rounds:
                times[kind].append(elapsed)
    return {kind: statistics.median(values) for kind, values in times.items()}


def _pass_ms(kernel, layers, xs: dict, which: str) -> float:
    """One pass through every layer's [(K, packed weight)] projections (xs: K -> x [rows, K]): the
    small-batch kernel ("small"), the AMX tile kernel ("amx") or oneDNN ("onednn") -> ms."""
    amx = torch.ops.tengyun.amx_packed_gemm.default
    start = time.perf_counter()
    for layer in layers:
        for k, weight in layer:
            if which == "small":
                torch.ops.tengyun.packed_gemv(xs[k], weight.data_ptr, weight.out_features, weight.k_padded, None,
                                              weight.block)
            elif which == "amx":
                amx(xs[k], weight.data_ptr, weight.out_features, weight.k_padded, None)
            else:
                OneDNNPackedLinearKernel.apply(kernel, xs[k], weight.packed, None)
    return (time.perf_counter() - start) * 1e3


def bf16_weights(row_counts: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)) -> None:
    from tengyun.platforms.cpu.kernels.bf16_weights import CpuBf16WeightKernel, bf16_weight_kernel_fits

    if not bf16_weight_kernel_fits():
        raise SystemExit("the compiled bfloat16-weight kernel does not run here (no AVX2, or not built)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; SmolLM2-135M's 30 x 4 layer weights")
    print("| rows | F.linear bf16 ms | bf16-weight kernel ms | speed-up | kernel GB/s | kernel GFLOP/s "
          "| oneDNN fp32 ms | kernel / fp32 |")
    print("|---|---|---|---|---|---|---|---|")
    weights = [[torch.randn(n, k).to(torch.bfloat16) * 0.02 for n, k in LAYER_SHAPES] for _ in range(30)]
    bf16_kernel, onednn = CpuBf16WeightKernel(), OneDNNPackedLinearKernel()
    packed32 = [[onednn.prepare(w.float()) for w in layer] for layer in weights]
    packed16 = [[bf16_kernel.prepare(w) for w in layer] for layer in weights]
    nbytes = 30 * sum(n * k for n, k in LAYER_SHAPES) * 2
    for rows in row_counts:
        flops = 2 * rows * nbytes // 2
        xs = {k: torch.randn(rows, k).to(torch.bfloat16) for _, k in LAYER_SHAPES}
        xs32 = {k: x.float() for k, x in xs.items()}
        passes = 15 if rows <= 64 else 5

        def timed(apply, layers, inputs, passes=passes) -> float:
            def one() -> float:
                start = time.perf_counter()
                for layer in layers:
                    for (_, k), weight in zip(LAYER_SHAPES, layer):
                        apply(inputs[k], weight, None)
                return (time.perf_counter() - start) * 1e3
            return statistics.median(one() for _ in range(passes))

        dense = timed(F.linear, weights, xs)
        kernel = timed(bf16_kernel.apply, packed16, xs)
        fp32 = timed(onednn.apply, packed32, xs32)
        print(f"| {rows} | {dense:.2f} | {kernel:.2f} | {dense / kernel:.2f}x | {nbytes / kernel / 1e6:.0f} | "
              f"{flops / kernel / 1e6:.0f} | {fp32:.2f} | {fp32 / kernel:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small-rows", action="store_true",
                        help="oneDNN vs the small-batch kernel and the AMX tile kernel, 1-128 rows")
    parser.add_argument("--shapes", choices=sorted(MODEL_SHAPES), default="smollm2",
                        help="--small-rows: whose layer shapes (qwen2.5-coder: its 24 layers and LM head)")
    parser.add_argument("--rows", default=None,
                        help="--small-rows: comma-separated row counts (default: 1-128)")
    parser.add_argument("--bf16-weights", action="store_true",
                        help="F.linear bf16 vs the bf16-weight kernel vs oneDNN fp32, 1-512 rows (AVX2)")
    args = parser.parse_args()
    if args.small_rows:
        rows = tuple(int(r) for r in args.rows.split(",")) if args.rows else SMALL_ROWS
        return small_rows(rows, args.shapes)
    if args.bf16_weights:
        return bf16_weights()
    torch.manual_seed(0)
    kernel = OneDNNPackedLinearKernel()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| shape | rows | F.linear ms | oneDNN packed ms | speed-up |")
    print("|---|---|---|---|---|")
    for name, (out_features, in_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features)
        packed = kernel.prepare(weight)
        for rows in (1, 8, 64, 512):
            x = torch.randn(rows, in_features)
            dense = _ms(functools.partial(F.linear, x, weight))
            onednn = _ms(functools.partial(kernel.apply, x, packed, None))
            print(f"| {name} | {rows} | {dense:.3f} | {onednn:.3f} | {dense / onednn:.2f}x |")


if __name__ == "__main__":
    main()
