// block_selector/kernel.cu under a name of its own: torch.utils.cpp_extension names each object after its
// source's file name, and both plugins' launchers are kernel.cu.
#include "../block_selector/kernel.cu"
