#include "models/cuda/classifier_engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "models/cuda/blas.h"
#include "models/cuda/check.h"
#include "models/cuda/classifier_kernels.h"
#include "models/cuda/device.h"
#include "models/cuda/engine_state.h"
#include "models/cuda/layers.h"
#include "models/cuda/precision.h"

namespace estuary::models::cuda {
namespace {

constexpr int kInput = 784, kClasses = 10;
// The pools' argmax indexes the whole batch in int32: n * 32 * 28 * 28 must
// fit, which bounds n near 85k. A round, documented limit well inside it.
constexpr int kMaxBatchLimit = 65536;

// y[n, out] = x[n, in] W^T + b; offsets of W and b in the flat buffers.
struct LinearLayer {
  int in = 0, out = 0;
  uint64_t w = 0, b = 0;
};

// Conv2d, stride 1, zero padding 2, 5x5 kernel, on [n, in, h, w].
struct ConvLayer {
  int in_channels = 0, out_channels = 0, height = 0, width = 0;
  uint64_t w = 0, b = 0;
  static constexpr int kKernel = 5, kPad = 2;
  int64_t kdim() const { return int64_t(in_channels) * kKernel * kKernel; }
  int64_t hw() const { return int64_t(height) * width; }
  ConvShape shape(int n) const { return {n, in_channels, height, width, kKernel, kPad}; }
};

// Activations for a batch of n. Float buffers hold fp32; the `_lo` ones are
// the bf16 copies the GEMMs read (null under f32, where the GEMMs read the
// fp32 buffers themselves). Unused ones stay null for the other model.
struct Activations {
  float* x = nullptr;      // [n, 784] the uploaded batch
  int32_t* y = nullptr;    // [n]
  float* logits = nullptr;   // [n, 10]
  float* dlogits = nullptr;  // [n, 10]
  void* dy_lo = nullptr;     // the widest layer gradient any GEMM reads, in bf16
  // mlp
  float *h1 = nullptr, *h2 = nullptr, *dh1 = nullptr, *dh2 = nullptr;  // [n, 200]
  void *x_lo = nullptr, *h1_lo = nullptr, *h2_lo = nullptr;
  // cnn
  float *cols1 = nullptr, *c1 = nullptr, *p1 = nullptr, *cols2 = nullptr, *c2 = nullptr, *p2 = nullptr;
  float* f1 = nullptr;
  int32_t *arg1 = nullptr, *arg2 = nullptr;
  float *df1 = nullptr, *dp2 = nullptr, *dc2 = nullptr, *dp1 = nullptr, *dc1 = nullptr;
  float* dcol = nullptr;      // [n, 800, 196]: conv2's unfolded input gradient
  float* partials = nullptr;  // [n, 64 * 800]: per-image weight gradients of a conv
  void *cols1_lo = nullptr, *cols2_lo = nullptr, *p2_lo = nullptr, *f1_lo = nullptr;
};


}  // namespace

// The flat buffers, the stream and the manifest are the EngineState's; the
// stream, a base class member, outlives blas.
struct ClassifierEngine::Impl final : EngineState {
  std::string name;
  bool cnn = false;
  ClassifierEngineOptions options;
  int max_batch = 0;
  ConvLayer conv1, conv2;            // cnn only
  LinearLayer fc1, fc2, fc3;         // mlp: all three; cnn: fc1, fc2

  Blas blas;
  DeviceBuffer misc, activation_buffer;
  Arena scratch;  // the cross-entropy's per-row scratch, reset before each use
  PinnedBuffer staging;  // x [max_batch, 784] floats, then y [max_batch] ints
  Event staging_free;    // recorded after the staging buffer's upload
  bool staging_used = false;
  Activations acts;

  float* loss_d() const { return misc.as<float>(); }
  int64_t* correct_d() const { return reinterpret_cast<int64_t*>(misc.as<char>() + 256); }
  // A GEMM input: the fp32 activation itself, or its bf16 copy.
  const void* In(const float* f32, const void* lo) const { return low() ? lo : static_cast<const void*>(f32); }
  GemmTypes ToF32() const { return {act(), DType::kF32, options.allow_tf32 && !low()}; }
  size_t staging_y_offset() const { return size_t(max_batch) * kInput * sizeof(float); }

