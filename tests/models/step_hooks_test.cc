// What DDP and ZeRO rely on from every model (models/step_hooks.h), for the
// MLP, the CNN and the decoder (tied and untied): micro-batch accumulation and
// gradient scaling, the order and meaning of the hooks, that no parameter is
// read outside its unit, and that the flat buffers are page-aligned.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "models/flat_buffer.h"
#include "models/llama.h"
#include "models/model.h"
#include "models/step_hooks.h"

namespace estuary::models {
namespace {

// One model behind one interface: a fixed batch that splits into `parts`
// equal micro-batches.
class Subject {
 public:
  virtual ~Subject() = default;
  virtual std::vector<ParameterUnit> units() const = 0;
  virtual std::span<float> parameters() = 0;
  virtual std::span<float> gradients() = 0;
  virtual const Manifest& manifest() const = 0;
  // ForwardBackward on micro-batch `part` of `parts`; returns the loss.
  virtual float Step(int part, int parts, const BackwardOptions& options) = 0;
  // forward opens (in order) and backward opens (in order), as documented.
  virtual std::vector<int> ForwardUnits() const = 0;
  virtual std::vector<int> BackwardUnits() const = 0;
};

class ClassifierSubject : public Subject {
 public:
  explicit ClassifierSubject(const std::string& name) : model_(MakeModel(name).value()) {
    model_->Initialize(7);
    std::mt19937 rng(3);
    x_.resize(size_t(kBatch) * model_->input_size());
    for (float& v : x_) v = float(rng() % 1000) / 1000.0f;
    for (int i = 0; i < kBatch; ++i) y_.push_back(int32_t(rng() % 10));
  }
  std::vector<ParameterUnit> units() const override { return model_->units(); }
  std::span<float> parameters() override { return model_->parameters(); }
  std::span<float> gradients() override { return model_->gradients(); }
  const Manifest& manifest() const override { return model_->manifest(); }
  float Step(int part, int parts, const BackwardOptions& options) override {
    const int n = kBatch / parts, begin = part * n;
    return model_->ForwardBackward(x_.data() + size_t(begin) * model_->input_size(), y_.data() + begin, n, options);
  }
  std::vector<int> ForwardUnits() const override {
    std::vector<int> order(units().size());
    for (size_t u = 0; u < order.size(); ++u) order[u] = int(u);
    return order;
  }
  // Every layer but the first (which forms no input gradient), last first.
  std::vector<int> BackwardUnits() const override {
    std::vector<int> order;
    for (int u = int(units().size()) - 1; u >= 1; --u) order.push_back(u);
    return order;
  }

 private:
  static constexpr int kBatch = 16;
  std::unique_ptr<Model> model_;
  std::vector<float> x_;
  std::vector<int32_t> y_;
};

class LlamaSubject : public Subject {
 public:
  explicit LlamaSubject(bool tied) {
    LlamaConfig c;
    c.vocab_size = 40;
    c.hidden_size = 16;
    c.intermediate_size = 24;
    c.num_layers = 3;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.max_seq_len = kSeq;
    c.tie_embeddings = tied;
    model_ = std::make_unique<Llama>(Llama::Create(c, kBatch).value());
    model_->Initialize(11);
    // Norm weights away from 1, so their gradients and reads matter.
    std::mt19937 rng(5);
    for (const TensorSpec& t : model_->manifest().tensors) {
      if (t.shape.size() != 1) continue;
      for (uint64_t i = 0; i < t.numel(); ++i) model_->parameters()[t.offset + i] = 0.5f + float(rng() % 100) / 100.0f;
    }
    for (int i = 0; i < kBatch * kSeq; ++i) {
      tokens_.push_back(int32_t(rng() % 40));
      targets_.push_back(int32_t(rng() % 40));
    }
  }
  std::vector<ParameterUnit> units() const override { return model_->units(); }
  std::span<float> parameters() override { return model_->parameters(); }
  std::span<float> gradients() override { return model_->gradients(); }
  const Manifest& manifest() const override { return model_->manifest(); }
  float Step(int part, int parts, const BackwardOptions& options) override {
    const int batch = kBatch / parts, begin = part * batch * kSeq;
    auto loss = model_->ForwardBackward(tokens_.data() + begin, targets_.data() + begin, batch, kSeq, options);
    EXPECT_TRUE(loss.ok()) << loss.status().ToString();
    return loss.ok() ? *loss : NAN;
  }
  std::vector<int> ForwardUnits() const override {
    std::vector<int> order;
    for (size_t u = 0; u < units().size(); ++u) order.push_back(int(u));
    if (model_->config().tie_embeddings) order.push_back(0);  // the LM head
    return order;
  }
  // The LM head's unit first; the lookup's backward reads no weight.
  std::vector<int> BackwardUnits() const override {
    std::vector<int> order;
    if (model_->config().tie_embeddings) order.push_back(0);
    for (int u = int(units().size()) - 1; u >= 1; --u) order.push_back(u);
    return order;
  }

