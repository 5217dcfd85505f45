// block_selector/kernel.cu run on host threads (emulation/cuda_runtime.h): the CPU tests check the CUDA kernels' own
// code (chunked top-K, merges, lattice, choices, walk) against the host build.
#include "../block_selector/kernel.cu"

#include <vector>

extern "C" int32_t beamtrt_block_selector_emulated(beamtrt::selector::Args const* args) {
  std::vector<uint8_t> workspace(beamtrt::selector::workspaceBytes(args->N, args->S, args->K));
  return int32_t(beamtrt::selector::launch(*args, workspace.data(), nullptr));
}
