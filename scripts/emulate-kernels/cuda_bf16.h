// CPU stand-in for CUDA's <cuda_bf16.h>, for the HIP-CPU emulation of kernels.cu: the bf16 type and
// the conversions the kernels use (round to nearest even, as __float2bfloat16).
#pragma once
#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
  uint16_t bits;
};

inline float __bfloat162float(__nv_bfloat16 h) {
  uint32_t u = (uint32_t)h.bits << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline __nv_bfloat16 __float2bfloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  __nv_bfloat16 h;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    h.bits = 0x7fc0;  // NaN
    return h;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  h.bits = (uint16_t)(u >> 16);
  return h;
}

inline uint16_t __bfloat16_as_ushort(__nv_bfloat16 h) { return h.bits; }

inline __nv_bfloat16 __ushort_as_bfloat16(uint16_t b) {
  __nv_bfloat16 h;
  h.bits = b;
  return h;
}
