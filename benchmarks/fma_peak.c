// The arithmetic ceiling of one core: a loop of independent multiply-adds on registers only (no
// memory), as many in flight as the pipes need, for the instruction the linear kernels use:
//   bf16: vdpbf16ps zmm (AVX-512 BF16): 16 float32 lanes, each adding two bf16 products, 64 FLOP
//   fp32: vfmadd231ps zmm (AVX-512F) or ymm (AVX2 + FMA): 32 or 16 FLOP
// Usage: fma_peak bf16|fp32-512|fp32-256 SECONDS -> prints "GFLOP/s" for this one thread.
// benchmarks/fma_peak.py builds it with gcc and runs one copy per core at once.
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHAINS 12  // independent accumulators: more than latency x pipes (Zen 4: 6 x 2, Sapphire Rapids: 4 x 2)

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

__attribute__((target("avx512f,avx512bf16"))) static double bf16(long iters) {
  __m512 acc[CHAINS];
  for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_setzero_ps();
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = a;
  for (long n = 0; n < iters; n++) {
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    __asm__ volatile("" : "+v"(a));  // keeps the loop from being folded
  }
  float sum = 0;
  for (int i = 0; i < CHAINS; i++) sum += _mm512_reduce_add_ps(acc[i]);
  return sum;
}

__attribute__((target("avx512f"))) static double fp32_512(long iters) {
  __m512 acc[CHAINS];
  for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_setzero_ps();
  __m512 a = _mm512_set1_ps(1e-3f), b = a;
  for (long n = 0; n < iters; n++) {
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
    __asm__ volatile("" : "+v"(a));
  }
  float sum = 0;
  for (int i = 0; i < CHAINS; i++) sum += _mm512_reduce_add_ps(acc[i]);
  return sum;
}

__attribute__((target("avx2,fma"))) static double fp32_256(long iters) {
  __m256 acc[CHAINS];
  for (int i = 0; i < CHAINS; i++) acc[i] = _mm256_setzero_ps();
  __m256 a = _mm256_set1_ps(1e-3f), b = a;
  for (long n = 0; n < iters; n++) {
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm256_fmadd_ps(a, b, acc[i]);
    __asm__ volatile("" : "+x"(a));
  }
  float sum = 0;
  float lanes[8];
  for (int i = 0; i < CHAINS; i++) {
    _mm256_storeu_ps(lanes, acc[i]);
    for (int l = 0; l < 8; l++) sum += lanes[l];
  }
  return sum;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s bf16|fp32-512|fp32-256 SECONDS\n", argv[0]);
    return 2;
  }
  double (*body)(long) = !strcmp(argv[1], "bf16") ? bf16 : !strcmp(argv[1], "fp32-512") ? fp32_512 : fp32_256;
  const double flop_per_op = !strcmp(argv[1], "bf16") ? 64 : !strcmp(argv[1], "fp32-512") ? 32 : 16;
  const double seconds = atof(argv[2]);
  long iters = 1 << 20;
  double start = now(), sink = 0;
  while (now() - start < 0.2) sink += body(iters);  // warm up the clock
  start = now();
  long done = 0;
  while (now() - start < seconds) {
    sink += body(iters);
    done += iters;
  }
  const double elapsed = now() - start;
  printf("%.1f GFLOP/s%s\n", done * CHAINS * flop_per_op / elapsed / 1e9, sink == 12345.0 ? " " : "");
  return 0;
}
