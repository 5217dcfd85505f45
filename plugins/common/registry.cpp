// The library's entry points for TensorRT: getCreators (both plugin creators) and setLoggerFinder. Load it with
// trt.get_plugin_registry().load_library(path) (or trtexec --dynamicPlugins); it does not link libnvinfer.
#include "plugin_base.h"

#include "../block_selector/plugin.h"
#include "../windowed_attention/plugin.h"

namespace beamtrt {
namespace trt {
namespace {
ILoggerFinder* gLoggerFinder = nullptr;
}

void logError(std::string const& message) noexcept {
  ILogger* logger = gLoggerFinder != nullptr ? gLoggerFinder->findLogger() : nullptr;
  if (logger != nullptr) logger->log(ILogger::Severity::kERROR, ("beamtrt: " + message).c_str());
}

}  // namespace trt
}  // namespace beamtrt

extern "C" {

void setLoggerFinder(nvinfer1::ILoggerFinder* finder) { beamtrt::trt::gLoggerFinder = finder; }

nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  static beamtrt::trt::Creator<beamtrt::trt::BlockSelectorPlugin> selector;
  static beamtrt::trt::Creator<beamtrt::trt::WindowedAttentionPlugin> attention;
  static nvinfer1::IPluginCreatorInterface* const creators[] = {&selector, &attention};
  nbCreators = 2;
  return creators;
}

}  // extern "C"
