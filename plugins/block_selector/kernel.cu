// CUDA kernels of the block selector, three launches: (1) the top-K of each (request, slot) row's chunks of the
// vocabulary (16-byte loads; a floor in registers, raised to the warp's K-th best between load batches, turns most
// values away; enough chunks that a small batch still fills the GPU); (2) per (request, slot): the chunks' lists
// merged into the slot's candidates, every edge into them scored at once (the K x K lattice from codebook rows staged
// in shared memory; each edge edgeScore's sum, in its order), and the slot's choice after each possible predecessor
// (choose() per lattice row, in parallel); (3) one warp per request follows the choices from the anchor (follow(),
// spread over the lanes). The math is kernel.cuh's.
#include "kernel.h"

#ifndef BEAMTRT_LAUNCH  // plugins/host/emulation/cuda_runtime.h runs the kernels on host threads instead (CPU tests)
#define BEAMTRT_LAUNCH(kernel, grid, threads, stream) kernel<<<(grid), (threads), 0, (stream)>>>
#endif

namespace beamtrt {
namespace selector {
namespace {

constexpr int32_t kThreads = 256;
constexpr int32_t kWarps = kThreads / 32;
constexpr int32_t kMergeEntries = 512;   // chunks * K per slot at most: one warp merges them from shared memory
constexpr int32_t kMaxChunks = 32;       // one list per lane in that merge
constexpr int32_t kMinChunk = 2048;      // vocabulary entries per top-K CTA at least
constexpr int32_t kTileFloats = kMaxK * 65;  // shared floats per codebook tile: K rows of up to 4160 / K ranks
constexpr int32_t kMaxTile = 512;            // ranks per tile at most
constexpr int32_t kPairsPerThread = kMaxK * kMaxK / kThreads;
constexpr int32_t kLoadBatch = 4;            // 16-byte logit loads in flight per thread
constexpr int32_t kStageBatch = 8;           // loads in flight per thread while staging lists, rows and q

// The better of each lane's (v, i) and its partners', on every lane: a warp-wide argmax in TopK's order.
__device__ __forceinline__ void warpBest(float& v, int32_t& i) {
  for (int32_t offset = 16; offset > 0; offset /= 2) {
    const float w = __shfl_xor_sync(0xffffffffu, v, offset);
    const int32_t j = __shfl_xor_sync(0xffffffffu, i, offset);
    if (TopK::better(w, j, v, i)) {
      v = w;
      i = j;
    }
  }
}

// An entry of the top-K order; (-inf, INT32_MAX) is below every entry.
struct Ranked {
  float value = -INFINITY;
  int32_t index = INT32_MAX;
};

// One warp: the K best of its lanes' sorted lists, by K rounds of a warp-wide argmax over the lists' heads.
// entry(h, v, i) sets (v, i) to the lane's entry h and returns true, or returns false when the lane has none.
// Lane 0 writes the result where outValue is given; every lane returns the K-th best (Ranked() when the lists hold
// fewer than K entries).
template <class Entry>
__device__ Ranked mergeWarp(int32_t K, Entry const& entry, float* outValue, int32_t* outIndex) {
  const int32_t lane = threadIdx.x % 32;
  int32_t head = 0;
  float v = -INFINITY;
  int32_t i = INT32_MAX;
  for (int32_t j = 0; j < K; j++) {
    v = -INFINITY;
    i = INT32_MAX;
    const bool live = entry(head, v, i);
    const int32_t mine = i;
    warpBest(v, i);
    if (live && mine == i) head++;
    if (outValue != nullptr && lane == 0) {
      outValue[j] = v;
      outIndex[j] = i;
    }
  }
  return {v, i};
}

// One warp: the K best of `lists` (<= 32) sorted lists of K entries in shared memory (list l at l * K).
__device__ void mergeLists(float const* value, int32_t const* index, int32_t lists, int32_t K, float* outValue,
                           int32_t* outIndex) {
  const int32_t lane = threadIdx.x % 32;
  mergeWarp(K, [&](int32_t h, float& v, int32_t& i) {
    if (lane >= lists || h >= K) return false;
    v = value[lane * K + h];
    i = index[lane * K + h];
    return true;
  }, outValue, outIndex);
}

// A lane's list (its K best of the values it took) as mergeWarp's entries.
__device__ __forceinline__ auto entries(TopK const& list) {
  return [&list](int32_t h, float& v, int32_t& i) {
    if (h >= list.size) return false;
    v = list.value[h];
    i = list.index[h];
    return true;
  };
}

// Offers (v, i) to a thread's list unless it is below the floor `bar`; returns whether the list took it. The floor only
// rises: to the list's K-th entry once full, and (raiseBar) to the warp's K-th best. It is held apart from the list, in
// registers: the list is indexed at run time, so it lives in local memory, and a floor beside it in one struct did too.
__device__ __forceinline__ bool offer(TopK& list, Ranked& bar, float v, int32_t i, int32_t K) {
  if (!TopK::better(v, i, bar.value, bar.index)) return false;
  list.offer(v, i, K);
  if (list.size == K && TopK::better(list.value[K - 1], list.index[K - 1], bar.value, bar.index)) {
    bar = {list.value[K - 1], list.index[K - 1]};
  }
  return true;
}

// Every lane's floor raised to its warp's K-th best so far. Nothing below that can be among the chunk's K best: the
// lanes' lists hold K entries at or above it, and a list drops an entry only for a better one. A lane's own K-th
// entry sees 1/32 of what the warp has seen, so this floor turns far more values away (one thread scans ~100-300).
__device__ __forceinline__ void raiseBar(TopK const& list, Ranked& bar, int32_t K) {
  const Ranked kth = mergeWarp(K, entries(list), nullptr, nullptr);
  if (TopK::better(kth.value, kth.index, bar.value, bar.index)) bar = kth;
}

// Element e of 16 bytes of kType values.
template <DType kType>
__device__ __forceinline__ float element(uint4 const& w, int32_t e) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  if constexpr (kType == DType::kFLOAT) {
    return __uint_as_float(words[e]);
  } else {
    const uint16_t bits = uint16_t(words[e / 2] >> (16 * (e % 2)));
    return kType == DType::kBF16 ? bf16ToFloat(bits) : halfToFloat(bits);
  }
}

// Offer logits [begin, end) of the row at element `row` to the thread's list: 16-byte loads where the row is aligned
// (chunks start on a multiple of 8 elements), single elements for the rest. The batches of loads are the same for
// every thread (the warp's floor is raised between them, where any of its lanes took a value and more batches follow).
template <DType kType>
__device__ __forceinline__ void scan(Args const& x, int64_t row, int32_t begin, int32_t end, TopK& list,
                                     Ranked& bar) {
  constexpr int32_t kPer = 16 / (kType == DType::kFLOAT ? 4 : 2);
  constexpr int32_t kStep = kThreads * kLoadBatch;
  char const* base = static_cast<char const*>(x.logits) + row * (16 / kPer);
  const bool aligned = reinterpret_cast<uintptr_t>(base) % 16 == 0 && begin % kPer == 0;
  const int32_t vectors = aligned && end > begin ? (end - begin) / kPer : 0;
  uint4 const* vec = reinterpret_cast<uint4 const*>(base + int64_t(begin) * (16 / kPer));
  for (int32_t batch = 0; batch < vectors; batch += kStep) {
    const int32_t first = batch + int32_t(threadIdx.x);
    uint4 w[kLoadBatch];
#pragma unroll
    for (int32_t u = 0; u < kLoadBatch; u++) {
      const int32_t at = first + u * kThreads;
      w[u] = at < vectors ? __ldg(vec + at) : make_uint4(0, 0, 0, 0);
    }
    bool took = false;
#pragma unroll
    for (int32_t u = 0; u < kLoadBatch; u++) {
      const int32_t at = first + u * kThreads;
      if (at < vectors) {
#pragma unroll
        for (int32_t e = 0; e < kPer; e++) {
          took |= offer(list, bar, element<kType>(w[u], e), begin + at * kPer + e, x.K);
        }
      }
    }
    if (batch + kStep < vectors && __any_sync(0xffffffffu, took)) raiseBar(list, bar, x.K);
  }
  for (int32_t v = begin + vectors * kPer + int32_t(threadIdx.x); v < end; v += kThreads) {
    offer(list, bar, load(x.logits, row + v, kType), v, x.K);
  }
}

// CTA (row, chunk): the chunk's K best, sorted, into the lists [rows * chunks, K].
template <DType kType>
__global__ void __launch_bounds__(kThreads) topKKernel(Args x, int32_t chunks, int32_t chunkLength,
                                                       float* listValue, int32_t* listIndex) {
  const int32_t row = blockIdx.x / chunks, chunk = blockIdx.x % chunks;  // row = n * S + t
  const int32_t begin = chunk * chunkLength, end = min(x.V, begin + chunkLength);
  TopK list;
  Ranked bar;
  scan<kType>(x, int64_t(row) * x.V, begin, end, list, bar);
  __shared__ float warpValue[kWarps * kMaxK];
  __shared__ int32_t warpIndex[kWarps * kMaxK];
  const int32_t warp = threadIdx.x / 32;
  mergeWarp(x.K, entries(list), warpValue + warp * x.K, warpIndex + warp * x.K);  // each warp's K best
  __syncthreads();
  if (warp == 0) {
    mergeLists(warpValue, warpIndex, kWarps, x.K, listValue + int64_t(blockIdx.x) * x.K,
               listIndex + int64_t(blockIdx.x) * x.K);
  }
}

// CTA (n, t): slot t's candidates (and slot t-1's, its predecessors) from the chunks' lists; the lattice rows
// U_t(j) + sum_r (A[a_p, r] g_t[r]) B[b_j, r] for each predecessor p (a_0 the anchor at t = 0, p = 0 only); then
// per row the choice, into choice[n, t, p] and its q row into qRows[n, t, p, :]. Global loads are issued in batches
// before their results are stored (a store waits for its load, and the next load would wait behind it).
__global__ void __launch_bounds__(kThreads) latticeKernel(Args x, int32_t chunks, float const* listValue,
                                                          int32_t const* listIndex, int32_t* choice, float* qRows) {
  const int32_t slot = blockIdx.x, n = slot / x.S, t = slot % x.S, K = x.K;
  const int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t anchor = x.anchorIds[n];
  __shared__ float mergeValue[2][kMergeEntries];
  __shared__ int32_t mergeIndex[2][kMergeEntries];
  __shared__ float candValue[2][kMaxK];  // [0]: slot t, [1]: slot t-1
  __shared__ int32_t candIndex[2][kMaxK];
  if (warp < 2 && (warp == 0 || t > 0)) {
    const int64_t from = int64_t(slot - warp) * chunks * K;
    float value[kMergeEntries / 32];
    int32_t index[kMergeEntries / 32];
#pragma unroll
    for (int32_t u = 0; u < kMergeEntries / 32; u++) {
      const int32_t e = lane + 32 * u;
      value[u] = e < chunks * K ? listValue[from + e] : 0.0f;
      index[u] = e < chunks * K ? listIndex[from + e] : 0;
    }
#pragma unroll
    for (int32_t u = 0; u < kMergeEntries / 32; u++) {
      mergeValue[warp][lane + 32 * u] = value[u];
      mergeIndex[warp][lane + 32 * u] = index[u];
    }
    __syncwarp();
    mergeLists(mergeValue[warp], mergeIndex[warp], chunks, K, candValue[warp], candIndex[warp]);
  }
  __syncthreads();
  if (int32_t(threadIdx.x) < K) x.candIds[int64_t(slot) * K + threadIdx.x] = candIndex[0][threadIdx.x];
  // Rows of a (predecessors) and b (candidates) in tiles of `width` ranks, `stride` apart (odd: no bank conflicts):
  // K = 16 takes a rank-256 codebook in one round.
  const int32_t P = t == 0 ? 1 : K;
  const int32_t stride = (kTileFloats / K - 1) | 1;  // the largest odd number of floats K rows fit in
  const int32_t tile = min(stride, kMaxTile);
  __shared__ float a[kTileFloats], b[kTileFloats], g[kMaxTile];
  float acc[kPairsPerThread];
#pragma unroll
  for (int32_t m = 0; m < kPairsPerThread; m++) acc[m] = 0.0f;
  for (int32_t r0 = 0; r0 < x.R; r0 += tile) {
    const int32_t width = min(tile, x.R - r0), count = (P + K) * width;
    __syncthreads();  // the previous tile is consumed
    for (int32_t first = threadIdx.x; first < count; first += kThreads * kStageBatch) {
      float v[kStageBatch];
#pragma unroll
      for (int32_t u = 0; u < kStageBatch; u++) {
        const int32_t e = first + u * kThreads, which = e / width, r = r0 + e % width;
        v[u] = e >= count ? 0.0f
             : which < P ? load(x.predecessor, int64_t(t == 0 ? anchor : candIndex[1][which]) * x.R + r,
                                x.codebookType)
                         : load(x.successor, int64_t(candIndex[0][which - P]) * x.R + r, x.codebookType);
      }
#pragma unroll
      for (int32_t u = 0; u < kStageBatch; u++) {
        const int32_t e = first + u * kThreads, which = e / width;
        if (e < count) (which < P ? a + which * stride : b + (which - P) * stride)[e % width] = v[u];
      }
    }
    for (int32_t r = threadIdx.x; r < width; r += kThreads) g[r] = x.projected[int64_t(slot) * x.R + r0 + r];
    __syncthreads();
#pragma unroll
    for (int32_t m = 0; m < kPairsPerThread; m++) {
      const int32_t pair = threadIdx.x + m * kThreads, p = pair / K, j = pair % K;
      if (pair < P * K) {
        for (int32_t r = 0; r < width; r++) acc[m] = addProduct(acc[m], a[p * stride + r] * g[r], b[j * stride + r]);
      }
    }
  }
  __syncthreads();  // the last tile is consumed: `a` takes the lattice rows, `b` their q rows
#pragma unroll
  for (int32_t m = 0; m < kPairsPerThread; m++) {
    const int32_t pair = threadIdx.x + m * kThreads;
    if (pair < P * K) a[pair / K * stride + pair % K] = candValue[0][pair % K] + acc[m];
  }
  __syncthreads();
  if (int32_t(threadIdx.x) < P) {
    const int32_t p = threadIdx.x;
    float* q = b + p * stride;
    choice[int64_t(slot) * K + p] = choose(a + p * stride, K, x.temperature[n], x.topP[n], x.uniforms[slot], q);
    for (int32_t j = 0; j < K; j++) qRows[(int64_t(slot) * K + p) * K + j] = q[j];
  }
}

// One warp per request: follow() spread over the lanes. Every lane follows the choices from the anchor (the same
// loads), lane t keeps slot t's predecessor and pick; then the lanes write the drafts and copy the path's q rows.
__global__ void __launch_bounds__(kThreads) walkKernel(Args x, int32_t const* choice, float const* qRows) {
  const int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, n = blockIdx.x * kWarps + warp;
  __shared__ int32_t path[kWarps][32];
  if (n >= x.N) return;  // whole warps
  const int32_t S = x.S, K = x.K;
  int32_t p = 0, mine = 0, pick = 0;
  for (int32_t t = 0; t < S; t++) {
    const int32_t next = choice[(int64_t(n) * S + t) * K + p];
    if (lane == t) {
      mine = p;
      pick = next;
    }
    p = next;
  }
  path[warp][lane] = mine;
  __syncwarp();
  if (lane < S) x.draftIds[int64_t(n) * S + lane] = x.candIds[(int64_t(n) * S + lane) * K + pick];
  for (int32_t first = lane; first < S * K; first += 32 * kStageBatch) {
    float v[kStageBatch];
#pragma unroll
    for (int32_t u = 0; u < kStageBatch; u++) {
      const int32_t e = first + 32 * u, t = e / K;
      v[u] = e < S * K ? qRows[((int64_t(n) * S + t) * K + path[warp][t]) * K + e % K] : 0.0f;
    }
#pragma unroll
    for (int32_t u = 0; u < kStageBatch; u++) {
      const int32_t e = first + 32 * u;
      if (e < S * K) x.q[int64_t(n) * S * K + e] = v[u];
    }
  }
}

// Chunks per row: enough top-K CTAs for the GPU at any batch, within the merge's limits.
int32_t chunksFor(int32_t rows, int32_t V, int32_t K) {
  int32_t chunks = (kTargetCtas + rows - 1) / rows;
  chunks = min(chunks, min(kMaxChunks, kMergeEntries / K));
  chunks = min(chunks, (V + kMinChunk - 1) / kMinChunk);
  return max(chunks, 1);
}

}  // namespace

cudaError_t launch(Args const& args, void* workspace, cudaStream_t stream) {
  if (args.K < 1 || args.K > kMaxK || args.K > args.V || args.S < 1 || args.S > kMaxSlots || args.R < 1) {
    return cudaErrorInvalidValue;
  }
  if (args.N == 0) return cudaSuccess;
  const int32_t rows = args.N * args.S, chunks = chunksFor(rows, args.V, args.K);
  const int32_t chunkLength = ((args.V + chunks - 1) / chunks + 7) / 8 * 8;  // a multiple of 8: aligned 16-byte loads
  float* listValue = static_cast<float*>(workspace);
  int32_t* listIndex = reinterpret_cast<int32_t*>(listValue + int64_t(rows) * chunks * args.K);
  int32_t* choice = listIndex + int64_t(rows) * chunks * args.K;
  float* qRows = reinterpret_cast<float*>(choice + int64_t(rows) * args.K);
  const unsigned topKCtas = unsigned(rows * chunks);
  switch (args.logitsType) {
    case DType::kFLOAT:
      BEAMTRT_LAUNCH(topKKernel<DType::kFLOAT>, topKCtas, kThreads, stream)(args, chunks, chunkLength, listValue,
                                                                           listIndex);
      break;
    case DType::kHALF:
      BEAMTRT_LAUNCH(topKKernel<DType::kHALF>, topKCtas, kThreads, stream)(args, chunks, chunkLength, listValue,
                                                                          listIndex);
      break;
    case DType::kBF16:
      BEAMTRT_LAUNCH(topKKernel<DType::kBF16>, topKCtas, kThreads, stream)(args, chunks, chunkLength, listValue,
                                                                          listIndex);
      break;
    default: return cudaErrorInvalidValue;
  }
  BEAMTRT_LAUNCH(latticeKernel, rows, kThreads, stream)(args, chunks, listValue, listIndex, choice, qRows);
  BEAMTRT_LAUNCH(walkKernel, (args.N + kWarps - 1) / kWarps, kThreads, stream)(args, choice, qRows);
  return cudaGetLastError();
}

}  // namespace selector
}  // namespace beamtrt
