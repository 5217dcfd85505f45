// Fused Beam forward for a few token rows on the host: the CPU fast path of the torch backend (see native/__init__.py).
//
// Every dot product is accumulated in fp32, 8 lanes over k in order, then summed lane by lane: a row's result does not
// depend on how many rows share the call, so a verified block of 8 gets bit-for-bit the logits of 8 single-token steps.
// Weights, norms, biases and the KV cache are fp32 or bf16 (the model's dtype); activations stay fp32 throughout.
#include "host_math.h"

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
  void *k_cache = static_cast<char *>(s.k_cache) + l * layer_bytes;
  void *v_cache = static_cast<char *>(s.v_cache) + l * layer_bytes;
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

int beam_step_abi() { return 2; }

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
