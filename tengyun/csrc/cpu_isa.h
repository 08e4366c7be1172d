// The instruction sets the compiled CPU kernels are built for, the one in use, and their dtypes.
//
// The library is built without -march, so it loads on any x86-64 (or other) CPU; each kernel file
// includes its *_impl.h three times, inside namespaces avx512 / avx2 / generic and under matching
// `#pragma GCC target`s, and dispatches on `active_isa`, chosen at load time from what the CPU
// reports (__builtin_cpu_supports), never from what the build host had.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TY_HAVE_X86_COPIES 1
#include <immintrin.h>
#else
#define TY_HAVE_X86_COPIES 0
#endif


namespace tengyun {

enum class Isa { generic, avx2, avx512 };
enum class DType { f32, bf16, f16 };  // the element types the kernels read and write

bool cpu_has(Isa isa);
extern Isa active_isa;  // defined in paged_attention.cpp; switched by paged_attention_isa (tests)

}  // namespace tengyun
