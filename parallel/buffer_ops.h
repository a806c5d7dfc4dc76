// BufferOps: how DataParallel touches memory beyond the collectives — its
// shard buffers, the remainders' staging, the shard's accumulation, unscale,
// norm and clipping, and the doubles it agrees on across ranks — on the device
// its buffers live on. Host loops for CPU ranks; for GPU ranks, kernels and
// copies on the model's stream, so they are ordered with the model's own work
// and, through it, with the collectives (which follow that stream). Calls that
// hand a value to the host (a norm, found-inf) wait for the stream; the rest
// only enqueue.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "base/status.h"

namespace estuary::parallel {

// n floats at data, on the buffers' device. (The .cu side is C++17: no std::span.)
struct BufferPiece {
  float* data = nullptr;
  size_t size = 0;
};
using BufferPieces = std::vector<BufferPiece>;

class BufferOps {
 public:
  virtual ~BufferOps() = default;
  // n zeroed floats (doubles) on this device, freed with the last owner.
  virtual Result<std::shared_ptr<float>> Allocate(size_t n) = 0;
  virtual Result<std::shared_ptr<double>> AllocateDoubles(size_t n) = 0;
  virtual Status Copy(float* dst, const float* src, size_t n) = 0;
  virtual Status Fill(float* dst, size_t n, float value) = 0;
  virtual Status Add(float* dst, const float* src, size_t n) = 0;  // dst += src
  virtual Status Scale(float* x, size_t n, float c) = 0;           // x *= c
  // dst += c * (a - b), each product in float as torch forms μ (w - w₀).
  virtual Status AddScaledDifference(float* dst, const float* a, const float* b, size_t n, float c) = 0;
  // The two below take all of a rank's pieces at once, so that a GPU hands
  // its answer to the host once per step, not once per piece.
  // The sum of x² over every piece, accumulated in double.
  virtual Result<double> SumSquares(const BufferPieces& pieces) = 0;
  // models::UnscaleAndCheckFinite over every piece: x *= inv_scale; true when
  // some x was inf or NaN.
  virtual Result<bool> UnscaleAndCheckFinite(const BufferPieces& pieces, float inv_scale) = 0;
  // Doubles between the host and this device's buffers (either way), waiting.
  virtual Status CopyDoubles(double* dst, const double* src, size_t n) = 0;
};

std::unique_ptr<BufferOps> MakeHostBufferOps();
// Kernels on `stream` (a cudaStream_t) of the current device; an error naming
// the reason in a build without CUDA.
Result<std::unique_ptr<BufferOps>> MakeCudaBufferOps(void* stream);

}  // namespace estuary::parallel
