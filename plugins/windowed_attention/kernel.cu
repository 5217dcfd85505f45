// CUDA kernels of the windowed drafter attention: an elementwise ring append, then the attention.
//
// Attention, grouped (the usual case): one CTA per (sequence, KV head) holds every query row that reads that KV
// head (L block rows x Hq / Hkv query heads, up to kGroupRows), a few rows per warp, and streams the keys and values
// through shared memory a tile at a time, so each is read from memory once per (sequence, KV head) instead of once
// per query row. Per row the arithmetic is the per-row kernel's: a lane owns head dims lane + 32 i, the score is a
// warp shuffle sum, and an online softmax walks the keys in order.
// Attention, per row (more query rows per KV head than a CTA holds): one warp per output row, keys from memory.
#include "kernel.h"
#include "kernel_mma.cuh"

namespace beamtrt {
namespace windowed_attention {
namespace {

constexpr int32_t kWarp = 32;
constexpr int32_t kRowsPerBlock = 4;              // per-row kernel: warps per CTA
constexpr int32_t kGroupWarps = 16;               // grouped kernel: warps per CTA
constexpr int32_t kRowsPerWarp = 4;               // grouped kernel: query rows per warp
constexpr int32_t kGroupRows = kGroupWarps * kRowsPerWarp;
constexpr int32_t kTile = 16;                     // grouped kernel: keys per shared-memory tile

__global__ void appendKernel(Args x) {
  const int32_t n = blockIdx.x / x.C, c = blockIdx.x % x.C;
  for (int32_t i = threadIdx.x; i < x.Hkv * x.D; i += blockDim.x) appendElement(x, n, c, i / x.D, i % x.D);
}

// The online-softmax update of one row with one key: q, acc, key and value hold this lane's head dims
// (d = lane + 32 i; zeros past D).
template <int32_t PER_LANE>
__device__ void attendKey(Args const& x, int32_t lane, float const* q, float* acc, float& mx, float& z,
                          float const* key, float const* value) {
  float s = 0.0f;
  #pragma unroll
  for (int32_t i = 0; i < PER_LANE; i++) {
    if (lane + i * kWarp < x.D) s += q[i] * key[i];
  }
  for (int32_t offset = kWarp / 2; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
  s *= x.softmaxScale;
  const float grown = fmaxf(mx, s), rescale = expf(mx - grown), p = expf(s - grown);
  #pragma unroll
  for (int32_t i = 0; i < PER_LANE; i++) {
    if (lane + i * kWarp < x.D) acc[i] = acc[i] * rescale + p * value[i];
  }
  z = z * rescale + p;
  mx = grown;
}

template <int32_t PER_LANE>
__device__ void loadRow(Args const& x, int64_t at, int32_t lane, float* q, float* acc) {
  #pragma unroll
  for (int32_t i = 0; i < PER_LANE; i++) {
    const int32_t d = lane + i * kWarp;
    q[i] = d < x.D ? load(x.q, at + d, x.ioType) : 0.0f;
    acc[i] = 0.0f;
  }
}

template <int32_t PER_LANE>
__device__ void storeRow(Args const& x, int64_t at, int32_t lane, float const* acc, float z) {
  #pragma unroll
  for (int32_t i = 0; i < PER_LANE; i++) {
    const int32_t d = lane + i * kWarp;
    if (d < x.D) store(x.out, at + d, acc[i] / z, x.ioType);
  }
}

template <int32_t PER_LANE>
__global__ void attendRowKernel(Args x) {
  const int32_t lane = threadIdx.x % kWarp;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;  // (n * L + l) * Hq + hq
  if (row >= int64_t(x.N) * x.L * x.Hq) return;
  const int32_t hq = int32_t(row % x.Hq), n = int32_t(row / (int64_t(x.L) * x.Hq));
  const int32_t h = hq / (x.Hq / x.Hkv), visible = visibleSlots(x, n);
  float q[PER_LANE], acc[PER_LANE], key[PER_LANE] = {}, value[PER_LANE] = {};
  loadRow<PER_LANE>(x, row * x.D, lane, q, acc);
  float mx = -INFINITY, z = 0.0f;
  for (int32_t j = 0; j < visible + x.L; j++) {
    #pragma unroll
    for (int32_t i = 0; i < PER_LANE; i++) {
      const int32_t d = lane + i * kWarp;
      if (d < x.D) keyValueAt(x, n, h, j, visible, d, key[i], value[i]);
    }
    attendKey<PER_LANE>(x, lane, q, acc, mx, z, key, value);
  }
  storeRow<PER_LANE>(x, row * x.D, lane, acc, z);
}

template <int32_t PER_LANE>
__global__ void __launch_bounds__(kGroupWarps * kWarp) attendGroupKernel(Args x) {
  __shared__ float keys[kTile][kMaxHeadDim], values[kTile][kMaxHeadDim];
  const int32_t n = blockIdx.x / x.Hkv, h = blockIdx.x % x.Hkv, group = x.Hq / x.Hkv;
  const int32_t lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, rows = x.L * group;
  const int32_t visible = visibleSlots(x, n), total = visible + x.L;
  float q[kRowsPerWarp][PER_LANE], acc[kRowsPerWarp][PER_LANE], mx[kRowsPerWarp], z[kRowsPerWarp];
  int64_t at[kRowsPerWarp];
  #pragma unroll
  for (int32_t r = 0; r < kRowsPerWarp; r++) {  // row warp + r * kGroupWarps = (block row l, head g of the group)
    const int32_t row = warp + r * kGroupWarps, l = row / group, hq = h * group + row % group;
    at[r] = ((int64_t(n) * x.L + l) * x.Hq + hq) * x.D;
    if (row < rows) loadRow<PER_LANE>(x, at[r], lane, q[r], acc[r]);
    mx[r] = -INFINITY;
    z[r] = 0.0f;
  }
  for (int32_t j0 = 0; j0 < total; j0 += kTile) {
    const int32_t tile = min(kTile, total - j0);
    for (int32_t i = threadIdx.x; i < tile * x.D; i += blockDim.x) {
      keyValueAt(x, n, h, j0 + i / x.D, visible, i % x.D, keys[i / x.D][i % x.D], values[i / x.D][i % x.D]);
    }
    __syncthreads();
    for (int32_t j = 0; j < tile; j++) {
      float key[PER_LANE], value[PER_LANE];
      #pragma unroll
      for (int32_t i = 0; i < PER_LANE; i++) {
        const int32_t d = lane + i * kWarp;
        key[i] = d < x.D ? keys[j][d] : 0.0f;
        value[i] = d < x.D ? values[j][d] : 0.0f;
      }
      #pragma unroll
      for (int32_t r = 0; r < kRowsPerWarp; r++) {
        if (warp + r * kGroupWarps < rows) attendKey<PER_LANE>(x, lane, q[r], acc[r], mx[r], z[r], key, value);
      }
    }
    __syncthreads();
  }
  #pragma unroll
  for (int32_t r = 0; r < kRowsPerWarp; r++) {
    if (warp + r * kGroupWarps < rows) storeRow<PER_LANE>(x, at[r], lane, acc[r], z[r]);
  }
}

template <int32_t D, bool BF16>
cudaError_t attendMma(Args const& x, cudaStream_t stream) {
  return x.cacheType == DType::kFP8 ? mma::attendMma<D, BF16, true>(x, stream)
                                    : mma::attendMma<D, BF16, false>(x, stream);
}

template <int32_t PER_LANE>
void attend(Args const& x, cudaStream_t stream) {
  if (x.L * (x.Hq / x.Hkv) <= kGroupRows) {
    attendGroupKernel<PER_LANE><<<unsigned(x.N * x.Hkv), kGroupWarps * kWarp, 0, stream>>>(x);
    return;
  }
  const int64_t rows = int64_t(x.N) * x.L * x.Hq;
  attendRowKernel<PER_LANE><<<unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock), kRowsPerBlock * kWarp, 0,
                              stream>>>(x);
}

}  // namespace

cudaError_t launch(Args const& args, cudaStream_t stream, Kernel kernel) {
  if (args.D < 1 || args.D > kMaxHeadDim || args.Hkv < 1 || args.Hq % args.Hkv != 0 || args.W < 1) {
    return cudaErrorInvalidValue;
  }
  if (args.N == 0) return cudaSuccess;
  if (args.C > 0) appendKernel<<<args.N * args.C, 128, 0, stream>>>(args);
  if (args.L > 0 && kernel == Kernel::kAuto && mma::supports(args)) {
    const bool bf16 = args.ioType == DType::kBF16;
    if (args.D == 64) return bf16 ? attendMma<64, true>(args, stream) : attendMma<64, false>(args, stream);
    return bf16 ? attendMma<128, true>(args, stream) : attendMma<128, false>(args, stream);
  }
  if (args.L > 0) {
    if (args.D <= 4 * kWarp) {
      attend<4>(args, stream);  // D <= 128: four head dims per lane
    } else {
      attend<kMaxHeadDim / kWarp>(args, stream);
    }
  }
  return cudaGetLastError();
}

}  // namespace windowed_attention
}  // namespace beamtrt
