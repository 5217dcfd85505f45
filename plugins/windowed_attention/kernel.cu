// CUDA kernels of the windowed drafter attention: an elementwise ring append, then one warp per output row
// (sequence, block row, query head) with an online softmax over the keys; query heads of one KV head read the same
// keys, which stay in L2.
#include "kernel.h"

namespace beamtrt {
namespace windowed_attention {
namespace {

constexpr int32_t kWarp = 32;
constexpr int32_t kRowsPerBlock = 4;              // warps per CTA
constexpr int32_t kPerLane = kMaxHeadDim / kWarp;  // head dims per lane

__global__ void appendKernel(Args x) {
  const int32_t n = blockIdx.x / x.C, c = blockIdx.x % x.C;
  for (int32_t i = threadIdx.x; i < x.Hkv * x.D; i += blockDim.x) appendElement(x, n, c, i / x.D, i % x.D);
}

__global__ void attendKernel(Args x) {
  const int32_t lane = threadIdx.x % kWarp;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;  // (n * L + l) * Hq + hq
  if (row >= int64_t(x.N) * x.L * x.Hq) return;
  const int32_t hq = int32_t(row % x.Hq), n = int32_t(row / (int64_t(x.L) * x.Hq));
  const int32_t h = hq / (x.Hq / x.Hkv), visible = visibleSlots(x, n);
  float q[kPerLane], acc[kPerLane];
  for (int32_t i = 0; i < kPerLane; i++) {
    const int32_t d = lane + i * kWarp;
    q[i] = d < x.D ? load(x.q, row * x.D + d, x.ioType) : 0.0f;
    acc[i] = 0.0f;
  }
  float mx = -INFINITY, z = 0.0f;
  for (int32_t j = 0; j < visible + x.L; j++) {
    const bool ring = j < visible;
    const int64_t at = ring ? ((int64_t(n) * x.Hkv + h) * x.W + j) * x.D
                            : ((int64_t(n) * x.L + (j - visible)) * x.Hkv + h) * x.D;
    float s = 0.0f;
    for (int32_t i = 0; i < kPerLane; i++) {
      const int32_t d = lane + i * kWarp;
      if (d < x.D) s += q[i] * (ring ? load(x.ringK, at + d, x.cacheType, x.cacheScale) : load(x.k, at + d, x.ioType));
    }
    for (int32_t offset = kWarp / 2; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
    s *= x.softmaxScale;
    const float grown = fmaxf(mx, s), rescale = expf(mx - grown), p = expf(s - grown);
    for (int32_t i = 0; i < kPerLane; i++) {
      const int32_t d = lane + i * kWarp;
      if (d < x.D) {
        const float value = ring ? load(x.ringV, at + d, x.cacheType, x.cacheScale) : load(x.v, at + d, x.ioType);
        acc[i] = acc[i] * rescale + p * value;
      }
    }
    z = z * rescale + p;
    mx = grown;
  }
  for (int32_t i = 0; i < kPerLane; i++) {
    const int32_t d = lane + i * kWarp;
    if (d < x.D) store(x.out, row * x.D + d, acc[i] / z, x.ioType);
  }
}

}  // namespace

cudaError_t launch(Args const& args, cudaStream_t stream) {
  if (args.D < 1 || args.D > kMaxHeadDim || args.Hkv < 1 || args.Hq % args.Hkv != 0 || args.W < 1) {
    return cudaErrorInvalidValue;
  }
  if (args.N == 0) return cudaSuccess;
  if (args.C > 0) appendKernel<<<args.N * args.C, 128, 0, stream>>>(args);
  const int64_t rows = int64_t(args.N) * args.L * args.Hq;
  if (rows > 0) {
    attendKernel<<<unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock), kRowsPerBlock * kWarp, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

}  // namespace windowed_attention
}  // namespace beamtrt
