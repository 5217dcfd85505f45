// TensorRT glue of the block selector (IPluginV3): tensors and attributes in README.md.
#pragma once

#include "../common/plugin_base.h"

namespace beamtrt {
namespace trt {

struct BlockSelectorAttributes {
  int32_t top_k;  // K candidates per draft slot
};

class BlockSelectorPlugin : public PluginBase<BlockSelectorPlugin, BlockSelectorAttributes> {
 public:
  using Attributes = BlockSelectorAttributes;
  static constexpr char const* kName = "BeamtrtBlockSelector";
  static constexpr int32_t kInputs = 8;
  static constexpr int32_t kOutputs = 3;

  using PluginBase::PluginBase;
  static std::vector<Field<Attributes>> const& fields();
  static bool valid(Attributes const& attributes);

  int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                             int32_t nbInputs) const noexcept override;
  int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* shapeInputs,
                          int32_t nbShapeInputs, DimsExprs* outputs, int32_t nbOutputs,
                          IExprBuilder& exprBuilder) noexcept override;
  bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override;
  size_t getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                          DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;
  int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc, void const* const* inputs,
                  void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
};

}  // namespace trt
}  // namespace beamtrt
