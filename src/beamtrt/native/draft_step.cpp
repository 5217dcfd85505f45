// Fused DFlash2 drafter on the host: one block per sequence through every draft layer (draft_block), and the context
// append (fc + hidden norm, then each layer's rotated K and V into its ring: draft_append). The torch backend's CPU
// path for models/dflash2.py, one call where the PyTorch reference runs ~300 small ops a step; the same math with
// weights and the ring in the drafter's dtype and activations in fp32 throughout.
#include "host_math.h"

struct DraftLayer {
  const void *input_norm, *post_norm;       // [H]
  const void *qkv_w, *o_w;                  // [(NQ + 2 NKV) D, H], [H, NQ D]
  const void *q_norm, *k_norm;              // [D]
  const void *gate_up, *down;               // [2I, H], [H, I]
  const void *conv_base[2], *conv_proj[2];  // attention_conv, mlp_conv: base_kernel [2, T, H], projection [2 T G, H]
};

struct Drafter {
  int32_t dtype, layers, hidden, heads, kv_heads, head_dim, inter, conv_taps, conv_group, features;
  float eps;
  const void *embed, *fc, *hidden_norm, *final_norm;  // the target's embedding [V, H]; fc [H, F]; norms [H]
  const DraftLayer *layer;
};

struct Ring {
  void *k, *v;             // [layers, slots, NKV, W, D]: context keys (rotated) and values, position p in slot p mod W
  int64_t slots, window;
};

struct Block {
  int32_t n, block, threads, use_conv;  // use_conv 0: the sublayers without their convs (DFlash v1)
  const int64_t *ids;      // [n, block]: the anchor, then mask tokens
  const int64_t *slot;     // [n]: each sequence's ring
  const int64_t *start;    // [n]: context tokens appended so far; ring slots [0, min(start, W)) are visible
  const float *cos, *sin;  // [n * block, D] at positions start .. start + block - 1 (rotate-half sign in sin)
  float *hidden;           // [n, block - 1, H]: the final-normed hidden of block positions 1 .. block - 1
};

struct Append {
  int32_t rows, threads;
  const float *taps;                // [rows, F]: the target's tapped residual streams of committed tokens
  const int64_t *slot, *ring_slot;  // [rows]: each row's ring, and its slot there (position mod W)
  const float *cos, *sin;           // [rows, D] at the rows' positions
};

static inline int64_t ring_at(const Drafter &m, const Ring &ring, int l, int64_t slot, int64_t g) {
  return ((int64_t(l) * ring.slots + slot) * m.kv_heads + g) * ring.window * m.head_dim;
}

// GroupedConv2Tap on each sequence's block of rows: out[p] = Σ_t [p >= t] (base[side, t] + δ[p, side, t, c / g])
// · in[p - t], with δ = the projection of the sublayer's normed input (delta [rows, 2, T, G]).
static void conv(const Drafter &m, const void *base, const float *delta, int side, const float *in, float *out,
                 int64_t rows, int block) {
  const int64_t H = m.hidden, T = m.conv_taps, G = H / m.conv_group, g = m.conv_group;
  for (int64_t r = 0; r < rows; r++) {
    const int64_t p = r % block;
    const float *dr = delta + r * 2 * T * G + side * T * G;
    for (int64_t c = 0; c < H; c++) {
      float acc = (load1(base, side * T * H + c, m.dtype) + dr[c / g]) * in[r * H + c];
      for (int64_t t = 1; t < T && t <= p; t++)
        acc += (load1(base, (side * T + t) * H + c, m.dtype) + dr[t * G + c / g]) * in[(r - t) * H + c];
      out[r * H + c] = acc;
    }
  }
}

