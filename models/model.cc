#include "models/model.h"

#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <type_traits>

#include "models/flat_buffer.h"
#include "models/layers.h"
#include "models/small_gemm.h"

namespace estuary::models {

namespace {

// How a backward pass treats parameter gradients: write (or add) them into
// the flat gradient buffer (ForwardBackward), or apply plain SGD with them on
// the spot (TrainStepSgd, which takes no hooks). Layers implement both;
// models write their pass once.
struct BackwardMode {
  bool fused_sgd = false;
  float lr = 0, weight_decay = 0;
  bool accumulate = false;
  float grad_scale = 1.0f;
  StepHooks* hooks = &StepHooks::None();
};

template <typename Layer, typename... Args>
void LayerBackward(const Layer& layer, const BackwardMode& mode, Args... args) {
  if (mode.fused_sgd) {
    layer.BackwardSgd(args..., mode.lr, mode.weight_decay);
  } else {
    layer.Backward(args..., mode.accumulate);
  }
}

// What the models below share: the flat buffers and manifest (tensors are
// registered in order, Allocate() creates the buffers, Bind() hands out the
// views), the activation arena, and the Model entry points, which each model
// implements through its own forward pass and Step.
class FlatModel : public Model {
 public:
  // Both models classify 28x28 digits into 10 classes.
  int input_size() const override { return 784; }
  int num_classes() const override { return 10; }

  void Forward(const float* x, int n, float* logits) override {
    std::memcpy(logits, ForwardToArena(x, n), sizeof(float) * n * num_classes());
  }
  using Model::ForwardBackward;
  float ForwardBackward(const float* x, const int32_t* y, int n, const BackwardOptions& options) override {
    BackwardMode mode;
    mode.accumulate = options.accumulate;
    mode.grad_scale = options.grad_scale;
    if (options.hooks) mode.hooks = options.hooks;
    return Step(x, y, n, mode);
  }
  float TrainStepSgd(const float* x, const int32_t* y, int n, float lr, float wd) override {
    return Step(x, y, n, {true, lr, wd});
  }

  const Manifest& manifest() const override { return manifest_; }
  std::span<float> parameters() override { return params_; }
  std::span<const float> parameters() const override { return params_; }
  std::span<float> gradients() override { return grads_; }
  std::vector<ParameterUnit> units() const override { return units_; }

  void Initialize(uint64_t seed) override {
    std::mt19937_64 rng(seed);
    for (size_t t = 0; t < manifest_.tensors.size(); ++t) {
      const auto& spec = manifest_.tensors[t];
      const float bound = 1.0f / std::sqrt(float(fan_in_[t]));
      float* p = params_.data() + spec.offset;
      for (uint64_t i = 0; i < spec.numel(); ++i) {
        // 24 random bits -> a float in [0, 1), exactly, on every platform.
        const float u = float(rng() >> 40) * 0x1.0p-24f;
        p[i] = bound * (2.0f * u - 1.0f);
      }
    }
  }

 protected:
  // Registers a tensor; fan_in sets its init bound 1/sqrt(fan_in).
  uint64_t Add(const std::string& name, std::vector<int64_t> shape, int64_t fan_in) {
    fan_in_.push_back(fan_in);
    return manifest_.Append(name, std::move(shape));
  }
  // Closes a unit: the tensors registered since offset `begin`.
  void AddUnit(std::string name, uint64_t begin) {
    units_.push_back({std::move(name), begin, manifest_.total_elements});
  }
  void Allocate() {
    params_ = FlatBuffer<float>(manifest_.total_elements);
    grads_ = FlatBuffer<float>(manifest_.total_elements);
  }
  // Points a layer's w, b, dw, db at tensors registered at offsets wo, bo.
  template <typename Layer>
  void Bind(Layer& layer, uint64_t wo, uint64_t bo) {
    layer.w = params_.data() + wo;
    layer.b = params_.data() + bo;
    layer.dw = grads_.data() + wo;
    layer.db = grads_.data() + bo;
    if constexpr (std::is_same_v<Layer, Linear>) layer.small_batch = true;
  }
  // The forward pass, in the arena; returns the logits there.
  virtual const float* ForwardToArena(const float* x, int n) = 0;
  // Forward, mean cross-entropy and backward in `mode`; returns the loss.
  virtual float Step(const float* x, const int32_t* y, int n, const BackwardMode& mode) = 0;

