// block_selector/kernel.cu on host threads (emulation/cuda_runtime.h) under a sanitizer, on random inputs held in
// exactly sized buffers: built with -fsanitize=thread, a shared-memory access without the barrier that orders it is a
// data race; with -fsanitize=address,undefined, any read or write past a buffer (inputs, workspace, shared arrays)
// stops it. tests/test_plugins.py builds and runs it both ways; it prints nothing and exits 0 when clean.
#include "selector_emulated.cpp"

#include <random>

namespace {

struct Case {
  int32_t N, S, V, K, R;
  beamtrt::DType logits, codebook;
};

int32_t run(Case const& c, std::mt19937& rng) {
  using beamtrt::store, beamtrt::elementSize;
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  const size_t cells = size_t(c.N) * c.S * c.V, rows = size_t(c.V) * c.R, slots = size_t(c.N) * c.S;
  std::vector<uint8_t> logits(cells * elementSize(c.logits));
  std::vector<uint8_t> a(rows * elementSize(c.codebook)), b(rows * elementSize(c.codebook));
  for (size_t i = 0; i < cells; i++) store(logits.data(), int64_t(i), 3 * normal(rng), c.logits);
  for (size_t i = 0; i < rows; i++) {
    store(a.data(), int64_t(i), normal(rng), c.codebook);
    store(b.data(), int64_t(i), normal(rng), c.codebook);
  }
  std::vector<float> projected(slots * c.R), temperature(c.N), topP(c.N), uniforms(slots), q(slots * c.K);
  for (float& v : projected) v = normal(rng);
  for (float& v : uniforms) v = uniform(rng);
  std::vector<int32_t> anchors(c.N), drafts(slots), cands(slots * c.K);
  for (int32_t n = 0; n < c.N; n++) {
    temperature[n] = n == 0 ? 0.0f : 0.8f;  // one greedy request, the others sampled, one with a tight top-p
    topP[n] = n == c.N - 1 ? 0.5f : 0.95f;
    anchors[n] = (n * 977 + 5) % c.V;
  }
  beamtrt::selector::Args x{};
  x.N = c.N, x.S = c.S, x.V = c.V, x.K = c.K, x.R = c.R, x.codebookType = c.codebook, x.logitsType = c.logits;
  x.logits = logits.data(), x.projected = projected.data(), x.anchorIds = anchors.data();
  x.predecessor = a.data(), x.successor = b.data(), x.temperature = temperature.data(), x.topP = topP.data();
  x.uniforms = uniforms.data(), x.draftIds = drafts.data(), x.candIds = cands.data(), x.q = q.data();
  return beamtrt_block_selector_emulated(&x);
}

}  // namespace

int main() {
  std::mt19937 rng(1);
  const Case cases[] = {
      {2, 2, 4500, 16, 300, beamtrt::DType::kFLOAT, beamtrt::DType::kBF16},  // 3 chunks, 2 rank tiles, aligned rows
      {2, 2, 2001, 64, 100, beamtrt::DType::kBF16, beamtrt::DType::kFLOAT},  // K 64, unaligned rows
#ifndef __SANITIZE_THREAD__  // 2 load batches, the warp floor raised between them: bounds checked; the raise uses no
      // shared memory (warp shuffles only), and under ThreadSanitizer this case alone took ~50 s
      {1, 1, 40001, 64, 8, beamtrt::DType::kFLOAT, beamtrt::DType::kFLOAT},
#endif
  };
  for (Case const& c : cases) {
    if (run(c, rng) != 0) return 1;
  }
  return 0;
}
