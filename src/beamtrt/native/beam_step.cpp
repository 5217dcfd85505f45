// Fused Beam forward for a few token rows on the host: the CPU fast path of the torch backend (see native/__init__.py).
//
// Every dot product is accumulated in fp32, 8 lanes over k in order, then summed lane by lane: a row's result does not
// depend on how many rows share the call, so a verified block of 8 gets bit-for-bit the logits of 8 single-token steps.
// Weights, norms, biases and the KV cache are fp32 or bf16 (the model's dtype); activations stay fp32 throughout.
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

struct Layer {
  const void *input_norm, *post_norm;  // [H]
  const void *qkv_w, *qkv_b;           // [(NQ + 2 NKV) D, H], bias [(NQ + 2 NKV) D] or null
  const void *o_w, *o_b;               // [H, NQ D], bias [H] or null
  const void *q_norm, *k_norm;         // [D] or null (no QK-norm)
  const void *router;                  // [E, H]; null in a dense layer
  const void *gate_up, *down;          // MoE: [E, 2I, H], [E, H, I]; dense: [2I, H], [H, I]
  int64_t inter;                       // I
};

struct Model {
  int32_t dtype, layers, hidden, heads, kv_heads, head_dim, experts, top_k, norm_topk, tied;
  int64_t vocab;
  float eps;
  const void *embed, *final_norm, *lm_head;  // [V, H], [H], [V, H]
  const Layer *layer;
};

struct Step {
  int32_t rows, out_rows, taps, threads;
  void *k_cache, *v_cache;           // [layers, slots, NKV, max_len, D]
  int64_t slots, max_len;
  const int64_t *ids, *slot, *pos;   // [rows]: token, cache slot, absolute position
  const float *cos, *sin;            // [rows, D]: rotate-half RoPE, rotate-half's sign folded into sin
  const int64_t *out_index;          // [out_rows]: rows whose logits are wanted
  float *logits;                     // [out_rows, V]
  const int32_t *tap_layer;          // [taps]
  float *tap_out;                    // [taps, rows, H]: residual stream after each tapped layer
};

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
        for (int64_t k = 0; k < K8; k += 8) { v8f v = load8(wr + j * K + k); std::memcpy(&scratch[j * K8 + k], &v, 32); }
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

// Attention of every row's heads over its slot's keys 0..pos (the step's own K/V are already in the cache). Each
// (row, head) is one task whose arithmetic does not depend on the other rows: a key's score is one 8-lane
// accumulator over d in order, then hsum, then the scalar tail; each output lane accumulates p_j v_j over j in order.
template <typename C>
static void attention_t(const Model &m, const C *k_cache, const C *v_cache, const Step &s, const float *q,
                        float *out) {
  constexpr int dc = std::is_same<C, float>::value ? F32 : BF16;
  const int64_t D = m.head_dim, D8 = D & ~int64_t(7), G = m.heads / m.kv_heads;
  const float scale = 1.f / std::sqrt(float(D));
  const int64_t tasks = int64_t(s.rows) * m.heads;
  #pragma omp parallel num_threads(s.threads)
  {
    std::vector<float> p;
    #pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; task++) {
      const int64_t r = task / m.heads, h = task % m.heads, len = s.pos[r] + 1;
      const int64_t base = (s.slot[r] * m.kv_heads + h / G) * s.max_len * D;
      const C *kb = k_cache + base, *vb = v_cache + base;
      const float *qh = q + (r * m.heads + h) * D;
      p.resize(len);
      int64_t j = 0;
      for (; j + 4 <= len; j += 4) {  // four keys at a time: independent accumulators, the same per-key arithmetic
        v8f acc[4] = {};
        for (int64_t i = 0; i < D8; i += 8) {
          const v8f qv = load8(qh + i);
          for (int t = 0; t < 4; t++) acc[t] = fma8(qv, load8(kb + (j + t) * D + i), acc[t]);
        }
        for (int t = 0; t < 4; t++) p[j + t] = finish(acc[t], qh, kb + (j + t) * D, D8, D) * scale;
      }
      for (; j < len; j++) {
        v8f acc = {};
        for (int64_t i = 0; i < D8; i += 8) acc = fma8(load8(qh + i), load8(kb + j * D + i), acc);
        p[j] = finish(acc, qh, kb + j * D, D8, D) * scale;
      }
      float mx = -INFINITY;
      for (j = 0; j < len; j++) mx = p[j] > mx ? p[j] : mx;
      float z = 0.f;
      for (j = 0; j < len; j++) { p[j] = std::exp(p[j] - mx); z += p[j]; }
      float *o = out + (r * m.heads + h) * D;
      for (int64_t i0 = 0; i0 < D8; i0 += 32) {  // up to four 8-lane groups of the output in registers, over every key
        const int n = int((D8 - i0) / 8 < 4 ? (D8 - i0) / 8 : 4);
        v8f acc[4] = {};
        for (j = 0; j < len; j++) {
          const v8f pj = {p[j], p[j], p[j], p[j], p[j], p[j], p[j], p[j]};
          for (int c = 0; c < n; c++) acc[c] = fma8(pj, load8(vb + j * D + i0 + 8 * c), acc[c]);
        }
        for (int c = 0; c < n; c++) std::memcpy(o + i0 + 8 * c, &acc[c], 32);
      }
      for (int64_t i = D8; i < D; i++) {
        float acc = 0.f;
        for (j = 0; j < len; j++) acc += p[j] * load1(vb, j * D + i, dc);
        o[i] = acc;
      }
      for (int64_t i = 0; i < D; i++) o[i] /= z;
    }
  }
}