  // Unit `unit`'s layer forward, between the hooks' BeforeUnit and AfterUnit.
  template <typename Layer, typename... Args>
  static void UnitForward(StepHooks& hooks, int unit, const Layer& layer, Args... args) {
    hooks.BeforeUnit(unit, Pass::kForward);
    layer.Forward(args...);
    hooks.AfterUnit(unit, Pass::kForward);
  }
  // The same for its backward in `mode`, after which the unit's gradients are final.
  template <typename Layer, typename... Args>
  void UnitBackward(int unit, const Layer& layer, const BackwardMode& mode, Args... args) {
    mode.hooks->BeforeUnit(unit, Pass::kBackward);
    LayerBackward(layer, mode, args...);
    mode.hooks->AfterUnit(unit, Pass::kBackward);
    mode.hooks->GradientsFinal(units_[unit].begin);
  }

  // Grows the activation arena to hold `floats`; never shrinks.
  float* Arena(size_t floats) {
    if (arena_.size() < floats) arena_.resize(floats);
    return arena_.data();
  }

  Manifest manifest_;
  std::vector<int64_t> fan_in_;
  std::vector<ParameterUnit> units_;
  FlatBuffer<float> params_, grads_;
  std::vector<float> arena_;
};

// The entry points of a model whose Net lays out its activations for a batch
// (Layout(n), with logits and dlogits) and runs its passes over them
// (RunForward, RunBackward): the same forward, loss and backward for both.
template <typename Net>
class LayeredModel : public FlatModel {
 private:
  const float* ForwardToArena(const float* x, int n) final {
    auto a = net().Layout(n);
    net().RunForward(a, x, n, StepHooks::None());
    return a.logits;
  }

  float Step(const float* x, const int32_t* y, int n, const BackwardMode& mode) final {
    auto a = net().Layout(n);
    net().RunForward(a, x, n, *mode.hooks);
    const float loss = SoftmaxCrossEntropy(a.logits, y, n, 10, a.dlogits, nullptr, mode.grad_scale);
    net().RunBackward(a, x, n, mode);
    return loss;
  }

  Net& net() { return static_cast<Net&>(*this); }
};

// McMahan et al.'s "2NN": 784-200-200-10 with ReLU.
class Mlp final : public LayeredModel<Mlp> {
 public:
  Mlp() {
    const uint64_t w1 = Add("fc1.weight", {200, 784}, 784), b1 = Add("fc1.bias", {200}, 784);
    AddUnit("fc1", w1);
    const uint64_t w2 = Add("fc2.weight", {200, 200}, 200), b2 = Add("fc2.bias", {200}, 200);
    AddUnit("fc2", w2);
    const uint64_t w3 = Add("fc3.weight", {10, 200}, 200), b3 = Add("fc3.bias", {10}, 200);
    AddUnit("fc3", w3);
    Allocate();
    fc1_ = {784, 200};
    fc2_ = {200, 200};
    fc3_ = {200, 10};
    Bind(fc1_, w1, b1);
    Bind(fc2_, w2, b2);
    Bind(fc3_, w3, b3);
  }
  std::string_view name() const override { return "mlp"; }

 private:
  friend class LayeredModel<Mlp>;

  struct Activations {
    float *h1, *h2, *logits, *dlogits, *dh2, *dh1;
  };

  // h1, h2 [n,200] | logits, dlogits [n,10] | dh2, dh1 [n,200], in the arena.
  Activations Layout(int n) {
    float* p = Arena(size_t(n) * 820);
    const size_t m = size_t(n);
    return {p, p + 200 * m, p + 400 * m, p + 410 * m, p + 420 * m, p + 620 * m};
  }

  // Units: 0 fc1, 1 fc2, 2 fc3.
  void RunForward(Activations& a, const float* x, int n, StepHooks& hooks) {
    UnitForward(hooks, 0, fc1_, x, n, a.h1, Activation::kRelu);
    UnitForward(hooks, 1, fc2_, a.h1, n, a.h2, Activation::kRelu);
    UnitForward(hooks, 2, fc3_, a.h2, n, a.logits);
  }

