// What every beamtrt TensorRT plugin shares (IPluginV3 with OneCore / OneBuildV2 / OneRuntime, and its creator):
// a plugin declares its name, output count and attribute table; the rest is here, once.
#pragma once

#include <NvInferRuntime.h>

#include <cstring>
#include <string>
#include <vector>

namespace beamtrt {
namespace trt {

using namespace nvinfer1;

constexpr char const* kNamespace = "beamtrt";
constexpr char const* kVersion = "1";

void logError(std::string const& message) noexcept;  // through the ILoggerFinder TensorRT gave us (registry.cpp)

// One plugin attribute: a scalar int32 or float32 field, stored in the plugin's Attributes struct.
template <typename Attributes>
struct Field {
  char const* name;
  PluginFieldType type;  // kINT32 or kFLOAT32
  size_t offset;         // offsetof(Attributes, member)
};

// Plugin: `static constexpr char const* kName`, `static constexpr int32_t kOutputs`, `using Attributes = ...`,
// `static std::vector<Field<Attributes>> const& fields()`, `bool valid(Attributes const&)`, and the
// OneBuild / OneRuntime methods that depend on its tensors.
template <typename Plugin, typename Attributes>
class PluginBase : public IPluginV3, public IPluginV3OneCore, public IPluginV3OneBuildV2, public IPluginV3OneRuntime {
 public:
  explicit PluginBase(Attributes const& attributes) : mAttributes(attributes) {}

  IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override {
    switch (type) {
      case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
      case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuildV2*>(this);
      case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
  }

  IPluginV3* clone() noexcept override {
    try {
      return new Plugin(mAttributes);
    } catch (...) {
      return nullptr;
    }
  }

  AsciiChar const* getPluginName() const noexcept override { return Plugin::kName; }
  AsciiChar const* getPluginVersion() const noexcept override { return kVersion; }
  AsciiChar const* getPluginNamespace() const noexcept override { return kNamespace; }
  int32_t getNbOutputs() const noexcept override { return Plugin::kOutputs; }

  int32_t configurePlugin(DynamicPluginTensorDesc const*, int32_t, DynamicPluginTensorDesc const*,
                          int32_t) noexcept override {
    return 0;
  }
  int32_t onShapeChange(PluginTensorDesc const*, int32_t, PluginTensorDesc const*, int32_t) noexcept override {
    return 0;
  }
  IPluginV3* attachToContext(IPluginResourceContext*) noexcept override { return clone(); }

  PluginFieldCollection const* getFieldsToSerialize() noexcept override {
    mSerialized.clear();
    for (auto const& f : Plugin::fields()) {
      mSerialized.emplace_back(f.name, reinterpret_cast<char const*>(&mAttributes) + f.offset, f.type, 1);
    }
    mCollection.nbFields = static_cast<int32_t>(mSerialized.size());
    mCollection.fields = mSerialized.data();
    return &mCollection;
  }

 protected:
  Attributes mAttributes;

 private:
  std::vector<PluginField> mSerialized;
  PluginFieldCollection mCollection{};
};

template <typename Plugin>
class Creator : public IPluginCreatorV3One {
 public:
  using Attributes = typename Plugin::Attributes;

  Creator() {
    for (auto const& f : Plugin::fields()) mFields.emplace_back(f.name, nullptr, f.type, 1);
    mCollection.nbFields = static_cast<int32_t>(mFields.size());
    mCollection.fields = mFields.data();
  }

  AsciiChar const* getPluginName() const noexcept override { return Plugin::kName; }
  AsciiChar const* getPluginVersion() const noexcept override { return kVersion; }
  AsciiChar const* getPluginNamespace() const noexcept override { return kNamespace; }
  PluginFieldCollection const* getFieldNames() noexcept override { return &mCollection; }

  // Every attribute must be given once, as one value of its declared type.
  IPluginV3* createPlugin(AsciiChar const*, PluginFieldCollection const* fc, TensorRTPhase) noexcept override {
    try {
      Attributes attributes{};
      for (auto const& f : Plugin::fields()) {
        PluginField const* given = nullptr;
        for (int32_t i = 0; fc != nullptr && i < fc->nbFields; i++) {
          if (std::strcmp(fc->fields[i].name, f.name) == 0) given = &fc->fields[i];
        }
        if (given == nullptr || given->type != f.type || given->length != 1 || given->data == nullptr) {
          logError(std::string(Plugin::kName) + ": attribute '" + f.name + "' missing or not one value of its type");
          return nullptr;
        }
        std::memcpy(reinterpret_cast<char*>(&attributes) + f.offset, given->data, 4);
      }
      if (!Plugin::valid(attributes)) return nullptr;
      return new Plugin(attributes);
    } catch (...) {
      return nullptr;
    }
  }

 private:
  std::vector<PluginField> mFields;
  PluginFieldCollection mCollection{};
};

inline bool linear(PluginTensorDesc const& desc, DataType type) {
  return desc.format == TensorFormat::kLINEAR && desc.type == type;
}

}  // namespace trt
}  // namespace beamtrt
