// A model known only as a safetensors file (models/custom_model.h): PyTorch
// writes one of mixed dtypes and checks what we write back
// (torch_custom_model.py), bit for bit.
#include "models/custom_model.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "models/checkpoint.h"
#include "tests/e2e/harness.h"

namespace estuary::models {
namespace {

using testing::RunCommand;
using testing::TempDir;

std::string Oracle(const std::string& args) {
  return fmt::format("{} {}/tests/models/torch_custom_model.py {}", ESTUARY_TORCH_PYTHON, ESTUARY_SOURCE_DIR, args);
}

std::string ReadAll(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

class CustomModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto written = RunCommand(Oracle("write " + dir_.path().string()));
    ASSERT_EQ(written.exit_code, 0) << written.output;
    expected_ = nlohmann::json::parse(ReadAll(dir_ / "expected.json"));
  }
  TempDir dir_;
  nlohmann::json expected_;
};

TEST_F(CustomModelTest, ReadsEveryTensorAndNamesTheModelAsPythonDoes) {
  auto model = LoadCustomModel(dir_ / "initial.safetensors");
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  EXPECT_EQ(model->name, expected_["name"].get<std::string>());
  ASSERT_EQ(model->layout.size(), expected_["layout"].size());
  for (size_t i = 0; i < model->layout.size(); ++i) {
    const auto& want = expected_["layout"][i];
    EXPECT_EQ(model->layout[i].name, want[0].get<std::string>());
    EXPECT_EQ(model->layout[i].dtype, want[1].get<std::string>());
    EXPECT_EQ(model->layout[i].shape, want[2].get<std::vector<int64_t>>());
  }
  // conv.weight, bn.running_mean, bn.scale, temperature (0-d: [1]) are
  // averaged; the counts, mask, ids, pixels and the empty tensor are held.
  ASSERT_EQ(model->manifest.tensors.size(), 4u);
  EXPECT_EQ(model->manifest.tensors[3].name, "temperature");
  EXPECT_EQ(model->manifest.tensors[3].shape, std::vector<int64_t>{1});
  EXPECT_EQ(model->manifest.total_elements, 6u + 4 + 4 + 1);
  EXPECT_EQ(model->held.size(), 5u);
  EXPECT_EQ(model->held.at("bn.num_batches_tracked").size(), 8u);
  EXPECT_FLOAT_EQ(model->values[14], 0.7f);  // temperature, exactly the fp32 torch wrote
  // Widening is exact: 65504 (f16's largest) and the f16 subnormal 6.1e-5 ≈ 1000 * 2^-24.
  EXPECT_EQ(model->values[6 + 4 + 1], 65504.0f);
}

TEST_F(CustomModelTest, WritesTheFileBackBitForBit) {
  auto model = LoadCustomModel(dir_ / "initial.safetensors");
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  ASSERT_TRUE(SaveCustomModel(dir_ / "same.safetensors", *model).ok());
  const auto same = RunCommand(Oracle(fmt::format("same {} {}", dir_.path().string(), (dir_ / "same.safetensors").string())));
  EXPECT_EQ(same.exit_code, 0) << same.output;

  // What a checkpoint keeps of it writes the same file again, without the initial one.
  auto restored = CustomModelFromMetadata(CustomModelMetadata(*model), model->values, "checkpoint");
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  EXPECT_EQ(restored->name, model->name);
  ASSERT_TRUE(SaveCustomModel(dir_ / "restored.safetensors", *restored).ok());
  EXPECT_EQ(ReadAll(dir_ / "restored.safetensors"), ReadAll(dir_ / "same.safetensors"));
}

TEST_F(CustomModelTest, NarrowsChangedValuesAsTorchCastsThem) {
  auto model = LoadCustomModel(dir_ / "initial.safetensors");
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  // Values no half holds exactly, and ties: each must round as .to(dtype) does.
  for (size_t i = 0; i < model->values.size(); ++i) model->values[i] = model->values[i] * 1.1f + 0.3f / float(i + 1);
  ASSERT_TRUE(SaveCustomModel(dir_ / "changed.safetensors", *model).ok());
  ASSERT_TRUE(SaveCheckpoint(dir_ / "changed_f32.safetensors", model->manifest, model->values).ok());
  const auto changed = RunCommand(Oracle(fmt::format("changed {} {} {}", dir_.path().string(),
                                                     (dir_ / "changed.safetensors").string(),
                                                     (dir_ / "changed_f32.safetensors").string())));
  EXPECT_EQ(changed.exit_code, 0) << changed.output;
}

TEST(CustomModelName, DependsOnEveryNameShapeAndDtypeButNotTheOrder) {
  const std::vector<CustomTensor> layout = {{"w", {2, 3}, "F32"}, {"n", {}, "I64"}};
  const std::string name = CustomModelName(layout);
  EXPECT_EQ(name.size(), std::string("custom@").size() + 12);
  EXPECT_EQ(CustomModelName({layout[1], layout[0]}), name);
  EXPECT_NE(CustomModelName({{"w", {3, 2}, "F32"}, layout[1]}), name);
  EXPECT_NE(CustomModelName({{"w", {2, 3}, "BF16"}, layout[1]}), name);
  EXPECT_NE(CustomModelName({{"v", {2, 3}, "F32"}, layout[1]}), name);
  EXPECT_NE(CustomModelName({layout[0]}), name);
}

// A safetensors file of `header` (JSON) and `data_bytes` zero bytes.
std::filesystem::path WriteFile(const TempDir& dir, const std::string& name, const std::string& header,
                                size_t data_bytes) {
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = char((uint64_t(header.size()) >> (8 * i)) & 0xff);
  file += header + std::string(data_bytes, '\0');
  const auto path = dir / name;
  std::ofstream(path, std::ios::binary) << file;
  return path;
}

TEST(CustomModelFiles, BadFilesAreOneLineNamingTheFileAndWhat) {
  TempDir dir;
  std::ofstream(dir / "short.safetensors", std::ios::binary) << "abc";
  const std::pair<std::filesystem::path, std::string> cases[] = {
      {dir / "missing.safetensors", "cannot open"},
      {dir / "short.safetensors", "too short"},
      {WriteFile(dir, "json.safetensors", "{not json", 0), "not a JSON object"},
      {WriteFile(dir, "f64.safetensors", R"({"w":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}})", 16),
       "tensor 'w' has dtype F64"},
      {WriteFile(dir, "size.safetensors", R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
       "tensor 'w' data_offsets [0, 8) disagree"},
      {WriteFile(dir, "gap.safetensors",
                 R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                 12),
       "tensor 'b' starts at byte 8"},
      {WriteFile(dir, "ints.safetensors", R"({"n":{"dtype":"I64","shape":[],"data_offsets":[0,8]}})", 8),
       "nothing for a federation to train"},
      {WriteFile(dir, "none.safetensors", R"({"__metadata__":{}})", 0), "holds no tensors"},
      {WriteFile(dir, "shape.safetensors", R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4),
       "tensor 'w' has a bad shape"},
  };
  for (const auto& [path, what] : cases) {
    auto model = LoadCustomModel(path);
    ASSERT_FALSE(model.ok()) << path;
    const std::string message = model.status().message();
    EXPECT_NE(message.find(path.string()), std::string::npos) << message;
    EXPECT_NE(message.find(what), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace estuary::models
