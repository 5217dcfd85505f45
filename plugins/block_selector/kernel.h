// CUDA launcher of the block selector (no TensorRT types): top-K per draft slot, then the walk per request.
#pragma once

#include "kernel.cuh"

#include <cuda_runtime.h>

namespace beamtrt {
namespace selector {

// Scratch the launch needs: the unary (top-K logit) scores, [N, S, K] fp32.
inline size_t workspaceBytes(int32_t N, int32_t S, int32_t K) { return size_t(N) * S * K * sizeof(float); }

cudaError_t launch(Args const& args, void* workspace, cudaStream_t stream);

}  // namespace selector
}  // namespace beamtrt
