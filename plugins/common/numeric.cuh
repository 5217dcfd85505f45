// Host + device element types for the plugins' kernel math: storage is raw bits, converted by the same integer
// arithmetic on both sides, so the host build (tests on CPU) and the CUDA build read and write identical values.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define BEAMTRT_HD __host__ __device__ __forceinline__
#else
#define BEAMTRT_HD inline
#endif

namespace beamtrt {

// Element types of kernel arguments (the host tests pass these values through ctypes).
enum class DType : int32_t { kFLOAT = 0, kHALF = 1, kBF16 = 2, kFP8 = 3, kINT32 = 4 };

BEAMTRT_HD float bitsToFloat(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

BEAMTRT_HD uint32_t floatToBits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

// x + a * b with the product rounded before the sum, as the host build (-ffp-contract=off) and PyTorch compute it;
// nvcc would otherwise fuse the two into one FMA, rounded once, and the device's sums would differ in the last bit.
BEAMTRT_HD float addProduct(float x, float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(x, __fmul_rn(a, b));
#else
  return x + a * b;
#endif
}

BEAMTRT_HD float bf16ToFloat(uint16_t h) { return bitsToFloat(uint32_t(h) << 16); }

BEAMTRT_HD uint16_t floatToBf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u = floatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

BEAMTRT_HD float halfToFloat(uint16_t h) {  // IEEE binary16 -> binary32, exact
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1fu) return bitsToFloat(sign | 0x7f800000u | (man << 13));
  if (exp != 0) return bitsToFloat(sign | ((exp + 112u) << 23) | (man << 13));
  const float sub = float(man) * 5.9604644775390625e-8f;  // 2^-24: subnormal half
  return sign ? -sub : sub;
}

BEAMTRT_HD uint16_t floatToHalf(float f) {  // round to nearest even, saturating to inf like a cast
  const uint32_t u = floatToBits(f), sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);                 // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);                // >= 65520 rounds to inf
  if (a < 0x38800000u) {                                                // below 2^-14: subnormal (or zero)
    const float scaled = bitsToFloat(a) * 16777216.0f;                  // in units of 2^-24, exact
    uint32_t m = uint32_t(scaled);
    const float rest = scaled - float(m);
    if (rest > 0.5f || (rest == 0.5f && (m & 1u))) m++;
    return uint16_t(sign | m);
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);                           // round the 13 dropped bits
  return uint16_t(sign | (((r >> 23) - 112u) << 10) | ((r >> 13) & 0x3ffu));
}

BEAMTRT_HD float fp8e4m3ToFloat(uint8_t b) {  // OCP E4M3 (bias 7, no inf, 0x7f / 0xff = NaN), exact
  const uint32_t sign = uint32_t(b & 0x80u) << 24, exp = (b >> 3) & 0xfu, man = b & 0x7u;
  if (exp == 0xfu && man == 0x7u) return bitsToFloat(sign | 0x7fc00000u);
  if (exp != 0) return bitsToFloat(sign | ((exp + 120u) << 23) | (man << 20));
  const float sub = float(man) * 0.001953125f;  // 2^-9
  return sign ? -sub : sub;
}

BEAMTRT_HD uint8_t floatToFp8e4m3(float f) {  // round to nearest even, saturating to +-448 (as TensorRT's cast)
  const uint32_t u = floatToBits(f), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint8_t(sign | 0x7fu);
  const float x = bitsToFloat(a);
  if (x >= 448.0f) return uint8_t(sign | 0x7eu);
  if (x < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9
    const float scaled = x * 512.0f;
    uint32_t m = uint32_t(scaled);
    const float rest = scaled - float(m);
    if (rest > 0.5f || (rest == 0.5f && (m & 1u))) m++;
    return uint8_t(sign | m);  // m == 8 is the smallest normal, encoded the same way
  }
  const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);  // round the 20 dropped bits
  return uint8_t(sign | (((r >> 23) - 120u) << 3) | ((r >> 20) & 0x7u));
}

// Element i of a tensor of `dtype` as fp32; fp8 values are multiplied by `scale` (1 for the other types).
BEAMTRT_HD float load(void const* p, int64_t i, DType dtype, float scale = 1.0f) {
  switch (dtype) {
    case DType::kFLOAT: return static_cast<float const*>(p)[i];
    case DType::kHALF: return halfToFloat(static_cast<uint16_t const*>(p)[i]);
    case DType::kBF16: return bf16ToFloat(static_cast<uint16_t const*>(p)[i]);
    case DType::kFP8: return fp8e4m3ToFloat(static_cast<uint8_t const*>(p)[i]) * scale;
    default: return static_cast<float>(static_cast<int32_t const*>(p)[i]);
  }
}

// Store v as element i; fp8 stores v / scale.
BEAMTRT_HD void store(void* p, int64_t i, float v, DType dtype, float scale = 1.0f) {
  switch (dtype) {
    case DType::kFLOAT: static_cast<float*>(p)[i] = v; break;
    case DType::kHALF: static_cast<uint16_t*>(p)[i] = floatToHalf(v); break;
    case DType::kBF16: static_cast<uint16_t*>(p)[i] = floatToBf16(v); break;
    case DType::kFP8: static_cast<uint8_t*>(p)[i] = floatToFp8e4m3(v / scale); break;
    default: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
  }
}

BEAMTRT_HD int64_t elementSize(DType dtype) {
  return dtype == DType::kFP8 ? 1 : (dtype == DType::kHALF || dtype == DType::kBF16) ? 2 : 4;
}

}  // namespace beamtrt
