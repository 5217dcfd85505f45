// The CUDA kernels as a PyTorch extension (beamtrt.native.cuda builds it with torch.utils.cpp_extension): the same
// launchers the TensorRT plugins call, on torch tensors. The caller passes torch's current CUDA stream as an integer
// (torch.cuda.current_stream().cuda_stream), which keeps this file free of torch's CUDA headers.
#include <torch/extension.h>

#include "../block_selector/kernel.h"
#include "../windowed_attention/kernel.h"

namespace {

beamtrt::DType dtypeOf(torch::Tensor const& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return beamtrt::DType::kFLOAT;
    case torch::kFloat16: return beamtrt::DType::kHALF;
    case torch::kBFloat16: return beamtrt::DType::kBF16;
    case torch::kFloat8_e4m3fn: return beamtrt::DType::kFP8;
    default: TORCH_CHECK(false, "unsupported dtype ", t.scalar_type());
  }
}

// t's shape must be `shape` (-1: any size there) and t contiguous; the shapes are checked before the device, so a host
// build of this file (tests/test_plugins.py) exercises them.
void checkShape(torch::Tensor const& t, char const* name, std::vector<int64_t> const& shape) {
  bool same = t.dim() == int64_t(shape.size());
  for (size_t i = 0; same && i < shape.size(); ++i) same = shape[i] < 0 || t.size(int64_t(i)) == shape[i];
  TORCH_CHECK(same && t.is_contiguous(), name, ": a contiguous tensor of shape ", c10::IntArrayRef(shape),
              " expected (-1: any), got ", t.sizes());
}

void checkDtype(torch::Tensor const& t, char const* name, std::initializer_list<torch::ScalarType> dtypes) {
  bool found = false;
  std::string names;
  for (auto dtype : dtypes) {
    found = found || t.scalar_type() == dtype;
    names += (names.empty() ? "" : " or ") + std::string(c10::toString(dtype));
  }
  TORCH_CHECK(found, name, ": ", names, " expected, got ", t.scalar_type());
}

void checkCuda(std::initializer_list<torch::Tensor const*> tensors) {
  for (auto const* t : tensors) {
    TORCH_CHECK(t->is_cuda(), "CUDA tensors expected, got one on ", t->device());
    TORCH_CHECK(t->device() == (*tensors.begin())->device(), "tensors on one device expected, got ",
                (*tensors.begin())->device(), " and ", t->device());
  }
}

