// A Hugging Face model directory (config.json and model.safetensors) through
// models::LoadHfCheckpoint. The input is two parts (fuzz_util.h's
// SplitParts): the config, then the tensors. A model loaded must hold the
// config it was read with and the layout that config implies.
//
// Out of scope: a long context. The model maps its activations for
// max_position_embeddings up front (num_heads x S^2 attention weights per
// layer, lazily), which a valid config may make more than the kernel grants;
// inputs whose config asks for more than 1024 positions are skipped.
#include <nlohmann/json.hpp>

#include "fuzz/fuzz_util.h"
#include "models/llama.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace estuary;
  const auto parts = fuzz::SplitParts(data, size, 2);
  const auto config = nlohmann::json::parse(parts[0], nullptr, false);
  if (config.is_object() && config.contains("max_position_embeddings") &&
      config["max_position_embeddings"].is_number() && config["max_position_embeddings"] > 1024) {
    return 0;
  }
  static const auto dir = [] {
    std::filesystem::create_directories(fuzz::ScratchDir() / "model");
    return fuzz::ScratchDir() / "model";
  }();
  fuzz::WriteScratch("model/config.json", parts[0]);
  fuzz::WriteScratch("model/model.safetensors", parts[1]);
  auto model = models::LoadHfCheckpoint(dir, 1);
  if (!model.ok()) {
    fuzz::CheckError(model.status());
    return 0;
  }
  FUZZ_CHECK(model->config().Validate().ok());
  FUZZ_CHECK(model->manifest() == models::LayoutOf(model->config()).manifest);
  FUZZ_CHECK(model->parameters().size() == model->manifest().total_elements);
  return 0;
}
