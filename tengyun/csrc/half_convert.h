// bfloat16 / float16 bits -> float32, for the kernels' scalar tails and their portable copies.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace tengyun {

inline float bf16_to_float(uint16_t bits) {  // bfloat16 is the high half of a float32
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

inline float fp16_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

}  // namespace tengyun
