// models/ against PyTorch: every layer's forward and backward, the loss, the
// optimizer, and one whole training step of each model, for fixed inputs
// written by torch_reference.py (run by ctest as a fixture).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/checkpoint.h"
#include "models/dataset.h"
#include "models/layers.h"
#include "models/model.h"
#include "models/optimizer.h"
#include "models/small_gemm.h"
#include "tests/e2e/harness.h"

namespace estuary::models {
namespace {

using Values = std::vector<float>;

nlohmann::json Fixture(const std::string& name) {
  std::ifstream in(std::string(ESTUARY_BINARY_DIR) + "/tests/models/reference/" + name + ".json");
  EXPECT_TRUE(in.good()) << "missing fixture " << name << " (the models_torch_reference step writes it)";
  return nlohmann::json::parse(in, nullptr, false);
}

Values Get(const nlohmann::json& f, const std::string& key) { return f.at(key).get<Values>(); }

// max |a - b| / max |b|: the relative error the tests bound.
double RelativeError(const float* a, const Values& b) {
  double diff = 0, scale = 1e-30;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, double(std::abs(a[i] - b[i])));
    scale = std::max(scale, double(std::abs(b[i])));
  }
  return diff / scale;
}

constexpr double kTolerance = 1e-5;

TEST(TorchOracle, Linear) {
  auto f = Fixture("linear");
  Values x = Get(f, "x"), w = Get(f, "w"), b = Get(f, "b"), dy = Get(f, "dy");
  Values y(7 * 5), dx(7 * 13), dw(5 * 13, 99.0f), db(5, 99.0f);  // poisoned: backward must overwrite
  Linear layer{13, 5, w.data(), b.data(), dw.data(), db.data()};
  layer.Forward(x.data(), 7, y.data());
  layer.Backward(x.data(), dy.data(), 7, dx.data());
  EXPECT_LE(RelativeError(y.data(), Get(f, "y")), kTolerance);
  EXPECT_LE(RelativeError(dx.data(), Get(f, "dx")), kTolerance);
  EXPECT_LE(RelativeError(dw.data(), Get(f, "dw")), kTolerance);
  EXPECT_LE(RelativeError(db.data(), Get(f, "db")), kTolerance);
}

TEST(TorchOracle, Relu) {
  auto f = Fixture("relu");
  Values x = Get(f, "x"), dy = Get(f, "dy");
  ReluForward(x.data(), int64_t(x.size()));
  EXPECT_LE(RelativeError(x.data(), Get(f, "y")), kTolerance);
  ReluBackward(x.data(), dy.data(), int64_t(dy.size()));
  EXPECT_LE(RelativeError(dy.data(), Get(f, "dx")), kTolerance);
}

TEST(TorchOracle, Conv2d) {
  auto f = Fixture("conv2d");
  Values x = Get(f, "x"), w = Get(f, "w"), b = Get(f, "b"), dy = Get(f, "dy");
  Conv2d conv{3, 4, 5, 2, 8, 8};
  Values dw(w.size(), 99.0f), db(b.size(), 99.0f);
  conv.w = w.data();
  conv.b = b.data();
  conv.dw = dw.data();
  conv.db = db.data();
  Values cols(2 * conv.col_size()), y(2 * 4 * 64), dcol(conv.col_size()), dx(x.size(), 99.0f);
  conv.Forward(x.data(), 2, cols.data(), y.data());
  conv.Backward(cols.data(), dy.data(), 2, dcol.data(), dx.data());
  EXPECT_LE(RelativeError(y.data(), Get(f, "y")), kTolerance);
  EXPECT_LE(RelativeError(dx.data(), Get(f, "dx")), kTolerance);
  EXPECT_LE(RelativeError(dw.data(), Get(f, "dw")), kTolerance);
  EXPECT_LE(RelativeError(db.data(), Get(f, "db")), kTolerance);
}