  // cudaMemcpyAsync from pageable memory may return before the device has
  // read it; waiting keeps the caller free to reuse `host` at once.
  Status UploadParameters(std::span<const float> host) override {
    ESTUARY_RETURN_IF_ERROR(EngineState::UploadParameters(host));
    ESTUARY_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s()));
    return Status::Ok();
  }

  void BuildManifest();
  size_t Carve(int n, char* base);
  Status CheckInput(const float* x, const int32_t* y, int64_t n, bool batch_bound) const;
  Status Upload(const float* x, const int32_t* y, int n);
  // Under bf16, writes the bf16 copy of `count` floats that a GEMM reads next.
  Status Lower(const float* src, void* lo, int64_t count);
  Status LinearForward(const LinearLayer& l, const void* x, int n, float* y);
  Status LinearBackward(const LinearLayer& l, const void* x, const float* dy, int n, float* dx);
  Status ConvForward(const ConvLayer& c, const float* x, int n, float* cols, void* cols_lo, float* y);
  Status ConvBackward(const ConvLayer& c, const void* cols, const float* dy, int n, float* dx);
  Status RunForward(int n);
  Status RunBackward(int n, const BackwardOptions& options);
};

// The layout of models::MakeModel(name) (model.cc), tensor for tensor; the
// engine's tests compare the two manifests.
void ClassifierEngine::Impl::BuildManifest() {
  auto linear = [&](const std::string& prefix, int in, int out) {
    LinearLayer l{in, out};
    l.w = manifest.Append(prefix + ".weight", {out, in});
    l.b = manifest.Append(prefix + ".bias", {out});
    return l;
  };
  auto conv = [&](const std::string& prefix, int in, int out, int side) {
    ConvLayer c{in, out, side, side};
    c.w = manifest.Append(prefix + ".weight", {out, in, ConvLayer::kKernel, ConvLayer::kKernel});
    c.b = manifest.Append(prefix + ".bias", {out});
    return c;
  };
  if (cnn) {
    conv1 = conv("conv1", 1, 32, 28);
    conv2 = conv("conv2", 32, 64, 14);
    fc1 = linear("fc1", 64 * 7 * 7, 512);
    fc2 = linear("fc2", 512, kClasses);
  } else {
    fc1 = linear("fc1", kInput, 200);
    fc2 = linear("fc2", 200, 200);
    fc3 = linear("fc3", 200, kClasses);
  }
  // models::MakeModel(name)'s units (models/step_hooks.h): one per layer.
  auto unit = [&](const char* layer, uint64_t begin) {
    if (!units.empty()) units.back().end = begin;
    units.push_back({layer, begin, manifest.total_elements});
  };
  if (cnn) {
    unit("conv1", conv1.w), unit("conv2", conv2.w), unit("fc1", fc1.w), unit("fc2", fc2.w);
  } else {
    unit("fc1", fc1.w), unit("fc2", fc2.w), unit("fc3", fc3.w);
  }
}