// Each block query row's heads over its sequence's visible ring slots, then the block's own K/V (bidirectional).
// qkv: [rows, (NQ + 2 NKV) D] with q and k normed and rotated; out: [rows, NQ D].
template <typename C>
static void attention_t(const Drafter &m, const Ring &ring, int l, const Block &s, const float *qkv, float *out) {
  const int64_t D = m.head_dim, D8 = D & ~int64_t(7), NQ = m.heads, NKV = m.kv_heads, G = NQ / NKV;
  const int64_t B = s.block, width = (NQ + 2 * NKV) * D, tasks = int64_t(s.n) * B * NQ;
  const float scale = 1.f / std::sqrt(float(D));
  constexpr int dc = std::is_same<C, float>::value ? F32 : BF16;
  #pragma omp parallel num_threads(s.threads)
  {
    std::vector<float> p;
    #pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; task++) {
      const int64_t row = task / NQ, h = task % NQ, n = row / B, g = h / G;
      const int64_t ctx = s.start[n] < ring.window ? s.start[n] : ring.window;
      const int64_t base = ring_at(m, ring, l, s.slot[n], g);
      const C *kb = static_cast<const C *>(ring.k) + base, *vb = static_cast<const C *>(ring.v) + base;
      const float *qh = qkv + row * width + h * D;
      const float *bk = qkv + n * B * width + (NQ + g) * D, *bv = qkv + n * B * width + (NQ + NKV + g) * D;
      p.resize(ctx + B);
      for (int64_t j = 0; j < ctx; j++) {
        v8f acc = {};
        for (int64_t i = 0; i < D8; i += 8) acc = fma8(load8(qh + i), load8(kb + j * D + i), acc);
        p[j] = finish(acc, qh, kb + j * D, D8, D) * scale;
      }
      for (int64_t j = 0; j < B; j++) {
        v8f acc = {};
        for (int64_t i = 0; i < D8; i += 8) acc = fma8(load8(qh + i), load8(bk + j * width + i), acc);
        p[ctx + j] = finish(acc, qh, bk + j * width, D8, D) * scale;
      }
      float mx = -INFINITY, z = 0.f;
      for (float x : p) mx = x > mx ? x : mx;
      for (float &x : p) { x = std::exp(x - mx); z += x; }
      float *o = out + row * NQ * D + h * D;  // Σ_j p_j v_j, over j in order for every lane
      std::memset(o, 0, sizeof(float) * D);
      for (int64_t j = 0; j < ctx + B; j++) {
        const float pj = p[j];
        const v8f pv = {pj, pj, pj, pj, pj, pj, pj, pj};
        for (int64_t i = 0; i < D8; i += 8) {
          const v8f v = j < ctx ? load8(vb + j * D + i) : load8(bv + (j - ctx) * width + i);
          const v8f acc = fma8(pv, v, load8(o + i));
          std::memcpy(o + i, &acc, 32);
        }
        for (int64_t i = D8; i < D; i++)
          o[i] += pj * (j < ctx ? load1(vb, j * D + i, dc) : bv[(j - ctx) * width + i]);
      }
      for (int64_t i = 0; i < D; i++) o[i] /= z;
    }
  }
}

// Normalizes and rotates the q and k heads of each qkv row in place (heads [0, NQ + NKV) of the row; `first` the
// first head to touch: 0, or NQ when the rows hold only k and v).
static void norm_rope(const Drafter &m, const DraftLayer &L, float *rows, int64_t count, int64_t width, int64_t first,
                      const float *cos, const float *sin) {
  const int64_t D = m.head_dim;
  for (int64_t r = 0; r < count; r++)
    for (int64_t h = first; h < m.heads + m.kv_heads; h++) {
      float *head = rows + r * width + (h - first) * D;
      rms_norm(head, h < m.heads ? L.q_norm : L.k_norm, head, D, m.eps, m.dtype);
      rope(head, cos + r * D, sin + r * D, int(D));
    }
}

static void attention_block(const Drafter &m, const Ring &ring, int l, const Block &s, const float *y, float *out) {
  const DraftLayer &L = m.layer[l];
  const int64_t R = int64_t(s.n) * s.block, D = m.head_dim, NQ = m.heads, width = (NQ + 2 * m.kv_heads) * D;
  std::vector<float> qkv(R * width), att(R * NQ * D);
  gemm(y, L.qkv_w, nullptr, qkv.data(), R, width, m.hidden, m.dtype, s.threads);
  norm_rope(m, L, qkv.data(), R, width, 0, s.cos, s.sin);
  if (m.dtype == F32) attention_t<float>(m, ring, l, s, qkv.data(), att.data());
  else attention_t<uint16_t>(m, ring, l, s, qkv.data(), att.data());
  gemm(att.data(), L.o_w, nullptr, out, R, m.hidden, NQ * D, m.dtype, s.threads);
}

