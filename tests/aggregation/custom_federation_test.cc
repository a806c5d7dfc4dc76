// A federation of a model known only as a file (FederationConfig.initial_model):
// what MakeFederation builds from it, and what it refuses.
#include <gtest/gtest.h>

#include "aggregation/federation.h"
#include "models/custom_model.h"
#include "tests/crypto/test_dir.h"

namespace estuary::aggregation {
namespace {

using crypto::testing::TempDir;

// A Linear(2, 1) in bf16 with an integer step counter.
std::filesystem::path WriteModel(const TempDir& dir) {
  models::CustomModel model;
  model.layout = {{"fc.weight", {1, 2}, "BF16"}, {"fc.bias", {1}, "F32"}, {"steps", {}, "I64"}};
  model.manifest.Append("fc.weight", {1, 2});
  model.manifest.Append("fc.bias", {1});
  model.values = {0.5f, -1.25f, 3.0f};  // bf16 holds them exactly
  model.held["steps"] = std::string("\x07\0\0\0\0\0\0\0", 8);
  const auto path = dir.path() / "fc.safetensors";
  EXPECT_TRUE(models::SaveCustomModel(path, model).ok());
  return path;
}

v1::FederationConfig Custom(const std::filesystem::path& path, const std::string& strategy) {
  v1::FederationConfig config = DefaultFederation();
  config.set_initial_model(path.string());
  config.mutable_strategy()->set_name(strategy);
  return config;
}

TEST(CustomFederation, StartsFromTheFileAndNamesTheModelAfterItsLayout) {
  TempDir dir;
  const auto path = WriteModel(dir);
  for (const char* strategy : {"fedavg", "fedavgm", "fedadam", "median", "krum"}) {
    auto f = MakeFederation(Custom(path, strategy), {});
    ASSERT_TRUE(f.ok()) << strategy << ": " << f.status().ToString();
    const std::string name = models::CustomModelName(
        {{"fc.weight", {1, 2}, "BF16"}, {"fc.bias", {1}, "F32"}, {"steps", {}, "I64"}});
    EXPECT_EQ(f->config.task().model(), name);
    ASSERT_TRUE(f->custom);
    EXPECT_EQ(f->custom->name, name);
    EXPECT_EQ(f->initial, (std::vector<float>{0.5f, -1.25f, 3.0f}));
    EXPECT_EQ(f->manifest.total_elements, 3u);
    EXPECT_EQ(f->manifest.tensors.size(), 2u);
    EXPECT_FALSE(f->evaluator);
    EXPECT_TRUE(f->strategy);
  }
  // DP-FedAvg needs no model knowledge either.
  v1::FederationConfig dp = Custom(path, "fedavg");
  dp.mutable_dp()->set_noise_multiplier(1.0);
  auto f = MakeFederation(dp, {});
  ASSERT_TRUE(f.ok()) << f.status().ToString();
}

TEST(CustomFederation, RefusesInOneLine) {
  TempDir dir;
  const auto path = WriteModel(dir);
  v1::FederationConfig lora = Custom(path, "fedavg");
  lora.mutable_task()->set_update_kind(v1::UPDATE_LORA);
  v1::FederationConfig base = Custom(path, "fedavg");
  base.set_base_model(path.string());
  const std::pair<v1::FederationConfig, std::string> cases[] = {
      {lora, "with update_kind = lora: a model known only as a file trains full updates"},
      {base, "with base_model = "},
      {Custom(dir.path() / "missing.safetensors", "fedavg"), "missing.safetensors: cannot open it"},
  };
  for (const auto& [config, what] : cases) {
    auto f = MakeFederation(config, {});
    ASSERT_FALSE(f.ok()) << what;
    EXPECT_NE(f.status().message().find(what), std::string::npos) << f.status().message();
    EXPECT_EQ(f.status().message().find('\n'), std::string::npos);
  }
  auto with_data = MakeFederation(Custom(path, "fedavg"), {.data = dir.path()});
  ASSERT_FALSE(with_data.ok());
  EXPECT_NE(with_data.status().message().find("knows only as tensors; it has no evaluator"), std::string::npos)
      << with_data.status().message();
}

}  // namespace
}  // namespace estuary::aggregation