size_t ClassifierEngine::Impl::Carve(int batch, char* base) {
  const int64_t n = batch;
  const size_t lo = low() ? DTypeSize(act()) : 0;  // 0: the bf16 copies take no room under f32
  Carver c(base);
  Activations a;
  auto take_lo = [&](int64_t count) { return low() ? c.Take(count, lo) : nullptr; };
  a.x = c.Floats(n * kInput);
  a.y = c.Ints(n);
  a.logits = c.Floats(n * kClasses);
  a.dlogits = c.Floats(n * kClasses);
  if (cnn) {
    a.cols1 = c.Floats(n * conv1.kdim() * conv1.hw());
    a.c1 = c.Floats(n * 32 * 784);
    a.p1 = c.Floats(n * 32 * 196);
    a.arg1 = c.Ints(n * 32 * 196);
    a.cols2 = c.Floats(n * conv2.kdim() * conv2.hw());
    a.c2 = c.Floats(n * 64 * 196);
    a.p2 = c.Floats(n * 3136);
    a.arg2 = c.Ints(n * 3136);
    a.f1 = c.Floats(n * 512);
    a.df1 = c.Floats(n * 512);
    a.dp2 = c.Floats(n * 3136);
    a.dc2 = c.Floats(n * 64 * 196);
    a.dp1 = c.Floats(n * 32 * 196);
    a.dc1 = c.Floats(n * 32 * 784);
    a.dcol = c.Floats(n * conv2.kdim() * conv2.hw());
    a.partials = c.Floats(n * std::max(conv1.kdim() * conv1.out_channels, conv2.kdim() * conv2.out_channels));
    a.cols1_lo = take_lo(n * conv1.kdim() * conv1.hw());
    a.cols2_lo = take_lo(n * conv2.kdim() * conv2.hw());
    a.p2_lo = take_lo(n * 3136);
    a.f1_lo = take_lo(n * 512);
    a.dy_lo = take_lo(n * 32 * 784);  // conv1's output gradient is the widest
  } else {
    a.h1 = c.Floats(n * 200);
    a.h2 = c.Floats(n * 200);
    a.dh1 = c.Floats(n * 200);
    a.dh2 = c.Floats(n * 200);
    a.x_lo = take_lo(n * kInput);
    a.h1_lo = take_lo(n * 200);
    a.h2_lo = take_lo(n * 200);
    a.dy_lo = take_lo(n * 200);
  }
  if (base) acts = a;
  return c.used();
}

Result<ClassifierEngine> ClassifierEngine::Create(std::string_view model, int max_batch,
                                                  ClassifierEngineOptions options) {
  // Everything that can be said without a GPU is checked first, so bad
  // arguments get their own message on any machine.
  if (model != "mlp" && model != "cnn") {
    return InvalidArgument("cuda classifier: unknown model '{}' (expected mlp or cnn)", model);
  }
  if (max_batch < 1 || max_batch > kMaxBatchLimit) {
    return InvalidArgument("cuda classifier: max_batch {} is outside [1, {}]", max_batch, kMaxBatchLimit);
  }
  if (options.precision != DType::kF32 && options.precision != DType::kBF16) {
    return InvalidArgument("cuda classifier: precision {} is not supported (f32 or bf16; f16 would need loss scaling)",
                           DTypeName(options.precision));
  }
  if (options.allow_tf32 && options.precision != DType::kF32) {
    return InvalidArgument("cuda classifier: allow_tf32 applies to f32 training, not {}",
                           DTypeName(options.precision));
  }
  ESTUARY_RETURN_IF_ERROR(CudaUsable());

  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.name = std::string(model);
  m.who = fmt::format("cuda classifier {}", model);
  m.cnn = model == "cnn";
  m.options = options;
  m.precision = options.precision;
  m.max_batch = max_batch;
  m.BuildManifest();

  ESTUARY_RETURN_IF_ERROR(m.UseStream(options.stream));
  ESTUARY_ASSIGN_OR_RETURN(m.blas, Blas::Create(m.s()));
  ESTUARY_RETURN_IF_ERROR(m.AllocateFlat(/*with_gradients=*/true));
  ESTUARY_ASSIGN_OR_RETURN(m.misc, DeviceBuffer::Allocate(512));  // the loss; the correct count at +256
  ESTUARY_RETURN_IF_ERROR(FillBytes(m.misc.data(), 0, m.misc.size(), m.s()));
  ESTUARY_ASSIGN_OR_RETURN(m.staging,
                           PinnedBuffer::Allocate(m.staging_y_offset() + size_t(max_batch) * sizeof(int32_t)));
  ESTUARY_ASSIGN_OR_RETURN(m.staging_free, Event::Create());
  // Every slice grows with n, so the carving for max_batch covers any smaller batch.
  ESTUARY_ASSIGN_OR_RETURN(m.activation_buffer, DeviceBuffer::Allocate(m.Carve(max_batch, nullptr)));
  // The cross-entropy takes a float and an int per row, each rounded up to
  // the arena's 256-byte alignment.
  ESTUARY_ASSIGN_OR_RETURN(m.scratch, Arena::Create(2 * (size_t(max_batch) * 4 + Arena::kAlignment)));
  m.loss = m.loss_d();
  // Surfaces any error from the setup above here.
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.s()));
  return ClassifierEngine(std::move(impl));
}