// logits [N, S, V] fp32 / fp16 / bf16, projected [N, S, R] fp32, anchor_ids [N] int32, codebooks [V, R],
// temperature / top_p [N] fp32, uniforms [N, S] fp32
//   -> (draft_ids [N, S] int32, cand_ids [N, S, K] int32, q [N, S, K] fp32)
std::vector<torch::Tensor> blockSelector(torch::Tensor logits, torch::Tensor projected, torch::Tensor anchorIds,
                                         torch::Tensor predecessor, torch::Tensor successor, torch::Tensor temperature,
                                         torch::Tensor topP, torch::Tensor uniforms, int64_t topK,
                                         int64_t stream) {
  checkShape(logits, "logits", {-1, -1, -1});
  const int64_t N = logits.size(0), S = logits.size(1), V = logits.size(2);
  checkShape(projected, "projected", {N, S, -1});
  const int64_t R = projected.size(2);
  checkShape(anchorIds, "anchor_ids", {N}), checkShape(predecessor, "predecessor", {V, R});
  checkShape(successor, "successor", {V, R}), checkShape(temperature, "temperature", {N});
  checkShape(topP, "top_p", {N}), checkShape(uniforms, "uniforms", {N, S});
  checkDtype(logits, "logits", {torch::kFloat32, torch::kFloat16, torch::kBFloat16});
  checkDtype(predecessor, "predecessor", {torch::kFloat32, torch::kFloat16, torch::kBFloat16});
  checkDtype(successor, "successor", {predecessor.scalar_type()}), checkDtype(anchorIds, "anchor_ids", {torch::kInt32});
  for (auto const& [t, name] : {std::pair{&projected, "projected"}, {&temperature, "temperature"}, {&topP, "top_p"},
                                {&uniforms, "uniforms"}}) {
    checkDtype(*t, name, {torch::kFloat32});
  }
  using beamtrt::selector::kMaxK, beamtrt::selector::kMaxSlots;
  TORCH_CHECK(topK >= 1 && topK <= std::min<int64_t>(V, kMaxK), "top_k: 1 to min(V, ", kMaxK, ") expected, got ", topK);
  TORCH_CHECK(S >= 1 && S <= kMaxSlots, "logits: 1 to ", kMaxSlots, " draft slots expected, got ", S);
  checkCuda({&logits, &projected, &anchorIds, &predecessor, &successor, &temperature, &topP, &uniforms});
  auto i32 = logits.options().dtype(torch::kInt32);
  auto draft = torch::empty({N, S}, i32), cand = torch::empty({N, S, topK}, i32);
  auto q = torch::empty({N, S, topK}, projected.options());
  auto workspace = torch::empty({int64_t(beamtrt::selector::workspaceBytes(int32_t(N), int32_t(S), int32_t(topK)))},
                                logits.options().dtype(torch::kUInt8));
  beamtrt::selector::Args args{};
  args.N = int32_t(N), args.S = int32_t(S), args.V = int32_t(V), args.K = int32_t(topK);
  args.R = int32_t(R), args.codebookType = dtypeOf(predecessor), args.logitsType = dtypeOf(logits);
  args.logits = logits.data_ptr(), args.projected = projected.data_ptr<float>();
  args.anchorIds = anchorIds.data_ptr<int32_t>(), args.predecessor = predecessor.data_ptr();
  args.successor = successor.data_ptr(), args.temperature = temperature.data_ptr<float>();
  args.topP = topP.data_ptr<float>(), args.uniforms = uniforms.data_ptr<float>();
  args.draftIds = draft.data_ptr<int32_t>(), args.candIds = cand.data_ptr<int32_t>(), args.q = q.data_ptr<float>();
  const cudaError_t status = beamtrt::selector::launch(args, workspace.data_ptr(),
                                                         reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(status == cudaSuccess, "block selector: ", cudaGetErrorString(status));
  return {draft, cand, q};
}

// q [N, L, Hq, D], k / v [N, L, Hkv, D], context_k / context_v [N, C, Hkv, D], start / count [N] int32,
// ring_k / ring_v [N, Hkv, W, D] (updated in place) -> out [N, L, Hq, D]
torch::Tensor windowedAttention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor contextK,
                                torch::Tensor contextV, torch::Tensor start, torch::Tensor count, torch::Tensor ringK,
                                torch::Tensor ringV, double cacheScale, double softmaxScale, bool cudaCores,
                                int64_t stream) {
  checkShape(q, "q", {-1, -1, -1, -1}), checkShape(k, "k", {q.size(0), q.size(1), -1, q.size(3)});
  const int64_t N = q.size(0), L = q.size(1), Hkv = k.size(2), D = q.size(3);
  checkShape(v, "v", {N, L, Hkv, D}), checkShape(contextK, "context_k", {N, -1, Hkv, D});
  checkShape(contextV, "context_v", {N, contextK.size(1), Hkv, D}), checkShape(start, "start", {N});
  checkShape(count, "count", {N}), checkShape(ringK, "ring_k", {N, Hkv, -1, D});
  checkShape(ringV, "ring_v", {N, Hkv, ringK.size(2), D});
  checkDtype(q, "q", {torch::kBFloat16, torch::kFloat16, torch::kFloat32});
  for (auto const& [t, name] : {std::pair{&k, "k"}, {&v, "v"}, {&contextK, "context_k"}, {&contextV, "context_v"}}) {
    checkDtype(*t, name, {q.scalar_type()});
  }
  checkDtype(start, "start", {torch::kInt32}), checkDtype(count, "count", {torch::kInt32});
  checkDtype(ringK, "ring_k", {q.scalar_type(), torch::kFloat8_e4m3fn});
  checkDtype(ringV, "ring_v", {ringK.scalar_type()});
  using beamtrt::windowed_attention::kMaxHeadDim;
  TORCH_CHECK(D >= 1 && D <= kMaxHeadDim, "q: a head dim of 1 to ", kMaxHeadDim, " expected, got ", D);
  TORCH_CHECK(Hkv >= 1 && q.size(2) % Hkv == 0, "q: a multiple of k's ", Hkv, " heads expected, got ", q.size(2));
  TORCH_CHECK(ringK.size(2) >= 1, "ring_k: a window of at least 1 slot expected");
  checkCuda({&q, &k, &v, &contextK, &contextV, &start, &count, &ringK, &ringV});
  auto out = torch::empty_like(q);
  beamtrt::windowed_attention::Args args{};
  args.N = int32_t(N), args.L = int32_t(L), args.C = int32_t(contextK.size(1));
  args.Hq = int32_t(q.size(2)), args.Hkv = int32_t(Hkv), args.D = int32_t(D);
  args.W = int32_t(ringK.size(2)), args.ioType = dtypeOf(q), args.cacheType = dtypeOf(ringK);
  args.cacheScale = float(cacheScale), args.softmaxScale = float(softmaxScale);
  args.q = q.data_ptr(), args.k = k.data_ptr(), args.v = v.data_ptr(), args.contextK = contextK.data_ptr();
  args.contextV = contextV.data_ptr(), args.start = start.data_ptr<int32_t>(), args.count = count.data_ptr<int32_t>();
  args.ringK = ringK.data_ptr(), args.ringV = ringV.data_ptr(), args.out = out.data_ptr();
  using beamtrt::windowed_attention::Kernel;
  const cudaError_t status = beamtrt::windowed_attention::launch(args, reinterpret_cast<cudaStream_t>(stream),
                                                                 cudaCores ? Kernel::kCudaCores : Kernel::kAuto);
  TORCH_CHECK(status == cudaSuccess, "windowed attention: ", cudaGetErrorString(status));
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_selector", &blockSelector, "DFlash2 block selector (plugins/block_selector)");
  m.def("windowed_attention", &windowedAttention, "DFlash2 windowed drafter attention (plugins/windowed_attention)");
}