static void mlp_block(const Drafter &m, const DraftLayer &L, int64_t R, int threads, const float *y, float *out) {
  const int64_t I = m.inter;
  std::vector<float> gu(R * 2 * I), act(R * I);
  gemm(y, L.gate_up, nullptr, gu.data(), R, 2 * I, m.hidden, m.dtype, threads);
  for (int64_t r = 0; r < R; r++)
    for (int64_t i = 0; i < I; i++) act[r * I + i] = silu(gu[r * 2 * I + i]) * gu[r * 2 * I + I + i];
  gemm(act.data(), L.down, nullptr, out, R, m.hidden, I, m.dtype, threads);
}

extern "C" {

void draft_block(const Drafter *mp, const Ring *rp, const Block *sp) {
  const Drafter &m = *mp;
  const Block &s = *sp;
  const int64_t B = s.block, R = int64_t(s.n) * B, H = m.hidden, P = 2 * int64_t(m.conv_taps) * (H / m.conv_group);
  std::vector<float> x(R * H), xn(R * H), y(R * H), a(R * H), delta(R * P);
  for (int64_t r = 0; r < R; r++)
    for (int64_t i = 0; i < H; i++) x[r * H + i] = load1(m.embed, s.ids[r] * H + i, m.dtype);
  for (int l = 0; l < m.layers; l++) {
    const DraftLayer &L = m.layer[l];
    for (int side = 0; side < 2; side++) {  // the attention sublayer, then the MLP, each between its conv's taps
      for (int64_t r = 0; r < R; r++) rms_norm(&x[r * H], side ? L.post_norm : L.input_norm, &xn[r * H], H, m.eps,
                                               m.dtype);
      if (s.use_conv) {
        gemm(xn.data(), L.conv_proj[side], nullptr, delta.data(), R, P, H, m.dtype, s.threads);
        conv(m, L.conv_base[side], delta.data(), 0, xn.data(), y.data(), R, int(B));
      }
      const float *in = s.use_conv ? y.data() : xn.data();
      if (side == 0) attention_block(m, *rp, l, s, in, a.data());
      else mlp_block(m, L, R, s.threads, in, a.data());
      if (s.use_conv) conv(m, L.conv_base[side], delta.data(), 1, a.data(), y.data(), R, int(B));
      const float *out = s.use_conv ? y.data() : a.data();
      for (int64_t i = 0; i < R * H; i++) x[i] += out[i];
    }
  }
  for (int64_t n = 0; n < s.n; n++)
    for (int64_t p = 1; p < B; p++)
      rms_norm(&x[(n * B + p) * H], m.final_norm, s.hidden + (n * (B - 1) + p - 1) * H, H, m.eps, m.dtype);
}

void draft_append(const Drafter *mp, const Ring *rp, const Append *sp) {
  const Drafter &m = *mp;
  const Ring &ring = *rp;
  const Append &s = *sp;
  const int64_t R = s.rows, H = m.hidden, D = m.head_dim, NQ = m.heads, NKV = m.kv_heads, width = 2 * NKV * D;
  const int esize = m.dtype == F32 ? 4 : 2;
  std::vector<float> c(R * H), kv(R * width);
  gemm(s.taps, m.fc, nullptr, c.data(), R, H, m.features, m.dtype, s.threads);
  for (int64_t r = 0; r < R; r++) rms_norm(&c[r * H], m.hidden_norm, &c[r * H], H, m.eps, m.dtype);
  for (int l = 0; l < m.layers; l++) {
    const DraftLayer &L = m.layer[l];
    gemm(c.data(), static_cast<const char *>(L.qkv_w) + NQ * D * H * esize, nullptr, kv.data(), R, width, H, m.dtype,
         s.threads);
    norm_rope(m, L, kv.data(), R, width, NQ, s.cos, s.sin);  // the k heads only (v is not normed or rotated)
    for (int64_t r = 0; r < R; r++)
      for (int64_t g = 0; g < NKV; g++) {
        const int64_t at = ring_at(m, ring, l, s.slot[r], g) + s.ring_slot[r] * D;
        for (int64_t i = 0; i < D; i++) {
          store1(ring.k, at + i, kv[r * width + g * D + i], m.dtype);
          store1(ring.v, at + i, kv[r * width + (NKV + g) * D + i], m.dtype);
        }
      }
  }
}

}  // extern "C"