ClassifierEngine::ClassifierEngine(std::unique_ptr<Impl> impl) : Engine(std::move(impl)) {}
ClassifierEngine::Impl& ClassifierEngine::impl() const { return static_cast<Impl&>(state()); }

std::string_view ClassifierEngine::name() const { return impl().name; }
int ClassifierEngine::max_batch() const { return impl().max_batch; }
size_t ClassifierEngine::activation_bytes() const { return impl().activation_buffer.size(); }

// ------------------------------------------------------------- parameters

Status ClassifierEngine::Initialize(uint64_t seed) {
  const Impl& m = impl();
  // The CPU model draws them: one implementation of the init, the same bits.
  ESTUARY_ASSIGN_OR_RETURN(std::unique_ptr<Model> cpu, MakeModel(m.name));
  if (!(cpu->manifest() == m.manifest)) {
    return Internal("cuda classifier: the engine's '{}' manifest differs from models::MakeModel's", m.name);
  }
  cpu->Initialize(seed);
  return CopyParametersFrom(cpu->parameters());
}

// ------------------------------------------------------------------ layers

Status ClassifierEngine::Impl::CheckInput(const float* x, const int32_t* y, int64_t n, bool batch_bound) const {
  if (n < 1 || (batch_bound && n > max_batch)) {
    return InvalidArgument("cuda classifier {}: batch of {} examples is outside [1, {}] (max_batch given at Create)",
                           name, n, max_batch);
  }
  if (!x) return InvalidArgument("cuda classifier {}: no features given (x is null)", name);
  if (y) {
    for (int64_t i = 0; i < n; ++i) {
      if (y[i] < 0 || y[i] >= kClasses) {
        return InvalidArgument("cuda classifier {}: label {} of example {} is outside [0, {})", name, y[i], i,
                               kClasses);
      }
    }
  }
  return Status::Ok();
}

Status ClassifierEngine::Impl::Upload(const float* x, const int32_t* y, int n) {
  Carve(n, activation_buffer.as<char>());
  // The previous upload must have left the staging buffer before it is refilled.
  if (staging_used) ESTUARY_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(staging_free.get()));
  const size_t x_bytes = size_t(n) * kInput * sizeof(float), y_bytes = size_t(n) * sizeof(int32_t);
  std::memcpy(staging.as<char>(), x, x_bytes);
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(acts.x, staging.as<char>(), x_bytes, cudaMemcpyHostToDevice, s()));
  if (y) {
    std::memcpy(staging.as<char>() + staging_y_offset(), y, y_bytes);
    ESTUARY_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(acts.y, staging.as<char>() + staging_y_offset(), y_bytes, cudaMemcpyHostToDevice, s()));
  }
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaEventRecord(staging_free.get(), s()));
  staging_used = true;
  return Status::Ok();
}

Status ClassifierEngine::Impl::Lower(const float* src, void* lo, int64_t count) {
  if (!low()) return Status::Ok();
  return Convert(src, DType::kF32, lo, act(), count, s());
}

Status ClassifierEngine::Impl::LinearForward(const LinearLayer& l, const void* x, int n, float* y) {
  ESTUARY_RETURN_IF_ERROR(BroadcastBias(P() + l.b, n, l.out, 1, y, s()));
  return Gemm(blas, false, true, n, l.out, l.in, 1.0f, x, l.in, W(l.w), l.in, 1.0f, y, l.out, ToF32());
}

// dW = dy^T x, db = sum_n dy, dx = dy W (when dx is not null); x is the GEMM
// input kept from the forward pass (bf16 under bf16).
Status ClassifierEngine::Impl::LinearBackward(const LinearLayer& l, const void* x, const float* dy, int n,
                                              float* dx) {
  ESTUARY_RETURN_IF_ERROR(Lower(dy, acts.dy_lo, int64_t(n) * l.out));
  const void* dy_in = In(dy, acts.dy_lo);
  ESTUARY_RETURN_IF_ERROR(
      Gemm(blas, true, false, l.out, l.in, n, 1.0f, dy_in, l.out, x, l.in, 0.0f, G() + l.w, l.in, ToF32()));
  ESTUARY_RETURN_IF_ERROR(BiasGradient(dy, n, l.out, 1, G() + l.b, s()));
  if (!dx) return Status::Ok();
  return Gemm(blas, false, false, n, l.in, l.out, 1.0f, dy_in, l.out, W(l.w), l.in, 0.0f, dx, l.in, ToF32());
}