// The CNN's conv2 shape (its per-image products are libxsmm's by the volume
// rule), with the ReLU fused into the forward and plain SGD into the backward.
TEST(TorchOracle, Conv2dReluAndFusedSgdAtTheCnnsShape) {
  auto f = Fixture("conv2d_relu_sgd");
  Values x = Get(f, "x"), w = Get(f, "w"), b = Get(f, "b"), dy = Get(f, "dy");
  Conv2d conv{32, 64, 5, 2, 14, 14};
  conv.w = w.data();
  conv.b = b.data();
  Values cols(2 * conv.col_size()), y(2 * 64 * 196, 99.0f), dcol(conv.col_size()), dx(x.size(), 99.0f);
  conv.Forward(x.data(), 2, cols.data(), y.data(), Activation::kRelu);
  EXPECT_LE(RelativeError(y.data(), Get(f, "y")), kTolerance);
  ReluBackward(y.data(), dy.data(), int64_t(dy.size()));
  conv.BackwardSgd(cols.data(), dy.data(), 2, dcol.data(), dx.data(), 0.05f, 1e-4f);
  EXPECT_LE(RelativeError(dx.data(), Get(f, "dx")), kTolerance);
  EXPECT_LE(RelativeError(w.data(), Get(f, "w_after")), kTolerance);
  EXPECT_LE(RelativeError(b.data(), Get(f, "b_after")), kTolerance);
}

TEST(TorchOracle, MaxPool) {
  auto f = Fixture("maxpool");
  Values x = Get(f, "x"), dy = Get(f, "dy");
  MaxPool2 pool{3, 6, 6};
  Values y(2 * 3 * 9), dx(x.size(), 99.0f);
  std::vector<int32_t> argmax(y.size());
  pool.Forward(x.data(), 2, y.data(), argmax.data());
  pool.Backward(dy.data(), argmax.data(), 2, dx.data());
  EXPECT_LE(RelativeError(y.data(), Get(f, "y")), kTolerance);
  EXPECT_LE(RelativeError(dx.data(), Get(f, "dx")), kTolerance);
}

TEST(TorchOracle, CrossEntropy) {
  auto f = Fixture("cross_entropy");
  Values z = Get(f, "z"), dz(z.size(), 99.0f);
  auto labels = f.at("labels").get<std::vector<int32_t>>();
  const float loss = SoftmaxCrossEntropy(z.data(), labels.data(), 9, 10, dz.data());
  EXPECT_LE(RelativeError(&loss, Get(f, "loss")), kTolerance);
  EXPECT_LE(RelativeError(dz.data(), Get(f, "dz")), kTolerance);
}

TEST(TorchOracle, SgdWithMomentumAndWeightDecay) {
  auto f = Fixture("sgd");
  Values p = Get(f, "start");
  Sgd sgd(0.1f, 0.9f, 1e-3f);
  for (const char* g : {"g0", "g1", "g2"}) sgd.Step(p, Get(f, g));
  EXPECT_LE(RelativeError(p.data(), Get(f, "result")), kTolerance);
}

TEST(TorchOracle, AdamWWithDecoupledWeightDecay) {
  auto f = Fixture("adamw");
  Values p = Get(f, "start");
  AdamW adamw({.lr = 0.01f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f});
  for (const char* g : {"g0", "g1", "g2", "g3", "g4"}) adamw.Step(p, Get(f, g));
  EXPECT_EQ(adamw.step_count(), 5);
  EXPECT_LE(RelativeError(p.data(), Get(f, "result")), kTolerance);
  EXPECT_LE(RelativeError(adamw.first_moment().data(), Get(f, "exp_avg")), kTolerance);
  EXPECT_LE(RelativeError(adamw.second_moment().data(), Get(f, "exp_avg_sq")), kTolerance);
}

