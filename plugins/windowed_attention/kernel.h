// CUDA launcher of the windowed drafter attention (no TensorRT types): append the new context to the ring, then
// attend every block row over the visible ring plus the block.
#pragma once

#include "kernel.cuh"

#include <cuda_runtime.h>

namespace beamtrt {
namespace windowed_attention {

cudaError_t launch(Args const& args, cudaStream_t stream);

}  // namespace windowed_attention
}  // namespace beamtrt
