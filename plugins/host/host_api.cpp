// The plugins' kernel math compiled for the host: a C ABI over the same headers the CUDA kernels use, so the tests
// check on CPU (tests/test_plugins.py, through ctypes) what the GPU runs.
#include "../block_selector/kernel.cuh"
#include "../windowed_attention/kernel.cuh"

#include <vector>

using namespace beamtrt;

extern "C" {

int32_t beamtrt_host_abi() { return 1; }

// Per request: its slots' top-K by a scan of the vocabulary, each slot's choice after every possible predecessor
// (as the CUDA build makes them), then the walk that follows them.
void beamtrt_block_selector_host(selector::Args const* args) {
  selector::Args const& x = *args;
  const int32_t S = x.S, K = x.K;
  std::vector<float> unary(size_t(S) * K), row(K), qRows(size_t(S) * K * K);
  std::vector<int32_t> choice(size_t(S) * K);
  for (int32_t n = 0; n < x.N; n++) {
    int32_t* cand = x.candIds + int64_t(n) * S * K;
    for (int32_t t = 0; t < S; t++) {
      selector::TopK top;
      const int64_t at = (int64_t(n) * S + t) * x.V;
      for (int32_t v = 0; v < x.V; v++) top.offer(load(x.logits, at + v, x.logitsType), v, K);
      for (int32_t j = 0; j < K; j++) {
        cand[t * K + j] = top.index[j];
        unary[size_t(t) * K + j] = top.value[j];
      }
    }
    for (int32_t t = 0; t < S; t++) {
      for (int32_t p = 0; p < (t == 0 ? 1 : K); p++) {
        const int32_t a = selector::predecessorId(x, n, t, p);
        for (int32_t j = 0; j < K; j++) {
          row[j] = selector::edgeScore(x, unary[size_t(t) * K + j], x.projected + (int64_t(n) * S + t) * x.R, a,
                                       cand[t * K + j]);
        }
        choice[size_t(t) * K + p] = selector::choose(row.data(), K, x.temperature[n], x.topP[n],
                                                     x.uniforms[int64_t(n) * S + t], &qRows[(size_t(t) * K + p) * K]);
      }
    }
    selector::follow(x, n, choice.data(), qRows.data());
  }
}

// The append for every element, then every output row.
void beamtrt_windowed_attention_host(windowed_attention::Args const* args) {
  windowed_attention::Args const& x = *args;
  for (int32_t n = 0; n < x.N; n++)
    for (int32_t c = 0; c < x.C; c++)
      for (int32_t h = 0; h < x.Hkv; h++)
        for (int32_t d = 0; d < x.D; d++) windowed_attention::appendElement(x, n, c, h, d);
  for (int32_t n = 0; n < x.N; n++)
    for (int32_t l = 0; l < x.L; l++)
      for (int32_t hq = 0; hq < x.Hq; hq++) windowed_attention::attendRow(x, n, l, hq);
}

// Element conversions, for the tests of numeric.cuh: n values of `from` -> `to` through fp32 (fp8 scale 1).
void beamtrt_convert_host(void const* src, int32_t from, void* dst, int32_t to, int64_t n) {
  for (int64_t i = 0; i < n; i++) store(dst, i, load(src, i, DType(from)), DType(to));
}

}  // extern "C"
