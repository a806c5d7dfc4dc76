// A PEFT adapter directory (adapter_config.json and
// adapter_model.safetensors) loaded into a small LoraLlama with
// models::LoadLoraAdapter, which reads the config with ReadLoraConfig first.
// The input is two parts (fuzz_util.h's SplitParts): the config, then the
// tensors. A load that fails must leave the adapters as they were.
#include <algorithm>
#include <cstring>
#include <vector>

#include "fuzz/fuzz_util.h"
#include "fuzz/tiny_models.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace estuary;
  static models::LoraLlama* model = [] {
    auto base = models::Llama::Create(fuzz::TinyLlamaConfig(), 1);
    FUZZ_CHECK(base.ok());
    auto lora = models::LoraLlama::Create(std::move(base).value(), fuzz::TinyLoraConfig());
    FUZZ_CHECK(lora.ok());
    return new models::LoraLlama(std::move(lora).value());
  }();
  const auto parts = fuzz::SplitParts(data, size, 2);
  static const auto dir = [] {
    std::filesystem::create_directories(fuzz::ScratchDir() / "adapter");
    return fuzz::ScratchDir() / "adapter";
  }();
  fuzz::WriteScratch("adapter/adapter_config.json", parts[0]);
  fuzz::WriteScratch("adapter/adapter_model.safetensors", parts[1]);

  const std::vector<float> before(model->parameters().begin(), model->parameters().end());
  Status loaded = models::LoadLoraAdapter(dir, *model);
  if (!loaded.ok()) {
    fuzz::CheckError(loaded);
    FUZZ_CHECK(std::equal(before.begin(), before.end(), model->parameters().begin(),
                          [](float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }),
               "a failed load changed the adapters: %s", loaded.message().c_str());
  }
  return 0;
}
