// CUDA launcher of the windowed drafter attention (no TensorRT types): append the new context to the ring, then
// attend every block row over the visible ring plus the block.
#pragma once

#include "kernel.cuh"

#include <cuda_runtime.h>

namespace beamtrt {
namespace windowed_attention {

// Which attention kernel runs: kAuto takes the tensor-core one where it applies (fp16 / bf16, D 64 or 128, up to
// 64 query rows per KV head, 16-byte aligned tensors; kernel_mma.cuh), else the CUDA-core ones (kernel.cu);
// kCudaCores always the latter (tests and benchmarks compare the two).
enum class Kernel : int32_t { kAuto = 0, kCudaCores = 1 };

cudaError_t launch(Args const& args, cudaStream_t stream, Kernel kernel = Kernel::kAuto);

}  // namespace windowed_attention
}  // namespace beamtrt
