// ClassifierBackend: one thread's image classifier on one device, as
// ClassifierTrainer drives it (the counterpart of lm_backend.h). The CPU
// backend is models::Model with plain SGD fused into backward when there is
// no momentum; the CUDA one is models::cuda::ClassifierEngine
// (classifier_backend_cuda.cc, built with nvcc).
#pragma once

#include <span>
#include <string>

#include "base/status.h"
#include "client/compute.h"
#include "client/trainer.h"
#include "models/tensor.h"

namespace estuary::client {

class ClassifierBackend {
 public:
  virtual ~ClassifierBackend() = default;
  virtual const Manifest& manifest() const = 0;
  virtual int input_size() const = 0;
  // Loads `global` and starts the task's SGD afresh.
  virtual Status Begin(std::span<const float> global, const TaskConfig& task) = 0;
  // Forward, backward and one SGD step on n examples; returns the mean loss.
  virtual Result<float> Step(const float* x, const int32_t* y, int n) = 0;
  virtual Status Finish(std::span<float> local) = 0;
};

// This thread's backend for (model, batch, compute).
Result<ClassifierBackend*> ThreadClassifierBackend(const std::string& model, int batch, const Compute& compute);
// The CUDA backend; an error naming the reason in a build without CUDA.
Result<ClassifierBackend*> ThreadCudaClassifierBackend(const std::string& model, int batch, const Compute& compute);

}  // namespace estuary::client