// A ZeRO rank's pieces lie apart in the flat buffers (parallel/data_parallel.h).
// Stepped as slices — each parameter and gradient placed apart from the next,
// with untouched values between them — they must give torch's result for the
// same parameters as one tensor, and leave the values between them alone.
TEST(TorchOracle, OptimizersStepSlicesLyingApartAsOneParameterSet) {
  for (const char* name : {"sgd", "adamw"}) {
    SCOPED_TRACE(name);
    auto f = Fixture(name);
    const Values start = Get(f, "start");
    const size_t n = start.size();
    ASSERT_GE(n, 3u);
    // Three slices of sizes 1, n/2 - 1 and the rest, each behind a gap of 5.
    const size_t sizes[3] = {1, n / 2 - 1, n - n / 2};
    const size_t gap = 5;
    Values params(n + 3 * gap, -7.0f), grads(params.size(), 11.0f);
    std::vector<size_t> at;
    for (size_t i = 0, from = 0, to = gap; i < 3; from += sizes[i], to += sizes[i] + gap, ++i) {
      std::copy_n(start.begin() + from, sizes[i], params.begin() + to);
      at.push_back(to);
    }
    std::vector<ParameterSlice> slices;
    for (int i = 0; i < 3; ++i) slices.push_back({&params[at[i]], &grads[at[i]], sizes[i]});
    Sgd sgd(0.1f, 0.9f, 1e-3f);
    AdamW adamw({.lr = 0.01f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f});
    const bool is_sgd = std::string(name) == "sgd";
    const std::vector<const char*> steps = is_sgd ? std::vector<const char*>{"g0", "g1", "g2"}
                                                  : std::vector<const char*>{"g0", "g1", "g2", "g3", "g4"};
    for (const char* g : steps) {
      const Values whole = Get(f, g);
      for (size_t i = 0, from = 0; i < 3; from += sizes[i], ++i) {
        std::copy_n(whole.begin() + from, sizes[i], grads.begin() + at[i]);
      }
      if (is_sgd) {
        sgd.Step(slices);
      } else {
        adamw.Step(slices);
      }
    }
    Values got;
    for (int i = 0; i < 3; ++i) got.insert(got.end(), params.begin() + at[i], params.begin() + at[i] + sizes[i]);
    EXPECT_LE(RelativeError(got.data(), Get(f, "result")), kTolerance);
    if (!is_sgd) {
      EXPECT_EQ(adamw.step_count(), 5);
    }
    for (size_t i = 0, to = 0; i < 3; to = at[i] + sizes[i], ++i) {
      for (size_t k = to; k < at[i]; ++k) EXPECT_EQ(params[k], -7.0f) << "the gap before slice " << i << " moved";
    }
  }
}

TEST(TorchOracle, ClipGradNormOverTheFlatBuffer) {
  for (const char* name : {"clip", "noclip"}) {
    auto f = Fixture(name);
    Values g = Get(f, "before");
    const double norm = ClipGradNorm(g, Get(f, "max_norm")[0]);
    EXPECT_NEAR(norm, Get(f, "norm")[0], 1e-5 * norm) << name;
    EXPECT_LE(RelativeError(g.data(), Get(f, "after")), kTolerance) << name;
  }
}

class WholeStep : public ::testing::TestWithParam<const char*> {};

