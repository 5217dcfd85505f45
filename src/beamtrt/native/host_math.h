// Shared host math for the fused CPU kernels (beam_step.cpp, draft_step.cpp): bf16 access, the row-invariant
// GEMM and the small ops. Every dot product is accumulated in fp32, 8 lanes over k in order, then summed lane by
// lane, so a row's result does not depend on how many rows share a call.
#pragma once

#include <cmath>
#ifdef __FMA__
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

enum DType : int32_t { F32 = 0, BF16 = 1 };

// ---- element access -------------------------------------------------------------------------------------------

static inline float load1(const void *p, int64_t i, int dt) {
  if (dt == F32) return static_cast<const float *>(p)[i];
  uint32_t u = uint32_t(static_cast<const uint16_t *>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline void store1(void *p, int64_t i, float f, int dt) {
  if (dt == F32) { static_cast<float *>(p)[i] = f; return; }
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) { static_cast<uint16_t *>(p)[i] = uint16_t((u >> 16) | 0x40); return; }  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even, as torch does
  static_cast<uint16_t *>(p)[i] = uint16_t(u >> 16);
}

static inline v8f load8(const float *p) { v8f v; std::memcpy(&v, p, 32); return v; }

static inline v8f load8(const uint16_t *p) {
  v8u16 h;
  std::memcpy(&h, p, 16);
  v8u32 u = __builtin_convertvector(h, v8u32) << 16;
  v8f f;
  std::memcpy(&f, &u, 32);
  return f;
}

// acc + a * b, fused where the CPU has FMA. Explicit, because the build uses -ffp-contract=off: left to itself the
// compiler fuses some multiply-adds and not others, and a row's bits would depend on which loop computed it.
static inline v8f fma8(v8f a, v8f b, v8f acc) {
#ifdef __FMA__
  return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
  return acc + a * b;
#endif
}

static inline float hsum(v8f a) {  // a fixed order: lanes (0+4, 1+5, 2+6, 3+7), then pairs
  float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
  return (s0 + s2) + (s1 + s3);
}

// ---- y[M, N] = x[M, K] · w[N, K]ᵀ (+ b) -------------------------------------------------------------------------

constexpr int PF = 1;  // blocks of weight rows prefetched ahead (M > 1; 1 measured best of 1, 2, 4)

template <typename W>
static inline float finish(v8f acc, const float *x, const W *w, int64_t K8, int64_t K) {
  float s = hsum(acc);
  for (int64_t k = K8; k < K; k++) s += x[k] * load1(w, k, std::is_same<W, float>::value ? F32 : BF16);
  return s;
}

// A register of Lanes<LR> holds the 8-lane accumulators of LR rows side by side. LR = 1: 8 lanes, one row. LR = 2
// (AVX-512): one 16-lane FMA does the work of two 8-lane ones, the weights' 8 lanes broadcast to both halves.
template <int LR> struct Lanes;
template <> struct Lanes<1> {
  typedef v8f V;
  template <typename S> static V w(const S *p) { return load8(p); }  // fp32, or bf16 widened
  // A row's lanes are loaded, and an accumulator read, as values: copying them through the tile's arrays took those
  // arrays' addresses, and GCC then kept the 4 x 2 tile's 8 accumulators in memory, stored at every k (AVX2, cold
  // 3,072 x 576 GEMMs: 4 rows 0.67 against 0.26 ms, 8 rows 1.31 against 0.36 ms).
  static V x(const float *p) { return load8(p); }
  static v8f half(V a, int) { return a; }
  static V fma(V a, V b, V acc) { return fma8(a, b, acc); }
  static void pin(V &) {}  // with 16 vector registers, pinning the 4 x 2 tile measured 0.64-0.86x
};
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define BEAM_PAIRS 1
template <> struct Lanes<2> {
  typedef float V __attribute__((vector_size(64)));
  static V w(const float *p) {  // maskz: the unmasked intrinsic's undefined operand trips GCC 12's warnings
    return (V)_mm512_maskz_broadcast_f32x8(0xffff, _mm256_loadu_ps(p));
  }
  static V w(const uint16_t *p) {  // 8 bf16 to both halves, then widened to fp32 (the bits shifted up)
    typedef uint16_t U16 __attribute__((vector_size(32)));
    typedef uint32_t U32 __attribute__((vector_size(64)));
    const U16 h = (U16)_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
    return (V)(__builtin_convertvector(h, U32) << 16);
  }
  static V x(const float *p) { V v; std::memcpy(&v, p, 64); return v; }
  static v8f half(V a, int h) { v8f r; std::memcpy(&r, reinterpret_cast<const float *>(&a) + 8 * h, 32); return r; }
  static V fma(V a, V b, V acc) { return (V)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc); }
  // Keeps v in a register: left alone, GCC folds each use of a loaded vector into its FMA as a memory operand, so a
  // tile of R x NB accumulators loads 2 R NB vectors per k instead of R + NB and runs at the load ports' pace.
  static void pin(V &v) { asm("" : "+v"(v)); }
};
#endif