// The whole batch unfolded at once, then y_i = W cols_i + b for every image i
// in one strided-batched GEMM (W shared: stride 0).
Status ClassifierEngine::Impl::ConvForward(const ConvLayer& c, const float* x, int n, float* cols, void* cols_lo,
                                           float* y) {
  const int64_t kdim = c.kdim(), hw = c.hw(), out = c.out_channels;
  ESTUARY_RETURN_IF_ERROR(Im2Col(x, c.shape(n), cols, s()));
  ESTUARY_RETURN_IF_ERROR(Lower(cols, cols_lo, n * kdim * hw));
  ESTUARY_RETURN_IF_ERROR(BroadcastBias(P() + c.b, n, out, hw, y, s()));
  return GemmStridedBatched(blas, false, false, out, hw, kdim, 1.0f, W(c.w), kdim, 0, In(cols, cols_lo), hw,
                            kdim * hw, 1.0f, y, hw, out * hw, n, ToF32());
}

// dW = sum_i dy_i cols_i^T (per image by one batched GEMM, then summed in
// image order), db = sum dy, and dx = Col2Im(W^T dy_i) for every image.
Status ClassifierEngine::Impl::ConvBackward(const ConvLayer& c, const void* cols, const float* dy, int n, float* dx) {
  const int64_t kdim = c.kdim(), hw = c.hw(), out = c.out_channels;
  ESTUARY_RETURN_IF_ERROR(Lower(dy, acts.dy_lo, n * out * hw));
  const void* dy_in = In(dy, acts.dy_lo);
  ESTUARY_RETURN_IF_ERROR(GemmStridedBatched(blas, false, true, out, kdim, hw, 1.0f, dy_in, hw, out * hw, cols, hw,
                                             kdim * hw, 0.0f, acts.partials, kdim, out * kdim, n, ToF32()));
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::SumOverBatch(acts.partials, n, out * kdim, G() + c.w, s()));
  ESTUARY_RETURN_IF_ERROR(BiasGradient(dy, n, out, hw, G() + c.b, s()));
  if (!dx) return Status::Ok();
  ESTUARY_RETURN_IF_ERROR(GemmStridedBatched(blas, true, false, kdim, hw, out, 1.0f, W(c.w), kdim, 0, dy_in, hw,
                                             out * hw, 0.0f, acts.dcol, hw, kdim * hw, n, ToF32()));
  return Col2Im(acts.dcol, c.shape(n), dx, s());
}

Status ClassifierEngine::Impl::RunForward(int n) {
  const Activations& a = acts;
  if (!cnn) {
    ESTUARY_RETURN_IF_ERROR(Lower(a.x, a.x_lo, int64_t(n) * kInput));
    ESTUARY_RETURN_IF_ERROR(LinearForward(fc1, In(a.x, a.x_lo), n, a.h1));
    ESTUARY_RETURN_IF_ERROR(ReluForward(a.h1, int64_t(n) * 200, s()));
    ESTUARY_RETURN_IF_ERROR(Lower(a.h1, a.h1_lo, int64_t(n) * 200));
    ESTUARY_RETURN_IF_ERROR(LinearForward(fc2, In(a.h1, a.h1_lo), n, a.h2));
    ESTUARY_RETURN_IF_ERROR(ReluForward(a.h2, int64_t(n) * 200, s()));
    ESTUARY_RETURN_IF_ERROR(Lower(a.h2, a.h2_lo, int64_t(n) * 200));
    return LinearForward(fc3, In(a.h2, a.h2_lo), n, a.logits);
  }
  ESTUARY_RETURN_IF_ERROR(ConvForward(conv1, a.x, n, a.cols1, a.cols1_lo, a.c1));
  ESTUARY_RETURN_IF_ERROR(ReluForward(a.c1, int64_t(n) * 32 * 784, s()));
  ESTUARY_RETURN_IF_ERROR(MaxPool2Forward(a.c1, n, 32, 28, 28, a.p1, a.arg1, s()));
  ESTUARY_RETURN_IF_ERROR(ConvForward(conv2, a.p1, n, a.cols2, a.cols2_lo, a.c2));
  ESTUARY_RETURN_IF_ERROR(ReluForward(a.c2, int64_t(n) * 64 * 196, s()));
  // [n, 64, 7, 7] is already PyTorch's flatten order for fc1.
  ESTUARY_RETURN_IF_ERROR(MaxPool2Forward(a.c2, n, 64, 14, 14, a.p2, a.arg2, s()));
  ESTUARY_RETURN_IF_ERROR(Lower(a.p2, a.p2_lo, int64_t(n) * 3136));
  ESTUARY_RETURN_IF_ERROR(LinearForward(fc1, In(a.p2, a.p2_lo), n, a.f1));
  ESTUARY_RETURN_IF_ERROR(ReluForward(a.f1, int64_t(n) * 512, s()));
  ESTUARY_RETURN_IF_ERROR(Lower(a.f1, a.f1_lo, int64_t(n) * 512));
  return LinearForward(fc2, In(a.f1, a.f1_lo), n, a.logits);
}

