// For the GPU benchmarks. NoUsableGpu says why there is no GPU to measure
// on, if there is none; the benchmark then says so and exits 0
// (Bench::NothingMeasured): nothing is wrong with it, and scripts/gpu-check
// reads "no usable GPU" in that line. LlamaTraining is the decoder engine
// with the optimizer the decoder benchmarks train it with.
#pragma once

#include <fmt/format.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "models/cuda/device.h"
#include "models/cuda/llama_engine.h"
#include "models/cuda/optimizer.h"
#include "models/llama.h"
#include "models/optimizer.h"

namespace estuary::bench {

inline std::optional<std::string> NoUsableGpu() {
  const Status usable = models::cuda::CudaUsable();
  if (usable.ok()) return std::nullopt;
  return fmt::format("no usable GPU: {}", usable.message());
}

// The AdamW the decoder benchmarks train with: torch's defaults but lr 3e-4.
inline models::AdamWOptions DecoderAdamW() {
  models::AdamWOptions options;
  options.lr = 3e-4f;
  return options;
}

struct LlamaTraining {
  models::cuda::LlamaEngine engine;
  models::cuda::AdamW adamw;

  // The engine options the benchmarks set, the rest left at the engine's
  // defaults. (A designated initializer of LlamaEngineOptions itself warns
  // under -Wextra: its loss_scaler has no default member initializer.)
  struct Options {
    DType precision = DType::kBF16;
    bool flash_attention = true;  // the engine's default
    cudaStream_t stream = nullptr;  // null: the engine's own
    // The weights to start from; null: drawn from seed 1 (on the host, which
    // for a billion weights takes longer than the steps a benchmark times).
    const std::vector<float>* weights = nullptr;
    bool recompute = false;
  };

  // The engine with its weights, and DecoderAdamW() over all its parameters
  // on its stream.
  static Result<LlamaTraining> Create(const models::LlamaConfig& c, int batch, const Options& o) {
    models::cuda::LlamaEngineOptions options;
    options.precision = o.precision;
    options.flash_attention = o.flash_attention;
    options.stream = o.stream;
    options.recompute = o.recompute;
    ESTUARY_ASSIGN_OR_RETURN(models::cuda::LlamaEngine engine, models::cuda::LlamaEngine::Create(c, batch, options));
    ESTUARY_RETURN_IF_ERROR(o.weights ? engine.CopyParametersFrom(*o.weights) : engine.Initialize(1));
    ESTUARY_ASSIGN_OR_RETURN(models::cuda::AdamW adamw,
                             models::cuda::AdamW::Create(engine.parameter_count(), DecoderAdamW(), engine.stream()));
    return LlamaTraining{std::move(engine), std::move(adamw)};
  }
};

}  // namespace estuary::bench