// Row groups g..g+R of xp (the rows packed LR to a group, [groups, K8 / 8, 8 LR]: a group's lanes at k are one load)
// against one block of NB weight rows (wf: the rows themselves, or their fp32 copies); `ahead`, when not 0, is the next
// block's address: each k prefetches there the NB x 8 weights it consumes here.
template <int LR, int R, int NB, typename S, typename W>
static inline void tile(const float *xp, const float *x, const S *const *wf, const W *wr, float *y, int64_t g,
                        int64_t M, int64_t n0, int nb, int64_t N, int64_t K8, int64_t K, uintptr_t ahead) {
  typedef Lanes<LR> L;
  typename L::V acc[R][NB] = {};
  for (int64_t k = 0; k < K8; k += 8) {
    if (ahead)
      for (uintptr_t b = 0; b < NB * 8 * sizeof(W); b += 64)
        __builtin_prefetch(reinterpret_cast<const void *>(ahead + uintptr_t(k * NB) * sizeof(W) + b), 0, 2);
    typename L::V xv[R], wv[NB];
    for (int i = 0; i < R; i++) { xv[i] = L::x(xp + ((g + i) * K8 + k) * LR); L::pin(xv[i]); }
    for (int j = 0; j < NB; j++) { wv[j] = L::w(wf[j] + k); L::pin(wv[j]); }
    for (int j = 0; j < NB; j++)
      for (int i = 0; i < R; i++) acc[i][j] = L::fma(xv[i], wv[j], acc[i][j]);
  }
  for (int i = 0; i < R; i++)
    for (int h = 0; h < LR; h++) {
      const int64_t m = (g + i) * LR + h;
      if (m >= M) break;
      for (int j = 0; j < nb; j++) {
        y[m * N + n0 + j] = finish(L::half(acc[i][j], h), x + m * K, wr + j * K, K8, K);
      }
    }
}

// The row groups against one block of NB weight rows (wf: their addresses in the tiles' source type S), RB groups to
// a tile; the last (groups mod RB) take one tile.
template <int LR, int RB, int NB, typename S, typename W>
static inline void tiles(const float *xp, const float *x, const S *const *wf, const W *wr, float *y, int64_t G,
                         int64_t M, int64_t n0, int nb, int64_t N, int64_t K8, int64_t K, uintptr_t ahead) {
  int64_t g = 0;
  for (; g + RB <= G; g += RB, ahead = 0) tile<LR, RB, NB>(xp, x, wf, wr, y, g, M, n0, nb, N, K8, K, ahead);
  switch (G - g) {
    case 3: if constexpr (RB > 3) tile<LR, 3, NB>(xp, x, wf, wr, y, g, M, n0, nb, N, K8, K, ahead); break;
    case 2: if constexpr (RB > 2) tile<LR, 2, NB>(xp, x, wf, wr, y, g, M, n0, nb, N, K8, K, ahead); break;
    case 1: if constexpr (RB > 1) tile<LR, 1, NB>(xp, x, wf, wr, y, g, M, n0, nb, N, K8, K, ahead); break;
  }
}

