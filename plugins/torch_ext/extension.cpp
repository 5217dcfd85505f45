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

void check(torch::Tensor const& t, char const* name, int64_t dims) {
  TORCH_CHECK(t.is_cuda() && t.is_contiguous() && t.dim() == dims, name, ": a contiguous CUDA tensor of ", dims,
              " dims expected");
}

// logits [N, S, V] fp32 / fp16 / bf16, projected [N, S, R] fp32, anchor_ids [N] int32, codebooks [V, R],
// temperature / top_p [N] fp32, uniforms [N, S] fp32
//   -> (draft_ids [N, S] int32, cand_ids [N, S, K] int32, q [N, S, K] fp32)
std::vector<torch::Tensor> blockSelector(torch::Tensor logits, torch::Tensor projected, torch::Tensor anchorIds,
                                         torch::Tensor predecessor, torch::Tensor successor, torch::Tensor temperature,
                                         torch::Tensor topP, torch::Tensor uniforms, int64_t topK,
                                         int64_t stream) {
  check(logits, "logits", 3), check(projected, "projected", 3), check(anchorIds, "anchor_ids", 1);
  check(predecessor, "predecessor", 2), check(successor, "successor", 2), check(temperature, "temperature", 1);
  check(topP, "top_p", 1), check(uniforms, "uniforms", 2);
  TORCH_CHECK(predecessor.scalar_type() == successor.scalar_type(), "codebooks of one dtype expected");
  const int64_t N = logits.size(0), S = logits.size(1);
  auto i32 = logits.options().dtype(torch::kInt32);
  auto draft = torch::empty({N, S}, i32), cand = torch::empty({N, S, topK}, i32);
  auto q = torch::empty({N, S, topK}, projected.options());
  auto unary = torch::empty({N, S, topK}, projected.options());
  beamtrt::selector::Args args{};
  args.N = int32_t(N), args.S = int32_t(S), args.V = int32_t(logits.size(2)), args.K = int32_t(topK);
  args.R = int32_t(projected.size(2)), args.codebookType = dtypeOf(predecessor), args.logitsType = dtypeOf(logits);
  args.logits = logits.data_ptr(), args.projected = projected.data_ptr<float>();
  args.anchorIds = anchorIds.data_ptr<int32_t>(), args.predecessor = predecessor.data_ptr();
  args.successor = successor.data_ptr(), args.temperature = temperature.data_ptr<float>();
  args.topP = topP.data_ptr<float>(), args.uniforms = uniforms.data_ptr<float>();
  args.draftIds = draft.data_ptr<int32_t>(), args.candIds = cand.data_ptr<int32_t>(), args.q = q.data_ptr<float>();
  const cudaError_t status = beamtrt::selector::launch(args, unary.data_ptr(), reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(status == cudaSuccess, "block selector: ", cudaGetErrorString(status));
  return {draft, cand, q};
}

// q [N, L, Hq, D], k / v [N, L, Hkv, D], context_k / context_v [N, C, Hkv, D], start / count [N] int32,
// ring_k / ring_v [N, Hkv, W, D] (updated in place) -> out [N, L, Hq, D]
torch::Tensor windowedAttention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor contextK,
                                torch::Tensor contextV, torch::Tensor start, torch::Tensor count, torch::Tensor ringK,
                                torch::Tensor ringV, double cacheScale, double softmaxScale, bool cudaCores,
                                int64_t stream) {
  for (auto const& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&contextK, "context_k"},
                                {&contextV, "context_v"}, {&ringK, "ring_k"}, {&ringV, "ring_v"}}) {
    check(*t, name, 4);
  }
  check(start, "start", 1), check(count, "count", 1);
  auto out = torch::empty_like(q);
  beamtrt::windowed_attention::Args args{};
  args.N = int32_t(q.size(0)), args.L = int32_t(q.size(1)), args.C = int32_t(contextK.size(1));
  args.Hq = int32_t(q.size(2)), args.Hkv = int32_t(k.size(2)), args.D = int32_t(q.size(3));
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
