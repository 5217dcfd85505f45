// TensorRT glue of the windowed drafter attention (IPluginV3; the ring outputs alias the ring inputs): README.md.
#pragma once

#include "../common/plugin_base.h"

namespace beamtrt {
namespace trt {

struct WindowedAttentionAttributes {
  int32_t window;         // W ring slots per sequence and KV head
  int32_t kv_cache_fp8;   // 1: the ring holds E4M3 values divided by kv_scale
  float kv_scale;         // fp8 ring scale (ignored otherwise)
  float softmax_scale;    // 0: 1 / sqrt(head_dim)
};

class WindowedAttentionPlugin : public PluginBase<WindowedAttentionPlugin, WindowedAttentionAttributes> {
 public:
  using Attributes = WindowedAttentionAttributes;
  static constexpr char const* kName = "BeamtrtWindowedAttention";
  static constexpr int32_t kInputs = 9;
  static constexpr int32_t kOutputs = 3;

  using PluginBase::PluginBase;
  static std::vector<Field<Attributes>> const& fields();
  static bool valid(Attributes const& attributes);

  int32_t getAliasedInput(int32_t outputIndex) noexcept override;
  int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* out,
                          int32_t nbOutputs) noexcept override;
  int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                             int32_t nbInputs) const noexcept override;
  int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* shapeInputs,
                          int32_t nbShapeInputs, DimsExprs* outputs, int32_t nbOutputs,
                          IExprBuilder& exprBuilder) noexcept override;
  bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override;
  int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc, void const* const* inputs,
                  void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
};

}  // namespace trt
}  // namespace beamtrt
