// LmBackend: one thread's language model on one device, as TextTrainer drives
// it: load the round's global weights with a fresh optimizer, take steps,
// hand back the local weights. The CPU backend is models::Llama; the CUDA one
// is models::cuda::LlamaEngine (lm_backend_cuda.cc, built with nvcc).
// Backends are per-thread workspaces, reused across rounds and clients.
#pragma once

#include <span>
#include <string>

#include "base/status.h"
#include "client/compute.h"
#include "client/trainer.h"
#include "models/tensor.h"

namespace estuary::client {

class LmBackend {
 public:
  virtual ~LmBackend() = default;
  virtual const Manifest& manifest() const = 0;
  virtual int max_seq_len() const = 0;
  // Loads `global` and starts the task's optimizer afresh.
  virtual Status Begin(std::span<const float> global, const TaskConfig& task) = 0;
  // Forward, backward and one optimizer step; returns the batch's mean loss.
  virtual Result<float> Step(const int32_t* tokens, const int32_t* targets, int batch, int seq) = 0;
  // Writes the local weights.
  virtual Status Finish(std::span<float> local) = 0;
};

// This thread's backend for (model, batch, compute).
Result<LmBackend*> ThreadLmBackend(const std::string& model, int batch, const Compute& compute);

// The CUDA backend; an error naming the reason in a build without CUDA.
Result<LmBackend*> ThreadCudaLmBackend(const std::string& model, int batch, const Compute& compute);

}  // namespace estuary::client
