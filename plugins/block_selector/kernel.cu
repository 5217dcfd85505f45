// CUDA kernels of the block selector: one CTA per (request, slot) scans the vocabulary once for its top-K, then one
// thread per request walks the lattice with the shared math of kernel.cuh.
#include "kernel.h"

namespace beamtrt {
namespace selector {
namespace {

constexpr int32_t kThreads = 256;

// Each thread keeps the top-K of its strided share of the vocabulary; K rounds of a block-wide argmax over the
// threads' current heads then pop the K best in order (value desc, index asc on ties, as TopK::offer).
__global__ void topKKernel(Args x, float* unary) {
  const int32_t slot = blockIdx.x;  // n * S + t
  const int64_t row = int64_t(slot) * x.V;
  TopK mine;
  for (int32_t v = threadIdx.x; v < x.V; v += kThreads) mine.offer(load(x.logits, row + v, x.logitsType), v, x.K);
  __shared__ float bestValue[kThreads];
  __shared__ int32_t bestIndex[kThreads];
  int32_t head = 0;
  for (int32_t j = 0; j < x.K; j++) {
    bestValue[threadIdx.x] = head < mine.size ? mine.value[head] : -INFINITY;
    bestIndex[threadIdx.x] = head < mine.size ? mine.index[head] : INT32_MAX;
    __syncthreads();
    for (int32_t stride = kThreads / 2; stride > 0; stride /= 2) {
      if (threadIdx.x < stride) {
        const int32_t other = threadIdx.x + stride;
        if (TopK::better(bestValue[other], bestIndex[other], bestValue[threadIdx.x], bestIndex[threadIdx.x])) {
          bestValue[threadIdx.x] = bestValue[other];
          bestIndex[threadIdx.x] = bestIndex[other];
        }
      }
      __syncthreads();
    }
    const int32_t winner = bestIndex[0];
    if (threadIdx.x == 0) {
      x.candIds[int64_t(slot) * x.K + j] = winner;
      unary[int64_t(slot) * x.K + j] = bestValue[0];
    }
    if (head < mine.size && mine.index[head] == winner) head++;
    __syncthreads();
  }
}

__global__ void walkKernel(Args x, float const* unary) {
  const int32_t n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n < x.N) walk(x, n, unary + int64_t(n) * x.S * x.K);
}

}  // namespace

cudaError_t launch(Args const& args, void* workspace, cudaStream_t stream) {
  if (args.K < 1 || args.K > kMaxK || args.K > args.V || args.S < 1 || args.S > kMaxSlots) {
    return cudaErrorInvalidValue;
  }
  if (args.N == 0) return cudaSuccess;
  float* unary = static_cast<float*>(workspace);
  topKKernel<<<args.N * args.S, kThreads, 0, stream>>>(args, unary);
  walkKernel<<<(args.N + 63) / 64, 64, 0, stream>>>(args, unary);
  return cudaGetLastError();
}

}  // namespace selector
}  // namespace beamtrt