static void attention(const Model &m, const void *k_cache, const void *v_cache, const Step &s, const float *q,
                      float *out) {
  if (m.dtype == F32)
    attention_t(m, static_cast<const float *>(k_cache), static_cast<const float *>(v_cache), s, q, out);
  else
    attention_t(m, static_cast<const uint16_t *>(k_cache), static_cast<const uint16_t *>(v_cache), s, q, out);
}

static void attention_block(const Model &m, int l, const Step &s, const float *xn, float *out) {
  const Layer &L = m.layer[l];
  const int64_t R = s.rows, D = m.head_dim, NQ = m.heads, NKV = m.kv_heads, width = (NQ + 2 * NKV) * D;
  const int dt = m.dtype, esize = dt == F32 ? 4 : 2;
  const int64_t layer_bytes = s.slots * NKV * s.max_len * D * esize;
  void *k_cache = static_cast<char *>(s.k_cache) + l * layer_bytes, *v_cache = static_cast<char *>(s.v_cache) + l * layer_bytes;
  std::vector<float> qkv(R * width), q(R * NQ * D), att(R * NQ * D);
  gemm(xn, L.qkv_w, L.qkv_b, qkv.data(), R, width, m.hidden, dt, s.threads);
  for (int64_t r = 0; r < R; r++) {
    float *row = &qkv[r * width];
    const float *cs = s.cos + r * D, *sn = s.sin + r * D;
    for (int64_t h = 0; h < NQ + NKV; h++) {
      float *head = row + h * D;
      if (L.q_norm) rms_norm(head, h < NQ ? L.q_norm : L.k_norm, head, D, m.eps, dt);
      rope(head, cs, sn, int(D));
    }
    std::memcpy(&q[r * NQ * D], row, sizeof(float) * NQ * D);
    for (int64_t g = 0; g < NKV; g++) {
      const int64_t at = ((s.slot[r] * NKV + g) * s.max_len + s.pos[r]) * D;
      for (int64_t i = 0; i < D; i++) {
        store1(k_cache, at + i, row[(NQ + g) * D + i], dt);
        store1(v_cache, at + i, row[(NQ + NKV + g) * D + i], dt);
      }
    }
  }
  attention(m, k_cache, v_cache, s, q.data(), att.data());
  gemm(att.data(), L.o_w, L.o_b, out, R, m.hidden, NQ * D, dt, s.threads);
}