// Each layer's gradients are final once its backward is enqueued: the hook
// reports its first offset (the units are the layers, in buffer order).
Status ClassifierEngine::Impl::RunBackward(int n, const BackwardOptions& options) {
  StepHooks& hooks = options.hooks ? *options.hooks : StepHooks::None();
  const Activations& a = acts;
  scratch.Reset();  // its last user is on this stream, ahead of this one
  ESTUARY_RETURN_IF_ERROR(SoftmaxCrossEntropy(a.logits, a.y, n, kClasses, a.dlogits, loss_d(), nullptr, scratch, s(),
                                              options.grad_scale));
  if (!cnn) {
    ESTUARY_RETURN_IF_ERROR(LinearBackward(fc3, In(a.h2, a.h2_lo), a.dlogits, n, a.dh2));
    hooks.GradientsFinal(fc3.w);
    ESTUARY_RETURN_IF_ERROR(ReluBackward(a.h2, a.dh2, int64_t(n) * 200, s()));
    ESTUARY_RETURN_IF_ERROR(LinearBackward(fc2, In(a.h1, a.h1_lo), a.dh2, n, a.dh1));
    hooks.GradientsFinal(fc2.w);
    ESTUARY_RETURN_IF_ERROR(ReluBackward(a.h1, a.dh1, int64_t(n) * 200, s()));
    ESTUARY_RETURN_IF_ERROR(LinearBackward(fc1, In(a.x, a.x_lo), a.dh1, n, nullptr));
    hooks.GradientsFinal(0);
    return Status::Ok();
  }
  ESTUARY_RETURN_IF_ERROR(LinearBackward(fc2, In(a.f1, a.f1_lo), a.dlogits, n, a.df1));
  hooks.GradientsFinal(fc2.w);
  ESTUARY_RETURN_IF_ERROR(ReluBackward(a.f1, a.df1, int64_t(n) * 512, s()));
  ESTUARY_RETURN_IF_ERROR(LinearBackward(fc1, In(a.p2, a.p2_lo), a.df1, n, a.dp2));
  hooks.GradientsFinal(fc1.w);
  ESTUARY_RETURN_IF_ERROR(MaxPool2Backward(a.dp2, a.arg2, n, 64, 14, 14, a.dc2, s()));
  ESTUARY_RETURN_IF_ERROR(ReluBackward(a.c2, a.dc2, int64_t(n) * 64 * 196, s()));
  ESTUARY_RETURN_IF_ERROR(ConvBackward(conv2, In(a.cols2, a.cols2_lo), a.dc2, n, a.dp1));
  hooks.GradientsFinal(conv2.w);
  ESTUARY_RETURN_IF_ERROR(MaxPool2Backward(a.dp1, a.arg1, n, 32, 28, 28, a.dc1, s()));
  ESTUARY_RETURN_IF_ERROR(ReluBackward(a.c1, a.dc1, int64_t(n) * 32 * 784, s()));
  ESTUARY_RETURN_IF_ERROR(ConvBackward(conv1, In(a.cols1, a.cols1_lo), a.dc1, n, nullptr));
  hooks.GradientsFinal(0);
  return Status::Ok();
}