 private:
  static constexpr int kBatch = 4, kSeq = 6;
  std::unique_ptr<Llama> model_;
  std::vector<int32_t> tokens_, targets_;
};

std::unique_ptr<Subject> MakeSubject(const std::string& name) {
  if (name == "llama_untied") return std::make_unique<LlamaSubject>(false);
  if (name == "llama_tied") return std::make_unique<LlamaSubject>(true);
  return std::make_unique<ClassifierSubject>(name);
}

std::vector<float> Copy(std::span<const float> s) { return {s.begin(), s.end()}; }

bool BitEqual(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

class StepHooksTest : public ::testing::TestWithParam<const char*> {};

// k micro-batches with grad_scale 1/k, accumulated, equal one step on the
// whole batch; the first micro-batch overwrites whatever was there.
TEST_P(StepHooksTest, AccumulatedMicroBatchesEqualTheWholeBatch) {
  auto subject = MakeSubject(GetParam());
  const float whole_loss = subject->Step(0, 1, {});
  const std::vector<float> whole = Copy(subject->gradients());
  for (int k : {2, 4}) {
    std::fill(subject->gradients().begin(), subject->gradients().end(), 1e6f);
    double loss = 0;
    for (int part = 0; part < k; ++part) {
      BackwardOptions options;
      options.accumulate = part > 0;
      options.grad_scale = 1.0f / float(k);
      loss += subject->Step(part, k, options) / k;
    }
    EXPECT_NEAR(loss, whole_loss, 1e-5 * whole_loss) << "k " << k;
    for (const TensorSpec& t : subject->manifest().tensors) {
      double diff = 0, scale = 1e-30;
      for (uint64_t i = t.offset; i < t.offset + t.numel(); ++i) {
        diff = std::max(diff, double(std::abs(subject->gradients()[i] - whole[i])));
        scale = std::max(scale, double(std::abs(whole[i])));
      }
      EXPECT_LE(diff / scale, 1e-5) << t.name << ", k " << k;
    }
  }
}

// A power-of-two scale scales every rounding step exactly, so the gradients
// come out exactly 4 times the unscaled ones, and the loss is not scaled.
TEST_P(StepHooksTest, GradScaleScalesTheGradientsNotTheLoss) {
  auto subject = MakeSubject(GetParam());
  const float loss = subject->Step(0, 1, {});
  const std::vector<float> plain = Copy(subject->gradients());
  BackwardOptions options;
  options.grad_scale = 4.0f;
  EXPECT_EQ(subject->Step(0, 1, options), loss);
  std::vector<float> expected(plain);
  for (float& v : expected) v *= 4.0f;
  EXPECT_TRUE(BitEqual(subject->gradients(), expected));
}

TEST_P(StepHooksTest, UnitsTileTheBufferInOrder) {
  auto subject = MakeSubject(GetParam());
  const auto units = subject->units();
  ASSERT_GE(units.size(), 3u);
  uint64_t at = 0;
  for (const ParameterUnit& u : units) {
    EXPECT_EQ(u.begin, at) << u.name;
    EXPECT_GT(u.end, u.begin) << u.name;
    at = u.end;
  }
  EXPECT_EQ(at, subject->manifest().total_elements);
  // Every tensor lies inside one unit.
  for (const TensorSpec& t : subject->manifest().tensors) {
    const auto inside = std::count_if(units.begin(), units.end(), [&](const ParameterUnit& u) {
      return u.begin <= t.offset && t.offset + t.numel() <= u.end;
    });
    EXPECT_EQ(inside, 1) << t.name;
  }
}

// Records every call, and snapshots gradients[offset, end) at each
// GradientsFinal, to compare with the step's final gradients.
class Recorder : public StepHooks {
 public:
  explicit Recorder(std::span<const float> grads) : grads_(grads) {}
  void BeforeUnit(int unit, Pass pass) override {
    EXPECT_EQ(open_, -1) << "unit " << unit << " opened while " << open_ << " is open";
    open_ = unit;
    (pass == Pass::kForward ? forward : backward).push_back(unit);
    EXPECT_TRUE(finals.empty() || pass == Pass::kBackward) << "forward after a gradient was final";
  }
  void AfterUnit(int unit, Pass pass) override {
    EXPECT_EQ(open_, unit) << "closed a unit that is not open";
    open_ = -1;
  }
  void GradientsFinal(uint64_t offset) override {
    finals.push_back(offset);
    snapshots.push_back(Copy(grads_.subspan(offset)));
  }
  int open() const { return open_; }

  std::vector<int> forward, backward;
  std::vector<uint64_t> finals;
  std::vector<std::vector<float>> snapshots;

 private:
  std::span<const float> grads_;
  int open_ = -1;
};

TEST_P(StepHooksTest, HooksComeInOrderAndFinalGradientsAreFinal) {
  auto subject = MakeSubject(GetParam());
  const float plain_loss = subject->Step(0, 1, {});
  const std::vector<float> plain = Copy(subject->gradients());
  // The whole batch, then the same as two accumulated micro-batches with
  // hooks on the last (as DDP runs them).
  for (int parts : {1, 2}) {
    SCOPED_TRACE(parts == 1 ? "one batch" : "two micro-batches");
    std::fill(subject->gradients().begin(), subject->gradients().end(), 1e6f);
    Recorder recorder(subject->gradients());
    float loss = 0;
    for (int part = 0; part < parts; ++part) {
      BackwardOptions options;
      options.accumulate = part > 0;
      options.grad_scale = 1.0f / float(parts);
      if (part == parts - 1) options.hooks = &recorder;
      loss = subject->Step(part, parts, options);
    }
    EXPECT_EQ(recorder.open(), -1);
    EXPECT_EQ(recorder.forward, subject->ForwardUnits());
    EXPECT_EQ(recorder.backward, subject->BackwardUnits());
    ASSERT_FALSE(recorder.backward.empty());
    EXPECT_EQ(recorder.backward.front(), recorder.forward.back());  // an engine may keep it across the turn
    ASSERT_FALSE(recorder.finals.empty());
    EXPECT_EQ(recorder.finals.back(), 0u);
    for (size_t i = 1; i < recorder.finals.size(); ++i) EXPECT_LT(recorder.finals[i], recorder.finals[i - 1]);
    // Every unit's start is announced, so a bucket can end at any unit boundary.
    for (const ParameterUnit& u : subject->units()) {
      EXPECT_NE(std::find(recorder.finals.begin(), recorder.finals.end(), u.begin), recorder.finals.end()) << u.name;
    }
    for (size_t i = 0; i < recorder.finals.size(); ++i) {
      EXPECT_TRUE(BitEqual(recorder.snapshots[i], subject->gradients().subspan(recorder.finals[i])))
          << "gradients from offset " << recorder.finals[i] << " changed after they were announced final";
    }
    if (parts == 1) {
      // Hooks change nothing.
      EXPECT_EQ(loss, plain_loss);
      EXPECT_TRUE(BitEqual(subject->gradients(), plain));
    }
  }
}

// ZeRO-3's view: every parameter outside an open unit is NaN. Any read
// outside a bracket would turn the loss or a gradient into NaN or change it;
// the step must come out the same bits as with all parameters present.
class Poisoner : public StepHooks {
 public:
  Poisoner(std::span<float> params, std::vector<ParameterUnit> units)
      : params_(params), units_(std::move(units)), saved_(Copy(params)) {
    std::fill(params_.begin(), params_.end(), std::numeric_limits<float>::quiet_NaN());
  }
  ~Poisoner() override { std::copy(saved_.begin(), saved_.end(), params_.begin()); }
  void BeforeUnit(int unit, Pass) override {
    const ParameterUnit& u = units_.at(unit);
    std::copy(saved_.begin() + u.begin, saved_.begin() + u.end, params_.begin() + u.begin);
  }
  void AfterUnit(int unit, Pass) override {
    const ParameterUnit& u = units_.at(unit);
    std::fill(params_.begin() + u.begin, params_.begin() + u.end, std::numeric_limits<float>::quiet_NaN());
  }

 private:
  std::span<float> params_;
  std::vector<ParameterUnit> units_;
  std::vector<float> saved_;
};

TEST_P(StepHooksTest, NoParameterIsReadOutsideItsUnit) {
  auto subject = MakeSubject(GetParam());
  const std::vector<float> params = Copy(subject->parameters());
  const float loss = subject->Step(0, 1, {});
  const std::vector<float> grads = Copy(subject->gradients());
  float poisoned_loss = 0;
  {
    Poisoner poisoner(subject->parameters(), subject->units());
    BackwardOptions options;
    options.hooks = &poisoner;
    poisoned_loss = subject->Step(0, 1, options);
    EXPECT_TRUE(std::all_of(subject->parameters().begin(), subject->parameters().end(),
                            [](float v) { return std::isnan(v); }))
        << "a unit was left open";
  }
  EXPECT_EQ(poisoned_loss, loss);
  EXPECT_TRUE(BitEqual(subject->gradients(), grads));
  EXPECT_TRUE(BitEqual(subject->parameters(), params));
}

TEST_P(StepHooksTest, FlatBuffersArePageAligned) {
  auto subject = MakeSubject(GetParam());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(subject->parameters().data()) % PageSize(), 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(subject->gradients().data()) % PageSize(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Models, StepHooksTest, ::testing::Values("mlp", "cnn", "llama_untied", "llama_tied"));

TEST(Llama, RejectsAGradScaleThatIsNotFinite) {
  auto model = Llama::Create({40, 16, 24, 1, 4, 2, 6}, 1);
  ASSERT_TRUE(model.ok());
  std::vector<int32_t> ids(6, 1);
  BackwardOptions options;
  options.grad_scale = std::numeric_limits<float>::infinity();
  auto loss = model->ForwardBackward(ids.data(), ids.data(), 1, 6, options);
  ASSERT_FALSE(loss.ok());
  EXPECT_EQ(loss.status().message(), "llama: grad_scale inf is not finite");
}

}  // namespace
}  // namespace estuary::models