TEST_P(WholeStep, MatchesTorch) {
  auto f = Fixture(std::string("step_") + GetParam());
  auto model = MakeModel(GetParam());
  ASSERT_TRUE(model.ok());
  Model& m = **model;
  for (const auto& t : m.manifest().tensors) {
    Values v = Get(f, t.name);
    ASSERT_EQ(v.size(), t.numel()) << t.name;
    std::copy(v.begin(), v.end(), m.parameters().begin() + t.offset);
  }
  Values x = Get(f, "x");
  auto labels = f.at("labels").get<std::vector<int32_t>>();
  std::fill(m.gradients().begin(), m.gradients().end(), 99.0f);
  const float loss = m.ForwardBackward(x.data(), labels.data(), 10);
  EXPECT_LE(RelativeError(&loss, Get(f, "loss")), kTolerance);
  for (const auto& t : m.manifest().tensors) {
    EXPECT_LE(RelativeError(m.gradients().data() + t.offset, Get(f, t.name + ".grad")), kTolerance) << t.name;
  }
  Sgd sgd(0.05f, 0.9f, 1e-4f);
  sgd.Step(m.parameters(), m.gradients());
  for (const auto& t : m.manifest().tensors) {
    EXPECT_LE(RelativeError(m.parameters().data() + t.offset, Get(f, t.name + ".after")), kTolerance) << t.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, WholeStep, ::testing::Values("mlp", "cnn"));

// The fused plain-SGD step (no momentum) against torch.optim.SGD(momentum=0).
class FusedStep : public ::testing::TestWithParam<const char*> {};

TEST_P(FusedStep, MatchesTorch) {
  auto f = Fixture(std::string("step_") + GetParam() + "_plain");
  auto model = MakeModel(GetParam());
  ASSERT_TRUE(model.ok());
  Model& m = **model;
  for (const auto& t : m.manifest().tensors) {
    Values v = Get(f, t.name);
    std::copy(v.begin(), v.end(), m.parameters().begin() + t.offset);
  }
  Values x = Get(f, "x");
  auto labels = f.at("labels").get<std::vector<int32_t>>();
  const float loss = m.TrainStepSgd(x.data(), labels.data(), 10, 0.05f, 1e-4f);
  EXPECT_LE(RelativeError(&loss, Get(f, "loss")), kTolerance);
  for (const auto& t : m.manifest().tensors) {
    EXPECT_LE(RelativeError(m.parameters().data() + t.offset, Get(f, t.name + ".after")), kTolerance) << t.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, FusedStep, ::testing::Values("mlp", "cnn"));

TEST(Model, SizesAndManifestsMatchThePapers) {
  auto mlp = MakeModel("mlp");
  auto cnn = MakeModel("cnn");
  ASSERT_TRUE(mlp.ok() && cnn.ok());
  EXPECT_EQ((*mlp)->manifest().total_elements, 199210u);
  EXPECT_EQ((*cnn)->manifest().total_elements, 1663370u);
  EXPECT_TRUE((*mlp)->manifest().Validate().ok());
  EXPECT_TRUE((*cnn)->manifest().Validate().ok());
  EXPECT_FALSE(MakeModel("resnet").ok());
}

TEST(Model, InitializationIsDeterministicAndBounded) {
  auto a = MakeModel("mlp"), b = MakeModel("mlp");
  (*a)->Initialize(5);
  (*b)->Initialize(5);
  EXPECT_TRUE(std::equal((*a)->parameters().begin(), (*a)->parameters().end(), (*b)->parameters().begin()));
  (*b)->Initialize(6);
  EXPECT_FALSE(std::equal((*a)->parameters().begin(), (*a)->parameters().end(), (*b)->parameters().begin()));
  const float bound = 1.0f / std::sqrt(784.0f);
  const auto* fc1 = (*a)->manifest().Find("fc1.weight");
  float max = 0;
  for (uint64_t i = 0; i < fc1->numel(); ++i) max = std::max(max, std::abs((*a)->parameters()[fc1->offset + i]));
  EXPECT_LE(max, bound);
  EXPECT_GT(max, 0.99f * bound);
}

// Evaluation runs at a batch that suits the kernels (kEvalBatch), and a
// kernel's sums can depend on the batch it runs; the threads cut the test set
// at multiples of that batch, so the result does not depend on their number.
TEST(Model, EvaluationDoesNotDependOnTheThreads) {
  for (const char* name : {"mlp", "cnn"}) {
    SCOPED_TRACE(name);
    const int n = 3 * kEvalBatch + 13;
    Values x(size_t(n) * 784);
    for (size_t i = 0; i < x.size(); ++i) x[i] = float((i * 7919) % 255) / 255.0f;
    std::vector<int32_t> labels(n);
    for (int i = 0; i < n; ++i) labels[i] = (i * 7) % 10;
    auto model = MakeModel(name);
    ASSERT_TRUE(model.ok());
    (*model)->Initialize(3);
    const std::vector<float> params((*model)->parameters().begin(), (*model)->parameters().end());
    std::vector<EvalResult> results;
    for (int threads : {1, 2, 3}) {
      std::vector<std::unique_ptr<Model>> replicas;
      for (int t = 0; t < threads; ++t) replicas.push_back(std::move(MakeModel(name)).value());
      results.push_back(EvaluateParallel(replicas, params, x.data(), labels.data(), n));
    }
    EXPECT_EQ(results[0].examples, uint64_t(n));
    EXPECT_GT(results[0].accuracy, 0.0);
    for (size_t t = 1; t < results.size(); ++t) {
      EXPECT_EQ(results[t].examples, results[0].examples);
      EXPECT_NEAR(results[t].accuracy, results[0].accuracy, 1e-12) << t + 1 << " threads";
      EXPECT_NEAR(results[t].loss, results[0].loss, 1e-12 * results[0].loss) << t + 1 << " threads";
    }
  }
}

TEST(Model, MlpLearnsAFixedBatch) {
  auto model = MakeModel("mlp");
  (*model)->Initialize(1);
  Values x(20 * 784);
  std::vector<int32_t> y(20);
  for (int i = 0; i < 20; ++i) {
    y[i] = i % 10;
    for (int p = 0; p < 784; ++p) x[i * 784 + p] = float((p * 7 + i * 13) % 17) / 17.0f;
  }
  Sgd sgd(0.1f, 0.9f, 0);
  const float first = (*model)->ForwardBackward(x.data(), y.data(), 20);
  float last = first;
  for (int step = 0; step < 30; ++step) {
    sgd.Step((*model)->parameters(), (*model)->gradients());
    last = (*model)->ForwardBackward(x.data(), y.data(), 20);
  }
  EXPECT_LT(last, 0.5f * first);
}

TEST(Manifest, ValidationFindsOverlapsGapsAndDuplicates) {
  Manifest m;
  m.tensors = {{"a", {2, 2}, DType::kF32, 0}, {"b", {3}, DType::kF32, 4}};
  m.total_elements = 7;
  EXPECT_TRUE(m.Validate().ok());
  Manifest gap = m;
  gap.tensors[1].offset = 5;
  gap.total_elements = 8;
  EXPECT_FALSE(gap.Validate().ok());
  Manifest overlap = m;
  overlap.tensors[1].offset = 3;
  EXPECT_FALSE(overlap.Validate().ok());
  Manifest duplicate = m;
  duplicate.tensors[1].name = "a";
  EXPECT_NE(duplicate.Validate().message().find("twice"), std::string::npos);
  Manifest short_total = m;
  short_total.total_elements = 6;
  EXPECT_FALSE(short_total.Validate().ok());
}

TEST(Manifest, AppendLaysTensorsEndToEnd) {
  Manifest m;
  EXPECT_EQ(m.Append("a", {2, 2}), 0u);
  EXPECT_EQ(m.Append("b", {3}), 4u);
  EXPECT_EQ(m.total_elements, 7u);
  ASSERT_EQ(m.tensors.size(), 2u);
  EXPECT_EQ(m.tensors[1].name, "b");
  EXPECT_EQ(m.tensors[1].shape, std::vector<int64_t>{3});
  EXPECT_EQ(m.tensors[1].dtype, DType::kF32);
  EXPECT_TRUE(m.Validate().ok());
}

TEST(Checkpoint, RoundTripsAndRejectsCorruption) {
  testing::TempDir dir;
  auto model = MakeModel("mlp");
  (*model)->Initialize(3);
  const auto path = dir / "model.safetensors";
  ASSERT_TRUE(SaveCheckpoint(path, (*model)->manifest(), (*model)->parameters(), {{"round", "4"}}).ok());
  auto loaded = LoadCheckpoint(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_TRUE(loaded->manifest == (*model)->manifest());
  EXPECT_TRUE(std::equal(loaded->data.begin(), loaded->data.end(), (*model)->parameters().begin()));
  EXPECT_EQ(loaded->metadata.at("round"), "4");
  // A header that lies about the data.
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(0);
  const char huge[8] = {'\xff', '\xff', '\xff', '\x7f', 0, 0, 0, 0};
  f.write(huge, 8);
  f.close();
  auto corrupt = LoadCheckpoint(path);
  ASSERT_FALSE(corrupt.ok());
  EXPECT_NE(corrupt.status().message().find(path.string()), std::string::npos);
  EXPECT_FALSE(LoadCheckpoint(dir / "absent.safetensors").ok());
}

TEST(Idx, RoundTripsAndNamesTheBrokenFile) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "d", 30, 20, 1);
  auto train = LoadIdx(dir / "d", Split::kTrain);
  ASSERT_TRUE(train.ok()) << train.status().ToString();
  EXPECT_EQ(train->size(), 30u);
  EXPECT_EQ(train->feature_size, 784);
  auto test = LoadIdx(dir / "d", Split::kTest);
  ASSERT_TRUE(test.ok());
  EXPECT_EQ(test->size(), 20u);

  auto missing = LoadIdx(dir / "nowhere", Split::kTrain);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("nowhere"), std::string::npos);

  const auto labels = dir / "d" / "train-labels-idx1-ubyte";
  std::filesystem::resize_file(labels, 20);  // truncated
  auto truncated = LoadIdx(dir / "d", Split::kTrain);
  ASSERT_FALSE(truncated.ok());
  EXPECT_NE(truncated.status().message().find("train-labels-idx1-ubyte"), std::string::npos);

  std::ofstream(dir / "d" / "t10k-images-idx3-ubyte", std::ios::binary)
      << std::string("\x00\x00\x08\x01\x00\x00\x00\x01\x00\x00\x00\x01\x00\x00\x00\x01?", 17);
  auto bad_magic = LoadIdx(dir / "d", Split::kTest);
  ASSERT_FALSE(bad_magic.ok());
  EXPECT_NE(bad_magic.status().message().find("bad magic"), std::string::npos) << bad_magic.status().message();
}

}  // namespace
}  // namespace estuary::models
