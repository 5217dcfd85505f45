// DFlash2 block selector, kernel math for host and device: top-K candidates per draft slot, the pairwise edge
// scores S_t(a, b) = U_t(b) + sum_r A[a, r] g_t[r] B[b, r], and the local walk (greedy or sampled) through them.
// The reference is beamtrt.spec.selector + CandidateSelector.edge_scores (src/beamtrt/); see README.md.
#pragma once

#include "../common/numeric.cuh"

namespace beamtrt {
namespace selector {

constexpr int32_t kMaxK = 64;       // candidates per slot
constexpr int32_t kMaxSlots = 31;   // draft slots per block (block size <= 32)

// One call: N requests, S = block - 1 draft slots, V vocabulary, K candidates, R selector rank.
struct Args {
  int32_t N, S, V, K, R;
  DType codebookType;               // kFLOAT, kHALF or kBF16
  DType logitsType;                 // kFLOAT, kHALF or kBF16 (half-width logits halve the selector's reads)
  void const* logits;               // [N, S, V] drafter logits of the draft slots (target logit transform applied)
  float const* projected;           // [N, S, R] g_t = W_h h_t
  int32_t const* anchorIds;         // [N] the token before slot 0
  void const* predecessor;          // [V, R] codebook A
  void const* successor;            // [V, R] codebook B
  float const* temperature;         // [N] 0 = greedy walk
  float const* topP;                // [N] in (0, 1]
  float const* uniforms;            // [N, S] in [0, 1), one per slot (sampled walk)
  int32_t* draftIds;                // [N, S] out
  int32_t* candIds;                 // [N, S, K] out, each slot's top-K in descending logit order
  float* q;                         // [N, S, K] out, the exact row each draft was drawn from (greedy: the row's
                                    // temperature-1 softmax, whose max is the walk's confidence in its argmax)
};

// Keep the K best (value desc, index asc on ties) of the values offered so far, sorted.
struct TopK {
  float value[kMaxK];
  int32_t index[kMaxK];
  int32_t size = 0;

  BEAMTRT_HD static bool better(float v, int32_t i, float w, int32_t j) { return v > w || (v == w && i < j); }

  BEAMTRT_HD void offer(float v, int32_t i, int32_t k) {
    if (size == k && !better(v, i, value[k - 1], index[k - 1])) return;
    int32_t at = size < k ? size++ : k - 1;
    while (at > 0 && better(v, i, value[at - 1], index[at - 1])) {
      value[at] = value[at - 1];
      index[at] = index[at - 1];
      at--;
    }
    value[at] = v;
    index[at] = i;
  }
};

// Edge score of predecessor token `a` and candidate `b` at a slot with projected hidden g and unary score u.
BEAMTRT_HD float edgeScore(Args const& x, float u, float const* g, int32_t a, int32_t b) {
  float edge = 0.0f;
  for (int32_t r = 0; r < x.R; r++) {
    edge = addProduct(edge, load(x.predecessor, int64_t(a) * x.R + r, x.codebookType) * g[r],
                      load(x.successor, int64_t(b) * x.R + r, x.codebookType));
  }
  return u + edge;
}

// softmax(row / temperature), then top-p over the K candidates (smallest prefix by decreasing q reaching top_p,
// stable order), renormalized: spec.selector.draft_probs.
BEAMTRT_HD void draftProbs(float const* row, int32_t K, float temperature, float topP, float* q) {
  float mx = row[0] / temperature;
  for (int32_t j = 1; j < K; j++) mx = fmaxf(mx, row[j] / temperature);
  float z = 0.0f;
  for (int32_t j = 0; j < K; j++) {
    q[j] = expf(row[j] / temperature - mx);
    z += q[j];
  }
  for (int32_t j = 0; j < K; j++) q[j] /= z;
  if (topP >= 1.0f) return;
  int32_t order[kMaxK];
  for (int32_t j = 0; j < K; j++) {  // stable insertion sort by decreasing q
    int32_t at = j;
    while (at > 0 && q[order[at - 1]] < q[j]) {
      order[at] = order[at - 1];
      at--;
    }
    order[at] = j;
  }
  float before = 0.0f, kept = 0.0f;
  for (int32_t i = 0; i < K; i++) {
    const float p = q[order[i]];
    if (before >= topP) q[order[i]] = 0.0f;  // the mass strictly before it already reaches top_p
    before += p;
    kept += q[order[i]];
  }
  for (int32_t j = 0; j < K; j++) q[j] /= kept;
}

// Inverse-CDF draw from q (need not be normalized): never an index of probability 0 (spec.sampling.sample_from),
// unless no entry is positive.
BEAMTRT_HD int32_t sampleFrom(float const* q, int32_t K, float u) {
  float cdf[kMaxK];
  float run = 0.0f;
  int32_t last = -1;
  for (int32_t j = 0; j < K; j++) {
    run += q[j];
    cdf[j] = run;
    if (q[j] > 0.0f) last = j;
  }
  const float target = u * cdf[K - 1];
  int32_t pick = K;
  for (int32_t j = 0; j < K; j++) {
    if (cdf[j] > target) {
      pick = j;
      break;
    }
  }
  return pick < last ? pick : (last < 0 ? 0 : last);  // no positive entry (a NaN row): 0, never an index outside q
}

// The token before slot t when slot t-1 took its candidate p (t = 0: the anchor).
BEAMTRT_HD int32_t predecessorId(Args const& x, int32_t n, int32_t t, int32_t p) {
  return t == 0 ? x.anchorIds[n] : x.candIds[(int64_t(n) * x.S + t - 1) * x.K + p];
}

// Slot t's choice from its edge scores `row` (K) after one predecessor: the draw with uniform u from
// q = draftProbs(row, temperature, top_p), or at temperature 0 the argmax (first on ties), q then the row's
// temperature-1 softmax. Writes q, returns the chosen candidate's index.
BEAMTRT_HD int32_t choose(float const* row, int32_t K, float temperature, float topP, float u, float* q) {
  if (temperature > 0.0f) {
    draftProbs(row, K, temperature, topP, q);
    return sampleFrom(q, K, u);
  }
  int32_t pick = 0;
  for (int32_t j = 1; j < K; j++) pick = row[j] > row[pick] ? j : pick;
  draftProbs(row, K, 1.0f, 1.0f, q);
  return pick;
}

// The walk of request n, once each slot has chosen after every predecessor it can have: choice[t * K + p] and its
// q row at qRows + (t * K + p) * K, for slot t after slot t-1's candidate p (t = 0: p = 0, the anchor), each as
// choose() gives it from edgeScore's row. Follows the choices from the anchor; writes the drafts and their q rows.
BEAMTRT_HD void follow(Args const& x, int32_t n, int32_t const* choice, float const* qRows) {
  const int32_t S = x.S, K = x.K;
  int32_t p = 0;
  for (int32_t t = 0; t < S; t++) {
    const int32_t pick = choice[t * K + p];
    const int64_t at = (int64_t(n) * S + t) * K;
    for (int32_t j = 0; j < K; j++) x.q[at + j] = qRows[(int64_t(t) * K + p) * K + j];
    x.draftIds[int64_t(n) * S + t] = x.candIds[at + pick];
    p = pick;
  }
}

}  // namespace selector
}  // namespace beamtrt