// M > 1 rows against blocks of NB weight rows. bf16 weights are widened to fp32 as they are loaded, except with row
// pairs (AVX-512) when several tiles share a block: there they are converted once per block into fp32 copies that
// every tile reuses. With one row to a lane group (AVX2) the copies measured slower at every M (cold 3,072 x 576
// GEMMs: 8 rows 0.42 against 0.30 ms, 128 rows 5.5 against 4.8 ms).
template <int LR, int RB, int NB, typename W>
static void gemm_blocks(const float *x, const W *w, float *y, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t K8 = K & ~int64_t(7), G = (M + LR - 1) / LR;
  const bool copy = !std::is_same<W, float>::value && LR > 1 && G > RB;
  const bool packed = LR > 1 || K8 != K;  // one row to a group, K a multiple of 8: x is already that layout
  std::vector<float> pack(packed ? G * K8 * LR : 0, 0.f);  // the rows packed LR to a group
  if (packed)
    for (int64_t m = 0; m < M; m++)
      for (int64_t k = 0; k < K8; k += 8)
        std::memcpy(&pack[((m / LR) * K8 + k) * LR + 8 * (m % LR)], x + m * K + k, 32);
  const float *xp = packed ? pack.data() : x;
  #pragma omp parallel num_threads(threads)
  {
    std::vector<float> scratch(copy ? NB * K8 : 0);
    #pragma omp for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += NB) {
      const int nb = int(N - n0 < NB ? N - n0 : NB);
      const W *wr = w + n0 * K;
      // The first pass over this block's weights prefetches the block PF ahead: left to the hardware prefetcher, the
      // weight stream stalls while the rows compute and memory time adds to compute time (the fp32 expert GEMM of a
      // verified block, 4 rows, was 1.6x a 1-row one; with this, 1.1x). Into L2, not L1: there the next block and
      // this one evicted the packed rows (8 rows of K = 576 are 18 KB of a 32 KB L1), and from 4 rows a GEMM streamed
      // its weights at 20 GB/s instead of 30.
      const uintptr_t ahead = reinterpret_cast<uintptr_t>(wr) + uintptr_t(PF * NB * K) * sizeof(W);
      if (!copy) {
        const W *wd[NB];
        for (int j = 0; j < NB; j++) wd[j] = wr + (j < nb ? j : 0) * K;
        tiles<LR, RB, NB>(xp, x, wd, wr, y, G, M, n0, nb, N, K8, K, ahead);
        continue;
      }
      const float *wf[NB];
      for (int j = 0; j < NB; j++) wf[j] = &scratch[(j < nb ? j : 0) * K8];
      for (int j = 0; j < nb; j++)
        for (int64_t k = 0; k < K8; k += 8) {
          v8f v = load8(wr + j * K + k);
          std::memcpy(&scratch[j * K8 + k], &v, 32);
        }
      tiles<LR, RB, NB>(xp, x, wf, wr, y, G, M, n0, nb, N, K8, K, ahead);
    }
  }
}

// Each (m, n) is one 8-lane accumulator over k in order, then hsum, then the scalar tail: the same arithmetic
// whatever M is and however rows and weights are blocked or share a register, so the blocking is free to follow
// speed. Weights are read as one sequential stream per thread (narrow rows read as several interleaved streams defeat
// the hardware prefetcher on the dev machine: 7 GB/s instead of 15).
template <typename W>
static void gemm_t(const float *x, const W *w, float *y, int64_t M, int64_t N, int64_t K, int threads) {
  if (M == 1) {
    const int64_t K8 = K & ~int64_t(7);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
      const W *wr = w + n * K;
      v8f acc = {};
      for (int64_t k = 0; k < K8; k += 8) acc = fma8(load8(x + k), load8(wr + k), acc);
      y[n] = finish(acc, x, wr, K8, K);
    }
    return;
  }
#ifdef BEAM_PAIRS
  gemm_blocks<2, 4, 5>(x, w, y, M, N, K, threads);  // 4 pairs x 5 weight rows: 20 + 4 + 5 of the 32 registers
#else
  gemm_blocks<1, 4, 2>(x, w, y, M, N, K, threads);
#endif
}

static void gemm(const float *x, const void *w, const void *b, float *y, int64_t M, int64_t N, int64_t K, int dt,
                 int threads) {
  if (dt == F32) gemm_t(x, static_cast<const float *>(w), y, M, N, K, threads);
  else gemm_t(x, static_cast<const uint16_t *>(w), y, M, N, K, threads);
  if (b)
    for (int64_t m = 0; m < M; m++)
      for (int64_t n = 0; n < N; n++) y[m * N + n] += load1(b, n, dt);
}

// ---- the small ops --------------------------------------------------------------------------------------------

static void rms_norm(const float *x, const void *w, float *y, int64_t n, float eps, int dt) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / float(n) + eps);
  for (int64_t i = 0; i < n; i++) y[i] = x[i] * r * load1(w, i, dt);
}

static void rope(float *x, const float *cos, const float *sin, int d) {  // x * cos + roll(x, d/2) * sin
  float t[1024];
  std::memcpy(t, x, sizeof(float) * d);
  for (int i = 0; i < d; i++) x[i] = t[i] * cos[i] + t[(i + d / 2) % d] * sin[i];
}

static inline float silu(float g) { return g / (1.f + std::exp(-g)); }
