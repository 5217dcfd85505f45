// Tensor-core windowed attention (device only, sm_80+): one CTA per (sequence, KV head) holds every query row of
// that head (up to kMaxRowTiles x 16) and streams its keys through shared memory once, double-buffered with cp.async,
// with mma.sync m16n8k16 (bf16 / fp16 operands, fp32 accumulation) for both products.
//
// Warps: (row tile of 16 query rows) x (key group). A stage holds kGroups x kKeys keys; key group g takes the g-th
// kKeys of each stage, keeps its own online softmax (running max m, partial row sums z, output O in the mma's
// accumulator registers) and the groups are merged at the end. Scores are fp32 (operands are the I/O values, exact);
// the probabilities enter the P.V product as a bf16 / fp16 pair hi + lo (p - hi), so P carries ~16 bits instead of 8.
// An fp8 ring is widened exactly to the I/O type in shared memory and its scale applied in fp32: to the score of a
// ring key, and to its probability in the P.V product (not to z).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernel.cuh"

namespace beamtrt {
namespace windowed_attention {
namespace mma {

constexpr int32_t kKeys = 32;        // keys per key group per stage
constexpr int32_t kGroups = 2;       // key groups
constexpr int32_t kStageKeys = kKeys * kGroups;
constexpr int32_t kMaxRowTiles = 4;  // query rows per CTA: up to 64
constexpr int32_t kPad = 8;          // elements appended to each shared-memory row: conflict-free fragment loads
constexpr int32_t kMaxThreads = kMaxRowTiles * kGroups * 32;
constexpr float kLog2e = 1.4426950408889634f;

inline bool aligned16(void const* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whether the tensor-core kernel takes this call (its loads are 16-byte vectors).
inline bool supports(Args const& x) {
  const bool io16 = x.ioType == DType::kHALF || x.ioType == DType::kBF16;
  const int32_t rows = x.L * (x.Hq / x.Hkv);
  return io16 && (x.cacheType == x.ioType || x.cacheType == DType::kFP8) && (x.D == 64 || x.D == 128) &&
         rows <= kMaxRowTiles * 16 && aligned16(x.q) && aligned16(x.k) && aligned16(x.v) && aligned16(x.ringK) &&
         aligned16(x.ringV);
}

// Shared memory: two stages of K and V ([kStageKeys][D + kPad] each), then Q ([row tiles x 16][D + kPad]).
inline size_t sharedBytes(int32_t D, int32_t rowTiles) {
  return size_t(2 * 2 * kStageKeys + rowTiles * 16) * size_t(D + kPad) * 2;
}

template <bool BF16>
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t const (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (BF16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  __trap();
#endif
}

// Two floats rounded to the operand type and packed (the first in the low half): one mma operand register.
template <bool BF16>
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  if constexpr (BF16) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t const*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t const*>(&v);
  }
}

template <bool BF16>
__device__ __forceinline__ float2 unpack(uint32_t u) {
  if constexpr (BF16) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 const*>(&u));
  } else {
    return __half22float2(*reinterpret_cast<__half2 const*>(&u));
  }
}

__device__ __forceinline__ uint32_t sharedAddress(void const* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared without registers; bytes = 0 writes zeros (a key past the end).
__device__ __forceinline__ void copy16(void* dst, void const* src, int32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sharedAddress(dst)), "l"(src), "r"(bytes)
               : "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ void commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void waitPrevious() {  // every committed group but the newest has landed
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
#endif
}

// Issue stage s's keys and values into buffers k, v ([kStageKeys][D + kPad]): ring slots first, then the block's
// rows, zeros past `total`. An fp8 ring is widened here (synchronously); everything else is cp.async.
template <int32_t D, bool BF16, bool FP8>
__device__ void loadStage(Args const& x, int32_t n, int32_t h, int32_t visible, int32_t total, int32_t s, uint16_t* k,
                          uint16_t* v) {
  constexpr int32_t kChunks = D / 8;  // 16-byte chunks of a row of D 16-bit values
  for (int32_t i = threadIdx.x; i < kStageKeys * kChunks; i += blockDim.x) {
    const int32_t row = i / kChunks, c = i % kChunks, j = s * kStageKeys + row;
    uint16_t* kd = k + row * (D + kPad) + c * 8;
    uint16_t* vd = v + row * (D + kPad) + c * 8;
    if (j < visible) {
      const int64_t at = ((int64_t(n) * x.Hkv + h) * x.W + j) * D + c * 8;
      if constexpr (FP8) {
        const uint2 kb = *reinterpret_cast<uint2 const*>(static_cast<uint8_t const*>(x.ringK) + at);
        const uint2 vb = *reinterpret_cast<uint2 const*>(static_cast<uint8_t const*>(x.ringV) + at);
        uint32_t kw[4], vw[4];
        #pragma unroll
        for (int32_t e = 0; e < 4; e++) {  // e4m3 -> fp32 -> bf16 / fp16 is exact (3 mantissa bits)
          const uint32_t kx = e < 2 ? kb.x : kb.y, vx = e < 2 ? vb.x : vb.y, sh = (e % 2) * 16;
          kw[e] = pack<BF16>(fp8e4m3ToFloat(uint8_t(kx >> sh)), fp8e4m3ToFloat(uint8_t(kx >> (sh + 8))));
          vw[e] = pack<BF16>(fp8e4m3ToFloat(uint8_t(vx >> sh)), fp8e4m3ToFloat(uint8_t(vx >> (sh + 8))));
        }
        *reinterpret_cast<uint4*>(kd) = make_uint4(kw[0], kw[1], kw[2], kw[3]);
        *reinterpret_cast<uint4*>(vd) = make_uint4(vw[0], vw[1], vw[2], vw[3]);
      } else {
        copy16(kd, static_cast<uint16_t const*>(x.ringK) + at, 16);
        copy16(vd, static_cast<uint16_t const*>(x.ringV) + at, 16);
      }
    } else {
      const bool live = j < total;
      const int64_t at = live ? ((int64_t(n) * x.L + (j - visible)) * x.Hkv + h) * D + c * 8 : 0;
      copy16(kd, static_cast<uint16_t const*>(x.k) + at, live ? 16 : 0);
      copy16(vd, static_cast<uint16_t const*>(x.v) + at, live ? 16 : 0);
    }
  }
}

// Lane layout of m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16"): gid = lane / 4, tig = lane % 4.
// A (16 x 16, row) registers: {row gid, cols 2tig..+1}, {row gid+8, same}, {row gid, cols 2tig+8..+9},
// {row gid+8, same}. B (16 x 8, col): {k 2tig..+1, n gid}, {k 2tig+8..+9, n gid}. C (16 x 8): {row gid, cols 2tig..+1}
// (c0, c1), {row gid+8, same} (c2, c3). Each register holds two 16-bit values, the lower index in the low half.
template <int32_t D, bool BF16, bool FP8>
__global__ void __launch_bounds__(kMaxThreads) attendMmaKernel(Args x) {
  extern __shared__ __align__(16) uint16_t smem[];
  constexpr int32_t kRow = D + kPad, kDTiles = D / 8;
  const int32_t n = blockIdx.x / x.Hkv, h = blockIdx.x % x.Hkv, group = x.Hq / x.Hkv, rows = x.L * group;
  const int32_t rowTiles = (rows + 15) / 16, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t tile = warp % rowTiles, keyGroup = warp / rowTiles, gid = lane / 4, tig = lane % 4;
  const int32_t visible = visibleSlots(x, n), total = visible + x.L, stages = (total + kStageKeys - 1) / kStageKeys;
  auto keys = [&](int32_t s) { return smem + (s % 2) * 2 * kStageKeys * kRow; };  // stage s's buffers
  auto values = [&](int32_t s) { return smem + ((s % 2) * 2 + 1) * kStageKeys * kRow; };
  uint16_t* const qs = smem + 4 * kStageKeys * kRow;

  // Q rows (block row l, head g of the group) -> shared memory, zero rows past `rows`
  for (int32_t i = threadIdx.x; i < rowTiles * 16 * (D / 8); i += blockDim.x) {
    const int32_t r = i / (D / 8), c = i % (D / 8), l = r / group, hq = h * group + r % group;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (r < rows) value = *reinterpret_cast<uint4 const*>(static_cast<uint16_t const*>(x.q) +
                                                        ((int64_t(n) * x.L + l) * x.Hq + hq) * D + c * 8);
    *reinterpret_cast<uint4*>(qs + r * kRow + c * 8) = value;
  }
  loadStage<D, BF16, FP8>(x, n, h, visible, total, 0, keys(0), values(0));
  commit();

  const float scoreScale = x.softmaxScale * kLog2e;  // scores in log2 units: exp2f
  float o[kDTiles][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, z[2] = {0.0f, 0.0f};  // rows gid and gid + 8 of this warp's tile
  for (int32_t s = 0; s < stages; s++) {
    if (s + 1 < stages) loadStage<D, BF16, FP8>(x, n, h, visible, total, s + 1, keys(s + 1), values(s + 1));
    commit();
    waitPrevious();
    __syncthreads();
    uint16_t const* ks = keys(s) + keyGroup * kKeys * kRow;
    uint16_t const* vs = values(s) + keyGroup * kKeys * kRow;
    const int32_t key0 = s * kStageKeys + keyGroup * kKeys;  // this warp's first key

    // scores: [16 rows] x [kKeys keys] in kKeys / 8 accumulator tiles
    float sc[kKeys / 8][4] = {};
    #pragma unroll
    for (int32_t kk = 0; kk < D / 16; kk++) {
      uint16_t const* qr = qs + (tile * 16 + gid) * kRow + kk * 16 + 2 * tig;
      const uint32_t a[4] = {*reinterpret_cast<uint32_t const*>(qr), *reinterpret_cast<uint32_t const*>(qr + 8 * kRow),
                             *reinterpret_cast<uint32_t const*>(qr + 8),
                             *reinterpret_cast<uint32_t const*>(qr + 8 * kRow + 8)};
      #pragma unroll
      for (int32_t t = 0; t < kKeys / 8; t++) {
        uint16_t const* kr = ks + (t * 8 + gid) * kRow + kk * 16 + 2 * tig;
        mma16816<BF16>(sc[t], a, *reinterpret_cast<uint32_t const*>(kr), *reinterpret_cast<uint32_t const*>(kr + 8));
      }
    }
    // online softmax over this stage's keys, per row (the 4 lanes of a quad share rows gid and gid + 8)
    float grown[2] = {m[0], m[1]};
    #pragma unroll
    for (int32_t t = 0; t < kKeys / 8; t++) {
      #pragma unroll
      for (int32_t e = 0; e < 4; e++) {
        const int32_t j = key0 + t * 8 + 2 * tig + e % 2;
        const float keyScale = FP8 && j < visible ? x.cacheScale : 1.0f;
        sc[t][e] = j < total ? sc[t][e] * scoreScale * keyScale : -INFINITY;
        grown[e / 2] = fmaxf(grown[e / 2], sc[t][e]);
      }
    }
    float rescale[2];
    #pragma unroll
    for (int32_t r = 0; r < 2; r++) {
      grown[r] = fmaxf(grown[r], __shfl_xor_sync(0xffffffffu, grown[r], 1));
      grown[r] = fmaxf(grown[r], __shfl_xor_sync(0xffffffffu, grown[r], 2));
      rescale[r] = m[r] == -INFINITY ? 0.0f : exp2f(m[r] - grown[r]);  // nothing seen yet: o and z are 0
      m[r] = grown[r];
      z[r] *= rescale[r];
    }
    #pragma unroll
    for (int32_t t = 0; t < kDTiles; t++) {
      o[t][0] *= rescale[0], o[t][1] *= rescale[0], o[t][2] *= rescale[1], o[t][3] *= rescale[1];
    }
    #pragma unroll
    for (int32_t t = 0; t < kKeys / 8; t++) {
      #pragma unroll
      for (int32_t e = 0; e < 4; e++) {
        const int32_t j = key0 + t * 8 + 2 * tig + e % 2;
        const float p = m[e / 2] == -INFINITY ? 0.0f : exp2f(sc[t][e] - m[e / 2]);
        z[e / 2] += p;
        sc[t][e] = FP8 && j < visible ? p * x.cacheScale : p;  // the value scale rides on the probability
      }
    }
    // o += P . V, P as hi + lo operand pairs; the C tiles of keys 16kk.. and 16kk+8.. form the A tile of step kk
    #pragma unroll
    for (int32_t kk = 0; kk < kKeys / 16; kk++) {
      float const* p0 = sc[2 * kk];
      float const* p1 = sc[2 * kk + 1];
      const uint32_t hi[4] = {pack<BF16>(p0[0], p0[1]), pack<BF16>(p0[2], p0[3]), pack<BF16>(p1[0], p1[1]),
                              pack<BF16>(p1[2], p1[3])};
      uint32_t lo[4];
      #pragma unroll
      for (int32_t r = 0; r < 4; r++) {
        float const* p = r < 2 ? p0 : p1;
        const float2 rounded = unpack<BF16>(hi[r]);
        lo[r] = pack<BF16>(p[(r % 2) * 2] - rounded.x, p[(r % 2) * 2 + 1] - rounded.y);
      }
      uint16_t const* v0 = vs + (kk * 16 + 2 * tig) * kRow + gid;
      #pragma unroll
      for (int32_t t = 0; t < kDTiles; t++) {
        uint16_t const* vr = v0 + t * 8;
        const uint32_t b0 = uint32_t(vr[0]) | uint32_t(vr[kRow]) << 16;
        const uint32_t b1 = uint32_t(vr[8 * kRow]) | uint32_t(vr[9 * kRow]) << 16;
        mma16816<BF16>(o[t], hi, b0, b1);
        mma16816<BF16>(o[t], lo, b0, b1);
      }
    }
    __syncthreads();  // this stage's buffers are refilled two stages on
  }

  // merge the key groups into group 0: each lane meets the lane holding the same elements in the other groups
  for (int32_t r = 0; r < 2; r++) {
    z[r] += __shfl_xor_sync(0xffffffffu, z[r], 1);
    z[r] += __shfl_xor_sync(0xffffffffu, z[r], 2);
  }
  float* const partial = reinterpret_cast<float*>(smem);  // per row tile: o [32 lanes][kDTiles * 4], m, z [32][2]
  constexpr int32_t kPartial = 32 * (kDTiles * 4 + 4);
  for (int32_t g = 1; g < kGroups; g++) {
    if (keyGroup == g) {
      float* mine = partial + tile * kPartial + lane * (kDTiles * 4 + 4);
      #pragma unroll
      for (int32_t t = 0; t < kDTiles; t++) {
        #pragma unroll
        for (int32_t e = 0; e < 4; e++) mine[t * 4 + e] = o[t][e];
      }
      mine[kDTiles * 4] = m[0], mine[kDTiles * 4 + 1] = m[1], mine[kDTiles * 4 + 2] = z[0];
      mine[kDTiles * 4 + 3] = z[1];
    }
    __syncthreads();
    if (keyGroup == 0) {
      float const* theirs = partial + tile * kPartial + lane * (kDTiles * 4 + 4);
      float keep[2], take[2];
      #pragma unroll
      for (int32_t r = 0; r < 2; r++) {
        const float mo = theirs[kDTiles * 4 + r], both = fmaxf(m[r], mo);
        keep[r] = m[r] == -INFINITY ? 0.0f : exp2f(m[r] - both);
        take[r] = mo == -INFINITY ? 0.0f : exp2f(mo - both);
        z[r] = z[r] * keep[r] + theirs[kDTiles * 4 + 2 + r] * take[r];
        m[r] = both;
      }
      #pragma unroll
      for (int32_t t = 0; t < kDTiles; t++) {
        #pragma unroll
        for (int32_t e = 0; e < 4; e++) o[t][e] = o[t][e] * keep[e / 2] + theirs[t * 4 + e] * take[e / 2];
      }
    }
    __syncthreads();
  }
  if (keyGroup != 0) return;
  #pragma unroll
  for (int32_t r = 0; r < 2; r++) {
    const int32_t row = tile * 16 + gid + 8 * r, l = row / group, hq = h * group + row % group;
    if (row >= rows) continue;
    const int64_t at = ((int64_t(n) * x.L + l) * x.Hq + hq) * D + 2 * tig;
    #pragma unroll
    for (int32_t t = 0; t < kDTiles; t++) {
      store(x.out, at + t * 8, o[t][2 * r] / z[r], x.ioType);
      store(x.out, at + t * 8 + 1, o[t][2 * r + 1] / z[r], x.ioType);
    }
  }
}

template <int32_t D, bool BF16, bool FP8>
cudaError_t attendMma(Args const& x, cudaStream_t stream) {
  const int32_t rowTiles = (x.L * (x.Hq / x.Hkv) + 15) / 16;
  const size_t bytes = sharedBytes(D, rowTiles);  // above the 48 KB default: opted in (per device, so every call)
  const cudaError_t opted = cudaFuncSetAttribute(attendMmaKernel<D, BF16, FP8>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  if (opted != cudaSuccess) return opted;
  attendMmaKernel<D, BF16, FP8><<<unsigned(x.N * x.Hkv), unsigned(rowTiles * kGroups * 32), bytes, stream>>>(x);
  return cudaGetLastError();
}

}  // namespace mma
}  // namespace windowed_attention
}  // namespace beamtrt
