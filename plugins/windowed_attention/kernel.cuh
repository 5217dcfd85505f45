// DFlash2 drafter attention, kernel math for host and device: new context K/V go into a per-sequence ring of W slots
// (position p -> slot p mod W); the block's queries attend over the visible ring slots plus the block's own K/V
// (bidirectional), GQA, fp32 accumulation. The reference is DraftCache.append_context and DraftAttention
// (src/beamtrt/models/dflash2.py); see README.md.
#pragma once

#include "../common/numeric.cuh"

namespace beamtrt {
namespace windowed_attention {

constexpr int32_t kMaxHeadDim = 256;

// One call: N sequences, L block rows, C new context rows (at most), Hq / Hkv heads of size D, window W.
struct Args {
  int32_t N, L, C, Hq, Hkv, D, W;
  DType ioType;                // q, k, v, context K/V and the output: kHALF or kBF16 (kFLOAT on the host)
  DType cacheType;             // the ring: ioType, or kFP8 (E4M3, values stored divided by cacheScale)
  float cacheScale;            // fp8 ring scale (1 otherwise)
  float softmaxScale;          // usually 1 / sqrt(D)
  void const* q;               // [N, L, Hq, D] block queries, normed and rotated
  void const* k;               // [N, L, Hkv, D] block keys, normed and rotated
  void const* v;               // [N, L, Hkv, D]
  void const* contextK;        // [N, C, Hkv, D] new context keys (rotated), rows 0..count-1 valid
  void const* contextV;        // [N, C, Hkv, D]
  int32_t const* start;        // [N] context positions already in the ring (the first new row's position)
  int32_t const* count;        // [N] new context rows, 0..C
  void* ringK;                 // [N, Hkv, W, D] in/out
  void* ringV;                 // [N, Hkv, W, D] in/out
  void* out;                   // [N, L, Hq, D]
};

// Append element d of new context row c, KV head h, of sequence n (only the last W of a long append are kept,
// as each lands in a distinct slot).
BEAMTRT_HD void appendElement(Args const& x, int32_t n, int32_t c, int32_t h, int32_t d) {
  const int64_t end = int64_t(x.start[n]) + x.count[n], p = int64_t(x.start[n]) + c;
  if (c >= x.count[n] || p < end - x.W) return;
  const int64_t src = ((int64_t(n) * x.C + c) * x.Hkv + h) * x.D + d;
  const int64_t dst = ((int64_t(n) * x.Hkv + h) * x.W + p % x.W) * x.D + d;
  store(x.ringK, dst, load(x.contextK, src, x.ioType), x.cacheType, x.cacheScale);
  store(x.ringV, dst, load(x.contextV, src, x.ioType), x.cacheType, x.cacheScale);
}

// Keys a block of sequence n sees in the ring after the append: slots [0, min(start + count, W)).
BEAMTRT_HD int32_t visibleSlots(Args const& x, int32_t n) {
  const int64_t len = int64_t(x.start[n]) + x.count[n];
  return len < x.W ? int32_t(len) : x.W;
}

// Element d of key j (and its value) of (sequence n, KV head h): the visible ring slots first, then the block's
// L rows.
BEAMTRT_HD void keyValueAt(Args const& x, int32_t n, int32_t h, int32_t j, int32_t visible, int32_t d, float& key,
                           float& value) {
  if (j < visible) {
    const int64_t at = ((int64_t(n) * x.Hkv + h) * x.W + j) * x.D + d;
    key = load(x.ringK, at, x.cacheType, x.cacheScale);
    value = load(x.ringV, at, x.cacheType, x.cacheScale);
  } else {
    const int64_t at = ((int64_t(n) * x.L + (j - visible)) * x.Hkv + h) * x.D + d;
    key = load(x.k, at, x.ioType);
    value = load(x.v, at, x.ioType);
  }
}

// Key j of (sequence n, KV head h) whole: writes D floats each.
BEAMTRT_HD void keyValue(Args const& x, int32_t n, int32_t h, int32_t j, int32_t visible, float* key, float* value) {
  for (int32_t d = 0; d < x.D; d++) keyValueAt(x, n, h, j, visible, d, key[d], value[d]);
}

// Output row (sequence n, block row l, query head hq): an online softmax over the visible keys in order.
BEAMTRT_HD void attendRow(Args const& x, int32_t n, int32_t l, int32_t hq) {
  const int32_t h = hq / (x.Hq / x.Hkv), visible = visibleSlots(x, n);
  const int64_t qAt = ((int64_t(n) * x.L + l) * x.Hq + hq) * x.D;
  float q[kMaxHeadDim], acc[kMaxHeadDim], key[kMaxHeadDim], value[kMaxHeadDim];
  for (int32_t d = 0; d < x.D; d++) {
    q[d] = load(x.q, qAt + d, x.ioType);
    acc[d] = 0.0f;
  }
  float mx = -INFINITY, z = 0.0f;
  for (int32_t j = 0; j < visible + x.L; j++) {
    keyValue(x, n, h, j, visible, key, value);
    float s = 0.0f;
    for (int32_t d = 0; d < x.D; d++) s += q[d] * key[d];
    s *= x.softmaxScale;
    const float grown = fmaxf(mx, s), rescale = expf(mx - grown), p = expf(s - grown);
    for (int32_t d = 0; d < x.D; d++) acc[d] = acc[d] * rescale + p * value[d];
    z = z * rescale + p;
    mx = grown;
  }
  for (int32_t d = 0; d < x.D; d++) store(x.out, qAt + d, acc[d] / z, x.ioType);
}

}  // namespace windowed_attention
}  // namespace beamtrt
