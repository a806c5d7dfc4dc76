// bench/attention_gpu: causal attention alone on one GPU, the fused kernels
// (models/cuda/flash_attention.h) against the materialised path
// (transformer.h's AttentionForward/Backward: cuBLAS around a fused softmax,
// with its [batch, heads, seq, seq] scratch), forward and forward+backward.
//
// Shapes: the ~124M decoder's (batch 8, seq 1024, 12 heads, 12 kv heads) and
// a GQA one (batch 2, seq 2048, 32 heads, 8 kv heads), head_dim 64, bf16 by
// default. Each figure is the median of --steps timed calls (CUDA events
// around each call) after --warmup untimed ones.
//
// TFLOP/s counts causal work only: forward 2 products of 2 b h s² hd / 2
// flops, backward 2.5 times forward (five products against two), which is
// what FlashAttention's papers count; the materialised path computes the full
// square, so its figure is its useful rate, not its tensor cores' load.
//   build/bench/attention_gpu [--steps 20] [--warmup 3] [--precision bf16]
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cstdint>
#include <random>
#include <vector>

#include "base/cuda_status.h"
#include "bench/gpu.h"
#include "bench/harness.h"
#include "models/cuda/blas.h"
#include "models/cuda/device.h"
#include "models/cuda/flash_attention.h"
#include "models/cuda/transformer.h"
#include "models/precision.h"

namespace {

using namespace estuary;
using namespace estuary::models;

struct AttentionShape {
  const char* name;
  int batch, seq, heads, kv_heads, head_dim;
};

// Random 16-bit values in [-1, 1] (a softmax over such scores is neither flat nor one-hot).
Result<cuda::DeviceBuffer> RandomBuffer(int64_t count, DType dtype, uint32_t seed, cudaStream_t stream) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<uint16_t> host(count);
  for (uint16_t& v : host) v = dtype == DType::kBF16 ? FloatToBf16(u(rng)) : FloatToF16(u(rng));
  ESTUARY_ASSIGN_OR_RETURN(cuda::DeviceBuffer buffer, cuda::DeviceBuffer::Allocate(count * sizeof(uint16_t)));
  ESTUARY_RETURN_IF_ERROR(cuda::CopyToDevice(buffer.data(), host.data(), host.size() * sizeof(uint16_t), stream));
  return buffer;
}

// Times each call of `once` with a pair of CUDA events on `stream`.
class EventTimer {
 public:
  static Result<EventTimer> Create(cudaStream_t stream) {
    EventTimer timer(stream);
    ESTUARY_CUDA_RETURN_IF_ERROR(cudaEventCreate(&timer.start_));
    ESTUARY_CUDA_RETURN_IF_ERROR(cudaEventCreate(&timer.stop_));
    return timer;
  }
  EventTimer(EventTimer&& other) noexcept : stream_(other.stream_), start_(other.start_), stop_(other.stop_) {
    other.start_ = other.stop_ = nullptr;
  }
  EventTimer(const EventTimer&) = delete;
  ~EventTimer() {
    if (start_) cudaEventDestroy(start_);
    if (stop_) cudaEventDestroy(stop_);
  }

  Result<bench::Samples> Time(const bench::Repetitions& r, const std::function<Status()>& once) {
    for (int i = 0; i < r.warmup; ++i) ESTUARY_RETURN_IF_ERROR(once());
    bench::Samples seconds;
    for (int i = 0; i < r.timed; ++i) {
      ESTUARY_CUDA_RETURN_IF_ERROR(cudaEventRecord(start_, stream_));
      ESTUARY_RETURN_IF_ERROR(once());
      ESTUARY_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop_, stream_));
      ESTUARY_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop_));
      float ms = 0;
      ESTUARY_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start_, stop_));
      seconds.Add(ms * 1e-3);
    }
    return seconds;
  }

 private:
  explicit EventTimer(cudaStream_t stream) : stream_(stream) {}
  cudaStream_t stream_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

struct Times {
  double forward = 0, forward_backward = 0;  // median seconds
};

