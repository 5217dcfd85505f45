// TensorRT glue of the block selector: shapes, types and the call to selector::launch (kernel.cu).
#include "plugin.h"

#include "kernel.h"

#include <cstddef>

namespace beamtrt {
namespace trt {
namespace {
enum Input { kLogits, kProjected, kAnchors, kPredecessor, kSuccessor, kTemperature, kTopP, kUniforms };
enum Output { kDraftIds = 0, kCandIds, kQ };

DType toDType(DataType type) {
  return type == DataType::kHALF ? DType::kHALF : type == DataType::kBF16 ? DType::kBF16 : DType::kFLOAT;
}
}  // namespace

std::vector<Field<BlockSelectorAttributes>> const& BlockSelectorPlugin::fields() {
  static std::vector<Field<Attributes>> const table{{"top_k", PluginFieldType::kINT32, offsetof(Attributes, top_k)}};
  return table;
}

bool BlockSelectorPlugin::valid(Attributes const& a) {
  if (a.top_k >= 1 && a.top_k <= selector::kMaxK) return true;
  logError(std::string(kName) + ": top_k must be in [1, " + std::to_string(selector::kMaxK) + "]");
  return false;
}

int32_t BlockSelectorPlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const*,
                                                int32_t nbInputs) const noexcept {
  if (nbInputs != kInputs || nbOutputs != kOutputs) return -1;
  outputTypes[kDraftIds] = DataType::kINT32;
  outputTypes[kCandIds] = DataType::kINT32;
  outputTypes[kQ] = DataType::kFLOAT;
  return 0;
}

int32_t BlockSelectorPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const*, int32_t,
                                             DimsExprs* outputs, int32_t nbOutputs,
                                             IExprBuilder& exprBuilder) noexcept {
  if (nbInputs != kInputs || nbOutputs != kOutputs || inputs[kLogits].nbDims != 3) return -1;
  outputs[kDraftIds].nbDims = 2;  // [N, S]
  outputs[kDraftIds].d[0] = inputs[kLogits].d[0];
  outputs[kDraftIds].d[1] = inputs[kLogits].d[1];
  for (int32_t o : {kCandIds, kQ}) {  // [N, S, K]
    outputs[o].nbDims = 3;
    outputs[o].d[0] = inputs[kLogits].d[0];
    outputs[o].d[1] = inputs[kLogits].d[1];
    outputs[o].d[2] = exprBuilder.constant(mAttributes.top_k);
  }
  return 0;
}

bool BlockSelectorPlugin::supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t,
                                                    int32_t) noexcept {
  PluginTensorDesc const& d = inOut[pos].desc;
  switch (pos) {
    case kAnchors: return linear(d, DataType::kINT32);
    case kPredecessor:
      return linear(d, DataType::kFLOAT) || linear(d, DataType::kHALF) || linear(d, DataType::kBF16);
    case kSuccessor: return linear(d, inOut[kPredecessor].desc.type);  // both codebooks in one type
    case kLogits: return linear(d, DataType::kFLOAT) || linear(d, DataType::kHALF) || linear(d, DataType::kBF16);
    case kInputs + kDraftIds:
    case kInputs + kCandIds: return linear(d, DataType::kINT32);
    default: return linear(d, DataType::kFLOAT);  // logits, projected hidden, temperature, top-p, uniforms, q
  }
}

size_t BlockSelectorPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t,
                                             DynamicPluginTensorDesc const*, int32_t) const noexcept {
  Dims const& most = inputs[kLogits].max;
  return selector::workspaceBytes(int32_t(most.d[0]), int32_t(most.d[1]), mAttributes.top_k);
}

int32_t BlockSelectorPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const*,
                                     void const* const* inputs, void* const* outputs, void* workspace,
                                     cudaStream_t stream) noexcept {
  Dims const& logits = inputDesc[kLogits].dims;
  selector::Args args{};
  args.N = int32_t(logits.d[0]);
  args.S = int32_t(logits.d[1]);
  args.V = int32_t(logits.d[2]);
  args.K = mAttributes.top_k;
  args.R = int32_t(inputDesc[kProjected].dims.d[2]);
  args.codebookType = toDType(inputDesc[kPredecessor].type);
  args.logitsType = toDType(inputDesc[kLogits].type);
  args.logits = inputs[kLogits];
  args.projected = static_cast<float const*>(inputs[kProjected]);
  args.anchorIds = static_cast<int32_t const*>(inputs[kAnchors]);
  args.predecessor = inputs[kPredecessor];
  args.successor = inputs[kSuccessor];
  args.temperature = static_cast<float const*>(inputs[kTemperature]);
  args.topP = static_cast<float const*>(inputs[kTopP]);
  args.uniforms = static_cast<float const*>(inputs[kUniforms]);
  args.draftIds = static_cast<int32_t*>(outputs[kDraftIds]);
  args.candIds = static_cast<int32_t*>(outputs[kCandIds]);
  args.q = static_cast<float*>(outputs[kQ]);
  const cudaError_t status = selector::launch(args, workspace, stream);
  if (status != cudaSuccess) logError(std::string(kName) + ": " + cudaGetErrorString(status));
  return status == cudaSuccess ? 0 : -1;
}

}  // namespace trt
}  // namespace beamtrt