static void mlp_block(const Model &m, const Layer &L, const Step &s, const float *xn, float *out) {
  const int64_t R = s.rows, H = m.hidden, I = L.inter;
  const int dt = m.dtype, wsize = dt == F32 ? 4 : 2;
  std::vector<float> gu(R * 2 * I), act(R * I);
  auto swiglu = [&](const float *x, int64_t rows, const void *w_gate_up, const void *w_down, float *y) {
    gemm(x, w_gate_up, nullptr, gu.data(), rows, 2 * I, H, dt, s.threads);
    for (int64_t r = 0; r < rows; r++)
      for (int64_t i = 0; i < I; i++) act[r * I + i] = silu(gu[r * 2 * I + i]) * gu[r * 2 * I + I + i];
    gemm(act.data(), w_down, nullptr, y, rows, H, I, dt, s.threads);
  };
  if (!L.router) { swiglu(xn, R, L.gate_up, L.down, out); return; }

  const int E = m.experts, k = m.top_k;
  std::vector<float> logits(R * E), weight(R * k), xe(R * H), ye(R * k * H, 0.f);
  std::vector<int> choice(R * k);
  gemm(xn, L.router, nullptr, logits.data(), R, E, H, dt, s.threads);
  for (int64_t r = 0; r < R; r++) {
    const float *lg = &logits[r * E];
    float mx = -INFINITY;
    for (int e = 0; e < E; e++) mx = lg[e] > mx ? lg[e] : mx;
    std::vector<float> p(E);
    float z = 0.f;
    for (int e = 0; e < E; e++) { p[e] = std::exp(lg[e] - mx); z += p[e]; }
    std::vector<bool> taken(E, false);
    float top_z = 0.f;
    for (int t = 0; t < k; t++) {  // the k largest logits, ties to the lower id
      int best = -1;
      for (int e = 0; e < E; e++) if (!taken[e] && (best < 0 || lg[e] > lg[best])) best = e;
      taken[best] = true;
      choice[r * k + t] = best;
      weight[r * k + t] = p[best] / z;
      top_z += p[best];
    }
    if (m.norm_topk)  // softmax over the top-k logits == renormalized top-k of the full softmax
      for (int t = 0; t < k; t++) weight[r * k + t] = p[choice[r * k + t]] / top_z;
  }
  std::vector<int64_t> who;  // (row, slot) pairs routed to expert e
  for (int e = 0; e < E; e++) {
    who.clear();
    for (int64_t i = 0; i < R * k; i++) if (choice[i] == e) who.push_back(i);
    if (who.empty()) continue;
    const int64_t n = int64_t(who.size());
    for (int64_t j = 0; j < n; j++) std::memcpy(&xe[j * H], xn + (who[j] / k) * H, sizeof(float) * H);
    std::vector<float> y(n * H);
    swiglu(xe.data(), n, static_cast<const char *>(L.gate_up) + e * 2 * I * H * wsize,
           static_cast<const char *>(L.down) + e * H * I * wsize, y.data());
    for (int64_t j = 0; j < n; j++) std::memcpy(&ye[who[j] * H], &y[j * H], sizeof(float) * H);
  }
  for (int64_t r = 0; r < R; r++)  // each row sums its experts in its own top-k order
    for (int64_t i = 0; i < H; i++) {
      float acc = 0.f;
      for (int t = 0; t < k; t++) acc += ye[(r * k + t) * H + i] * weight[r * k + t];
      out[r * H + i] = acc;
    }
}

extern "C" {

int beam_step_abi() { return 1; }

void beam_gemm(const float *x, const void *w, float *y, int64_t M, int64_t N, int64_t K, int32_t dtype,
               int32_t threads) {
  gemm(x, w, nullptr, y, M, N, K, dtype, threads);
}

void beam_step(const Model *mp, const Step *sp) {
  const Model &m = *mp;
  const Step &s = *sp;
  const int64_t R = s.rows, H = m.hidden;
  const int dt = m.dtype;
  std::vector<float> x(R * H), xn(R * H), y(R * H);
  for (int64_t r = 0; r < R; r++)
    for (int64_t i = 0; i < H; i++) x[r * H + i] = load1(m.embed, s.ids[r] * H + i, dt);
  for (int l = 0; l < m.layers; l++) {
    const Layer &L = m.layer[l];
    for (int64_t r = 0; r < R; r++) rms_norm(&x[r * H], L.input_norm, &xn[r * H], H, m.eps, dt);
    attention_block(m, l, s, xn.data(), y.data());
    for (int64_t i = 0; i < R * H; i++) x[i] += y[i];
    for (int64_t r = 0; r < R; r++) rms_norm(&x[r * H], L.post_norm, &xn[r * H], H, m.eps, dt);
    mlp_block(m, L, s, xn.data(), y.data());
    for (int64_t i = 0; i < R * H; i++) x[i] += y[i];
    for (int t = 0; t < s.taps; t++)
      if (s.tap_layer[t] == l) std::memcpy(s.tap_out + t * R * H, x.data(), sizeof(float) * R * H);
  }
  for (int64_t o = 0; o < s.out_rows; o++) rms_norm(&x[s.out_index[o] * H], m.final_norm, &xn[o * H], H, m.eps, dt);
  gemm(xn.data(), m.tied ? m.embed : m.lm_head, nullptr, s.logits, s.out_rows, m.vocab, H, dt, s.threads);
}

}  // extern "C"