Status Measure(const AttentionShape& a, DType dtype, const bench::Repetitions& reps) {
  ESTUARY_ASSIGN_OR_RETURN(cuda::Stream stream, cuda::Stream::Create());
  ESTUARY_ASSIGN_OR_RETURN(cuda::Blas blas, cuda::Blas::Create(stream.get()));
  ESTUARY_ASSIGN_OR_RETURN(EventTimer timer, EventTimer::Create(stream.get()));
  const int64_t n = int64_t(a.batch) * a.seq;
  const int64_t width = int64_t(a.heads + 2 * a.kv_heads) * a.head_dim, out_width = int64_t(a.heads) * a.head_dim;
  const int64_t rows = int64_t(a.batch) * a.heads * a.seq, square = rows * a.seq;
  const size_t element = DTypeSize(dtype);
  ESTUARY_ASSIGN_OR_RETURN(cuda::DeviceBuffer qkv, RandomBuffer(n * width, dtype, 1, stream.get()));
  ESTUARY_ASSIGN_OR_RETURN(cuda::DeviceBuffer dout, RandomBuffer(n * out_width, dtype, 2, stream.get()));
  ESTUARY_ASSIGN_OR_RETURN(cuda::DeviceBuffer out, cuda::DeviceBuffer::Allocate(n * out_width * element));
  ESTUARY_ASSIGN_OR_RETURN(cuda::DeviceBuffer dqkv, cuda::DeviceBuffer::Allocate(n * width * element));
  Times fused, materialised;
  {
    ESTUARY_ASSIGN_OR_RETURN(cuda::DeviceBuffer lse, cuda::DeviceBuffer::Allocate(rows * sizeof(float)));
    ESTUARY_ASSIGN_OR_RETURN(cuda::DeviceBuffer delta, cuda::DeviceBuffer::Allocate(rows * sizeof(float)));
    auto forward = [&]() -> Status {
      return cuda::FlashAttentionForward(dtype, qkv.data(), a.batch, a.seq, a.heads, a.kv_heads, a.head_dim,
                                         out.data(), lse.as<float>(), stream.get());
    };
    auto forward_backward = [&]() -> Status {
      ESTUARY_RETURN_IF_ERROR(forward());
      return cuda::FlashAttentionBackward(dtype, qkv.data(), out.data(), dout.data(), lse.as<float>(), a.batch,
                                          a.seq, a.heads, a.kv_heads, a.head_dim, delta.as<float>(), dqkv.data(),
                                          stream.get());
    };
    ESTUARY_ASSIGN_OR_RETURN(const bench::Samples f, timer.Time(reps, forward));
    ESTUARY_ASSIGN_OR_RETURN(const bench::Samples fb, timer.Time(reps, forward_backward));
    fused = {f.median(), fb.median()};
  }
  {
    // The materialised path's scratch, as the engine holds it: fp32 scores
    // and dprobs, 16-bit probabilities and score gradients, all seq x seq.
    ESTUARY_ASSIGN_OR_RETURN(cuda::DeviceBuffer scores, cuda::DeviceBuffer::Allocate(square * sizeof(float)));
    ESTUARY_ASSIGN_OR_RETURN(cuda::DeviceBuffer probs, cuda::DeviceBuffer::Allocate(square * element));
    ESTUARY_ASSIGN_OR_RETURN(cuda::DeviceBuffer dprobs, cuda::DeviceBuffer::Allocate(square * sizeof(float)));
    ESTUARY_ASSIGN_OR_RETURN(cuda::DeviceBuffer dscores, cuda::DeviceBuffer::Allocate(square * element));
    auto forward = [&]() -> Status {
      return cuda::AttentionForward(blas, dtype, qkv.data(), a.batch, a.seq, a.heads, a.kv_heads, a.head_dim,
                                    scores.as<float>(), probs.data(), out.data());
    };
    auto forward_backward = [&]() -> Status {
      ESTUARY_RETURN_IF_ERROR(forward());
      return cuda::AttentionBackward(blas, dtype, qkv.data(), probs.data(), dout.data(), a.batch, a.seq, a.heads,
                                     a.kv_heads, a.head_dim, dprobs.as<float>(), dscores.data(), dqkv.data());
    };
    ESTUARY_ASSIGN_OR_RETURN(const bench::Samples f, timer.Time(reps, forward));
    ESTUARY_ASSIGN_OR_RETURN(const bench::Samples fb, timer.Time(reps, forward_backward));
    materialised = {f.median(), fb.median()};
  }

  const double forward_flops = 2.0 * 2.0 * a.batch * a.heads * double(a.seq) * a.seq * a.head_dim / 2.0;
  const double forward_backward_flops = forward_flops * 3.5;  // backward 2.5 x forward
  auto line = [&](const char* path, const char* pass, double seconds, double flops) {
    fmt::print("  {:<12} {:<17} {:8.3f} ms  {:6.1f} TFLOP/s\n", path, pass, seconds * 1e3, flops / seconds / 1e12);
  };
  fmt::print("{}: batch {} seq {} heads {}/{} head_dim {} {}, median of {}\n", a.name, a.batch, a.seq, a.heads,
             a.kv_heads, a.head_dim, DTypeName(dtype), reps.timed);
  line("fused", "forward", fused.forward, forward_flops);
  line("fused", "forward+backward", fused.forward_backward, forward_backward_flops);
  line("materialised", "forward", materialised.forward, forward_flops);
  line("materialised", "forward+backward", materialised.forward_backward, forward_backward_flops);
  bench::PrintRatio(fmt::format("materialised / fused, {} forward", a.name), materialised.forward / fused.forward);
  bench::PrintRatio(fmt::format("materialised / fused, {} forward+backward", a.name),
                    materialised.forward_backward / fused.forward_backward);
  return stream.Synchronize();
}

}  // namespace

int main(int argc, char** argv) {
  bench::Bench bench("attention_gpu", "Fused flash attention against the materialised path on one GPU");
  bench::Repetitions reps{.warmup = 3, .timed = 20};
  DType dtype = DType::kBF16;
  bench.AddRepetitions(reps);
  bench.AddPrecision(dtype, "bf16 or f16");
  if (auto code = bench.Parse(argc, argv)) return *code;
  if (dtype != DType::kBF16 && dtype != DType::kF16) {
    return bench.Fail(InvalidArgument("--precision {}: the fused kernels take bf16 or f16", DTypeName(dtype)));
  }
  if (auto why = bench::NoUsableGpu()) return bench.NothingMeasured(*why);
  for (const AttentionShape& shape : {AttentionShape{"llama-124m", 8, 1024, 12, 12, 64},
                                      AttentionShape{"gqa 32/8", 2, 2048, 32, 8, 64}}) {
    if (Status s = Measure(shape, dtype, reps); !s.ok()) return bench.Fail(s);
  }
  return 0;
}
