// TensorRT glue of the windowed drafter attention: shapes, types, ring aliasing and the call to
// windowed_attention::launch (kernel.cu).
#include "plugin.h"

#include "kernel.h"

#include <cmath>
#include <cstddef>

namespace beamtrt {
namespace trt {
namespace {
enum Input { kQ, kK, kV, kContextK, kContextV, kStart, kCount, kRingK, kRingV };
enum Output { kOut = 0, kRingKOut, kRingVOut };

DType toDType(DataType type) {
  switch (type) {
    case DataType::kHALF: return DType::kHALF;
    case DataType::kBF16: return DType::kBF16;
    case DataType::kFP8: return DType::kFP8;
    default: return DType::kFLOAT;
  }
}
}  // namespace

std::vector<Field<WindowedAttentionAttributes>> const& WindowedAttentionPlugin::fields() {
  static std::vector<Field<Attributes>> const table{
      {"window", PluginFieldType::kINT32, offsetof(Attributes, window)},
      {"kv_cache_fp8", PluginFieldType::kINT32, offsetof(Attributes, kv_cache_fp8)},
      {"kv_scale", PluginFieldType::kFLOAT32, offsetof(Attributes, kv_scale)},
      {"softmax_scale", PluginFieldType::kFLOAT32, offsetof(Attributes, softmax_scale)},
  };
  return table;
}

bool WindowedAttentionPlugin::valid(Attributes const& a) {
  const bool scaleOk = a.kv_cache_fp8 == 0 || (a.kv_scale > 0.0f && std::isfinite(a.kv_scale));
  if (a.window >= 1 && (a.kv_cache_fp8 == 0 || a.kv_cache_fp8 == 1) && scaleOk && a.softmax_scale >= 0.0f) return true;
  logError(std::string(kName) +
           ": need window >= 1, kv_cache_fp8 in {0, 1}, kv_scale > 0 with fp8, softmax_scale >= 0");
  return false;
}

int32_t WindowedAttentionPlugin::getAliasedInput(int32_t outputIndex) noexcept {
  return outputIndex == kRingKOut ? kRingK : outputIndex == kRingVOut ? kRingV : -1;  // the ring is updated in place
}

// The ring's slot count must be the window the plugin was built for (logged when not; slots < 0: not known yet).
static bool ringFits(int64_t slots, int32_t window) noexcept {
  if (slots < 0 || slots == window) return true;
  logError(std::string(WindowedAttentionPlugin::kName) + ": the ring has " + std::to_string(slots) +
           " slots, the plugin was built for " + std::to_string(window));
  return false;
}

// The ring's slot count is static in the network: a mismatch fails the build here instead of every enqueue.
int32_t WindowedAttentionPlugin::configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
                                                 DynamicPluginTensorDesc const*, int32_t) noexcept {
  if (nbInputs != kInputs) return -1;
  for (int32_t i : {kRingK, kRingV})
    if (in[i].desc.dims.nbDims == 4 && !ringFits(in[i].desc.dims.d[2], mAttributes.window)) return -1;
  return 0;
}

int32_t WindowedAttentionPlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs,
                                                    DataType const* inputTypes, int32_t nbInputs) const noexcept {
  if (nbInputs != kInputs || nbOutputs != kOutputs) return -1;
  outputTypes[kOut] = inputTypes[kQ];
  outputTypes[kRingKOut] = inputTypes[kRingK];
  outputTypes[kRingVOut] = inputTypes[kRingV];
  return 0;
}

int32_t WindowedAttentionPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const*,
                                                 int32_t, DimsExprs* outputs, int32_t nbOutputs,
                                                 IExprBuilder&) noexcept {
  if (nbInputs != kInputs || nbOutputs != kOutputs || inputs[kQ].nbDims != 4 || inputs[kRingK].nbDims != 4) return -1;
  outputs[kOut] = inputs[kQ];           // [N, L, Hq, D]
  outputs[kRingKOut] = inputs[kRingK];  // [N, Hkv, W, D]
  outputs[kRingVOut] = inputs[kRingV];
  return 0;
}

bool WindowedAttentionPlugin::supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t,
                                                        int32_t) noexcept {
  PluginTensorDesc const& d = inOut[pos].desc;
  const DataType io = inOut[kQ].desc.type;
  const DataType ring = mAttributes.kv_cache_fp8 ? DataType::kFP8 : io;
  switch (pos) {
    case kQ: return linear(d, DataType::kHALF) || linear(d, DataType::kBF16);
    case kStart:
    case kCount: return linear(d, DataType::kINT32);
    case kRingK:
    case kRingV:
    case kInputs + kRingKOut:
    case kInputs + kRingVOut: return linear(d, ring);
    default: return linear(d, io);  // k, v, context K / V, the output
  }
}

int32_t WindowedAttentionPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const*,
                                         void const* const* inputs, void* const* outputs, void*,
                                         cudaStream_t stream) noexcept {
  Dims const &q = inputDesc[kQ].dims, &k = inputDesc[kK].dims, &ctx = inputDesc[kContextK].dims,
             &ring = inputDesc[kRingK].dims;
  windowed_attention::Args args{};
  args.N = int32_t(q.d[0]);
  args.L = int32_t(q.d[1]);
  args.Hq = int32_t(q.d[2]);
  args.D = int32_t(q.d[3]);
  args.Hkv = int32_t(k.d[2]);
  args.C = int32_t(ctx.d[1]);
  args.W = int32_t(ring.d[2]);
  if (!ringFits(args.W, mAttributes.window)) return -1;
  args.ioType = toDType(inputDesc[kQ].type);
  args.cacheType = toDType(inputDesc[kRingK].type);
  args.cacheScale = mAttributes.kv_cache_fp8 ? mAttributes.kv_scale : 1.0f;
  args.softmaxScale = mAttributes.softmax_scale > 0.0f ? mAttributes.softmax_scale : 1.0f / std::sqrt(float(args.D));
  args.q = inputs[kQ];
  args.k = inputs[kK];
  args.v = inputs[kV];
  args.contextK = inputs[kContextK];
  args.contextV = inputs[kContextV];
  args.start = static_cast<int32_t const*>(inputs[kStart]);
  args.count = static_cast<int32_t const*>(inputs[kCount]);
  args.ringK = outputs[kRingKOut];  // aliases inputs[kRingK]
  args.ringV = outputs[kRingVOut];
  args.out = outputs[kOut];
  const cudaError_t status = windowed_attention::launch(args, stream);
  if (status != cudaSuccess) logError(std::string(kName) + ": " + cudaGetErrorString(status));
  return status == cudaSuccess ? 0 : -1;
}

}  // namespace trt
}  // namespace beamtrt