// ---------------------------------------------------------------- training

Status ClassifierEngine::ForwardBackwardAsync(const float* x, const int32_t* y, int n) {
  return ForwardBackwardAsync(x, y, n, BackwardOptions{});
}

Status ClassifierEngine::ForwardBackwardAsync(const float* x, const int32_t* y, int n,
                                              const BackwardOptions& options) {
  Impl& m = impl();
  if (!y) return InvalidArgument("cuda classifier {}: no labels given (y is null)", m.name);
  ESTUARY_RETURN_IF_ERROR(m.CheckBackwardOptions(options));
  ESTUARY_RETURN_IF_ERROR(m.CheckInput(x, y, n, true));
  ESTUARY_RETURN_IF_ERROR(m.Upload(x, y, n));
  ESTUARY_RETURN_IF_ERROR(m.RunForward(n));
  return m.RunBackward(n, options);
}

Result<float> ClassifierEngine::ForwardBackward(const float* x, const int32_t* y, int n) {
  ESTUARY_RETURN_IF_ERROR(ForwardBackwardAsync(x, y, n));
  return ReadLoss();
}

Status ClassifierEngine::Forward(const float* x, int n, float* logits) {
  Impl& m = impl();
  ESTUARY_RETURN_IF_ERROR(m.CheckInput(x, nullptr, n, true));
  if (!logits) return InvalidArgument("cuda classifier {}: no logits buffer given", m.name);
  ESTUARY_RETURN_IF_ERROR(m.Upload(x, nullptr, n));
  ESTUARY_RETURN_IF_ERROR(m.RunForward(n));
  return CopyToHost(logits, m.acts.logits, size_t(n) * kClasses * sizeof(float), m.s());
}

Result<EvalResult> ClassifierEngine::Evaluate(const float* x, const int32_t* y, uint64_t n) {
  Impl& m = impl();
  EvalResult result;
  if (n == 0) return result;  // as models::Evaluate: nothing to average
  if (!y) return InvalidArgument("cuda classifier {}: no labels given (y is null)", m.name);
  // Every label is checked before the first batch runs, so a bad one fails
  // the call without a partial result.
  if (n > uint64_t(INT64_MAX) / kInput) {
    return InvalidArgument("cuda classifier {}: {} examples cannot be addressed", m.name, n);
  }
  ESTUARY_RETURN_IF_ERROR(m.CheckInput(x, y, int64_t(n), false));
  ESTUARY_RETURN_IF_ERROR(FillBytes(m.correct_d(), 0, sizeof(int64_t), m.s()));
  double loss = 0;
  for (uint64_t begin = 0; begin < n; begin += uint64_t(m.max_batch)) {
    const int b = int(std::min<uint64_t>(uint64_t(m.max_batch), n - begin));
    ESTUARY_RETURN_IF_ERROR(m.Upload(x + begin * kInput, y + begin, b));
    ESTUARY_RETURN_IF_ERROR(m.RunForward(b));
    m.scratch.Reset();
    ESTUARY_RETURN_IF_ERROR(
        SoftmaxCrossEntropy(m.acts.logits, m.acts.y, b, kClasses, nullptr, m.loss_d(), m.correct_d(), m.scratch,
                            m.s()));
    // Weighted by the batch's size in double, as models::Evaluate combines
    // its batches; the read is also what lets the next upload proceed.
    ESTUARY_ASSIGN_OR_RETURN(const float batch_loss, ReadLoss());
    loss += double(batch_loss) * b;
  }
  int64_t correct = 0;
  ESTUARY_RETURN_IF_ERROR(CopyToHost(&correct, m.correct_d(), sizeof correct, m.s()));
  result.examples = n;
  result.loss = loss / double(n);
  result.accuracy = double(correct) / double(n);
  return result;
}

Status ClassifierEngine::Step(Sgd& optimizer) { return Engine::Step(optimizer).status(); }
Status ClassifierEngine::Step(AdamW& optimizer) { return Engine::Step(optimizer).status(); }

}  // namespace estuary::models::cuda