  // From the loss's gradient in a.dlogits.
  void RunBackward(Activations& a, const float* x, int n, const BackwardMode& mode) {
    UnitBackward(2, fc3_, mode, a.h2, a.dlogits, n, a.dh2);
    ReluBackward(a.h2, a.dh2, int64_t(n) * 200);
    UnitBackward(1, fc2_, mode, a.h1, a.dh2, n, a.dh1);
    ReluBackward(a.h1, a.dh1, int64_t(n) * 200);
    // No dx for the first layer, so its weights are not read: no unit.
    LayerBackward(fc1_, mode, x, a.dh1, n, static_cast<float*>(nullptr));
    mode.hooks->GradientsFinal(0);
  }

  Linear fc1_, fc2_, fc3_;
};

// McMahan et al.'s CNN: conv5x5(32) -> pool -> conv5x5(64) -> pool -> fc512 -> fc10.
class Cnn final : public LayeredModel<Cnn> {
 public:
  Cnn() {
    const uint64_t cw1 = Add("conv1.weight", {32, 1, 5, 5}, 25), cb1 = Add("conv1.bias", {32}, 25);
    AddUnit("conv1", cw1);
    const uint64_t cw2 = Add("conv2.weight", {64, 32, 5, 5}, 800), cb2 = Add("conv2.bias", {64}, 800);
    AddUnit("conv2", cw2);
    const uint64_t w1 = Add("fc1.weight", {512, 3136}, 3136), b1 = Add("fc1.bias", {512}, 3136);
    AddUnit("fc1", w1);
    const uint64_t w2 = Add("fc2.weight", {10, 512}, 512), b2 = Add("fc2.bias", {10}, 512);
    AddUnit("fc2", w2);
    Allocate();
    conv1_ = {1, 32, 5, 2, 28, 28};
    conv2_ = {32, 64, 5, 2, 14, 14};
    pool1_ = {32, 28, 28};
    pool2_ = {64, 14, 14};
    fc1_ = {3136, 512};
    fc2_ = {512, 10};
    Bind(conv1_, cw1, cb1);
    Bind(conv2_, cw2, cb2);
    Bind(fc1_, w1, b1);
    Bind(fc2_, w2, b2);
  }
  std::string_view name() const override { return "cnn"; }

 private:
  friend class LayeredModel<Cnn>;

  struct Activations {
    float *cols1, *c1, *p1, *cols2, *c2, *p2, *f1, *logits;
    float *dlogits, *df1, *dp2, *dc2, *dp1, *dc1, *dcol;
    int32_t *arg1, *arg2;
  };

  Activations Layout(int n) {
    const size_t sizes[] = {
        size_t(n) * conv1_.col_size(), size_t(n) * 32 * 784, size_t(n) * 32 * 196, size_t(n) * conv2_.col_size(),
        size_t(n) * 64 * 196,           size_t(n) * 3136,     size_t(n) * 512,      size_t(n) * 10,
        size_t(n) * 10,                 size_t(n) * 512,      size_t(n) * 3136,     size_t(n) * 64 * 196,
        size_t(n) * 32 * 196,           size_t(n) * 32 * 784, size_t(conv2_.col_size()),
        size_t(n) * 32 * 196,           size_t(n) * 64 * 49};  // the two argmax arrays (int32, same width)
    size_t total = 0;
    for (size_t s : sizes) total += s;
    float* p = Arena(total);
    float* slots[17];
    for (int i = 0; i < 17; ++i) {
      slots[i] = p;
      p += sizes[i];
    }
    return {slots[0],  slots[1],  slots[2],  slots[3],  slots[4],  slots[5],
            slots[6],  slots[7],  slots[8],  slots[9],  slots[10], slots[11],
            slots[12], slots[13], slots[14], reinterpret_cast<int32_t*>(slots[15]),
            reinterpret_cast<int32_t*>(slots[16])};
  }

