// CUDA's execution model on host threads, enough to run a kernel source (.cu) on the CPU in tests: found as
// <cuda_runtime.h> ahead of the real one. Each block's threads are std::threads; __syncthreads is a block barrier,
// warp shuffles, __any_sync and __syncwarp a warp barrier; __shared__ variables are statics, so blocks run one after
// another.
// Launches go through BEAMTRT_LAUNCH (block_selector/kernel.cu defines it as <<<...>>> where this header is not in
// use); the windowed attention's inline PTX has no host equivalent, so it is not run this way.
#pragma once

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

using cudaStream_t = void*;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline char const* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "invalid argument"; }

struct uint4 {
  uint32_t x, y, z, w;
};
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }
struct dim3 {
  uint32_t x = 1, y = 1, z = 1;
};

template <class T>
inline T __ldg(T const* p) { return *p; }
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
using std::max;
using std::min;

namespace emulation {

struct Block {
  explicit Block(uint32_t threads) : all(threads) {
    for (uint32_t w = 0; w < (threads + 31) / 32; w++) {
      warps.push_back(std::make_unique<std::barrier<>>(std::min<uint32_t>(32, threads - 32 * w)));
    }
    lanes.resize(size_t(warps.size()) * 32);
  }
  std::barrier<> all;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<uint64_t> lanes;  // one value per thread for the shuffles
};

inline thread_local Block* block = nullptr;
}  // namespace emulation

inline thread_local dim3 threadIdx, blockIdx, blockDim;

inline void __syncthreads() { emulation::block->all.arrive_and_wait(); }
inline void __syncwarp(uint32_t = 0xffffffffu) { emulation::block->warps[threadIdx.x / 32]->arrive_and_wait(); }

template <class T>
inline T __shfl_xor_sync(uint32_t, T v, int32_t laneMask) {
  static_assert(sizeof(T) <= 8);
  emulation::Block& b = *emulation::block;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  b.lanes[threadIdx.x] = bits;
  __syncwarp();
  bits = b.lanes[(threadIdx.x & ~31u) | ((threadIdx.x % 32) ^ uint32_t(laneMask))];
  __syncwarp();  // every lane has read before any writes again
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

inline int __any_sync(uint32_t, int predicate) {
  emulation::Block& b = *emulation::block;
  b.lanes[threadIdx.x] = predicate != 0;
  __syncwarp();
  int any = 0;
  for (uint32_t l = 0; l < 32; l++) any |= int(b.lanes[(threadIdx.x & ~31u) | l]);
  __syncwarp();  // every lane has read before any writes again
  return any;
}

namespace emulation {

// kernel(args...) over `grid` blocks of `threads` threads, one block at a time. A thread that returns leaves the
// barriers, as an exited GPU thread stops counting towards __syncthreads.
template <class Kernel>
struct Launcher {
  uint32_t grid, threads;
  Kernel kernel;

  template <class... A>
  void operator()(A... args) const {
    for (uint32_t g = 0; g < grid; g++) {
      Block b(threads);
      std::vector<std::thread> pool;
      for (uint32_t t = 0; t < threads; t++) {
        pool.emplace_back([&, t] {
          block = &b;
          threadIdx.x = t, blockIdx.x = g, blockDim.x = threads;
          kernel(args...);
          b.warps[t / 32]->arrive_and_drop();
          b.all.arrive_and_drop();
        });
      }
      for (std::thread& th : pool) th.join();
    }
  }
};

template <class Kernel>
Launcher(uint32_t, uint32_t, Kernel) -> Launcher<Kernel>;

}  // namespace emulation

#define BEAMTRT_LAUNCH(kernel, grid, threads, stream) \
  ((void)(stream), ::emulation::Launcher{uint32_t(grid), uint32_t(threads), [](auto... a) { kernel(a...); }})
