// CUDA launcher of the block selector (no TensorRT types): top-K per draft slot, the edge lattice, the walk.
#pragma once

#include "kernel.cuh"

#include <cuda_runtime.h>

namespace beamtrt {
namespace selector {

constexpr int32_t kTargetCtas = 512;  // top-K CTAs a launch aims for: the vocabulary is split in chunks at small N * S

// Scratch the launch needs, for at most N requests and S slots: the chunks' top-K lists (value fp32 + index int32,
// at most N * S + kTargetCtas of them), each slot's choice after each predecessor [N, S, K] int32 and its q row
// [N, S, K, K] fp32.
inline size_t workspaceBytes(int32_t N, int32_t S, int32_t K) {
  const size_t rows = size_t(N) * S;
  return (rows + kTargetCtas) * K * 8 + rows * K * 4 + rows * K * K * 4;
}

cudaError_t launch(Args const& args, void* workspace, cudaStream_t stream);

}  // namespace selector
}  // namespace beamtrt