  // Units: 0 conv1, 1 conv2, 2 fc1, 3 fc2.
  void RunForward(Activations& a, const float* x, int n, StepHooks& hooks) {
    UnitForward(hooks, 0, conv1_, x, n, a.cols1, a.c1, Activation::kRelu);
    pool1_.Forward(a.c1, n, a.p1, a.arg1);
    UnitForward(hooks, 1, conv2_, a.p1, n, a.cols2, a.c2, Activation::kRelu);
    pool2_.Forward(a.c2, n, a.p2, a.arg2);  // [n, 64, 7, 7] is already PyTorch's flatten order
    UnitForward(hooks, 2, fc1_, a.p2, n, a.f1, Activation::kRelu);
    UnitForward(hooks, 3, fc2_, a.f1, n, a.logits);
  }

  // From the loss's gradient in a.dlogits (conv1's backward reads its columns, not x).
  void RunBackward(Activations& a, const float* /*x*/, int n, const BackwardMode& mode) {
    UnitBackward(3, fc2_, mode, a.f1, a.dlogits, n, a.df1);
    ReluBackward(a.f1, a.df1, int64_t(n) * 512);
    UnitBackward(2, fc1_, mode, a.p2, a.df1, n, a.dp2);
    pool2_.Backward(a.dp2, a.arg2, n, a.dc2);
    ReluBackward(a.c2, a.dc2, int64_t(n) * 64 * 196);
    UnitBackward(1, conv2_, mode, a.cols2, a.dc2, n, a.dcol, a.dp1);
    pool1_.Backward(a.dp1, a.arg1, n, a.dc1);
    ReluBackward(a.c1, a.dc1, int64_t(n) * 32 * 784);
    // No dx for the first layer, so its weights are not read: no unit.
    LayerBackward(conv1_, mode, a.cols1, a.dc1, n, a.dcol, static_cast<float*>(nullptr));
    mode.hooks->GradientsFinal(0);
  }

  Conv2d conv1_, conv2_;
  MaxPool2 pool1_, pool2_;
  Linear fc1_, fc2_;
};

}  // namespace

Result<std::unique_ptr<Model>> MakeModel(std::string_view name) {
  if (name == "mlp") return std::unique_ptr<Model>(new Mlp());
  if (name == "cnn") return std::unique_ptr<Model>(new Cnn());
  return InvalidArgument("unknown model '{}' (expected mlp or cnn)", name);
}

static_assert(kEvalBatch <= kSmallGemmDim, "evaluation's batch is one the small-batch kernels take");

EvalResult Evaluate(Model& model, const float* x, const int32_t* y, uint64_t n, int batch) {
  EvalResult result;
  std::vector<float> logits(size_t(batch) * model.num_classes());
  double loss = 0;
  int64_t correct = 0;
  for (uint64_t begin = 0; begin < n; begin += batch) {
    const int b = int(std::min<uint64_t>(batch, n - begin));
    model.Forward(x + begin * model.input_size(), b, logits.data());
    loss += double(SoftmaxCrossEntropy(logits.data(), y + begin, b, model.num_classes(), nullptr, &correct)) * b;
  }
  result.examples = n;
  result.loss = n ? loss / double(n) : 0;
  result.accuracy = n ? double(correct) / double(n) : 0;
  return result;
}

}  // namespace estuary::models

namespace estuary::models {

EvalResult EvaluateParallel(std::vector<std::unique_ptr<Model>>& replicas, std::span<const float> params,
                            const float* x, const int32_t* y, uint64_t n) {
  const size_t parts = replicas.size();
  std::vector<EvalResult> results(parts);
  auto run = [&](size_t part) {
    auto cut = [&](size_t at) { return at == parts ? n : n * at / parts / kEvalBatch * kEvalBatch; };
    const uint64_t begin = cut(part), end = cut(part + 1);
    Model& model = *replicas[part];
    std::copy(params.begin(), params.end(), model.parameters().begin());
    results[part] = Evaluate(model, x + begin * model.input_size(), y + begin, end - begin);
  };
  std::vector<std::thread> threads;
  for (size_t part = 1; part < parts; ++part) threads.emplace_back(run, part);
  run(0);
  for (auto& t : threads) t.join();
  EvalResult total;
  double loss = 0, correct = 0;
  for (const auto& r : results) {
    loss += r.loss * double(r.examples);
    correct += r.accuracy * double(r.examples);
    total.examples += r.examples;
  }
  total.loss = total.examples ? loss / double(total.examples) : 0;
  total.accuracy = total.examples ? correct / double(total.examples) : 0;
  return total;
}

}  // namespace estuary::models
