// DataParallel: one rank's side of a multi-rank training step — DDP and
// ZeRO stages 1 to 3 — written once against Communicator, over a model's flat
// parameter and gradient buffers (models/step_hooks.h says how a model meets
// it). A step on every rank is
//
//   for (int i = 0; i < k; ++i)   // micro-batches; weight = examples here / examples in the global batch
//     model.ForwardBackward(x[i], y[i], n[i], dp->MicroBatch(double(n[i]) / n_total, i == k - 1));
//   Result<StepResult> r = dp->Step([&](std::span<const models::ParameterSlice> s) { opt.Step(s); });
//
// Each rank's loss is the mean over its own examples; the gradient it forms is
// that of weight × mean (times the loss scale), and the ranks' gradients are
// SUMMED, so N ranks give one process's full-batch gradient even when the
// batch does not split evenly.
//
// Buckets are slices of the flat buffers, counted from the END (backward
// forms those gradients first): a small first bucket, then bucket_bytes each;
// a bucket's collective is launched from the GradientsFinal hook as soon as the
// watermark passes its start, so it overlaps the rest of backward. Under
// ZeRO-3 the model's units are the buckets. Sharding is FSDP-style: rank r
// owns piece r of every bucket (floor(size / N) elements, plus one element of
// the bucket's last size % N for ranks below that remainder). The optimizer
// steps a rank's pieces as one list of models::ParameterSlice (its state is
// 1/N, laid out piece after piece), where they lie: a rank holds no copy of
// what the formula does not count.
//
// - kDdp: gradients all-reduced; the optimizer steps the whole buffer on every
//   rank. With k micro-batches, nothing is communicated before the last.
// - kZero1: gradients reduce-scattered (on the last micro-batch) in place,
//   into this rank's pieces of the gradient buffer; the optimizer steps the
//   pieces of the parameter buffer; parameters are all-gathered in place.
// - kZero2: as kZero1, but every micro-batch is reduce-scattered and summed
//   into a shard of the gradients (this rank's pieces, end to end), and a
//   bucket's gradient pages go back to the OS once its reduce-scatter is done:
//   a rank holds the gradients of its pieces only.
// - kZero3: parameters are sharded too, into a shard like the gradients'
//   (the only copy of this rank's pieces). The flat parameter buffer is released;
//   BeforeUnit gathers a unit into it (the next unit's gather is prefetched
//   while this one computes) and AfterUnit releases it again. Parameters stay
//   sharded between steps; ForEachSlice reads them out unit by unit.
//
// After the last micro-batch, Step waits for the reductions, unscales and
// checks for inf/NaN (with a loss scaler), computes the global gradient norm
// (when clipping), agrees on both across ranks in one double all-reduce, and
// then — unless some rank found an overflow, in which case every rank skips
// the step and leaves every weight bit unchanged — clips and calls the
// optimizer step on the full buffer (DDP) or the shard (ZeRO).
//
// Buffers on a GPU (an NCCL communicator; options.device_stream names the
// model's stream): DDP and ZeRO-1. Everything DataParallel does to the buffers
// besides the collectives (parallel/buffer_ops.h: shard copies, the remainders'
// staging, unscale, norm, clipping) runs as kernels on that stream. ZeRO-2/3
// give pages of the flat buffers back to the OS between uses, which one
// cudaMalloc'd buffer cannot do, so Create refuses them for device buffers.
//
// Failure: hooks cannot stop a pass, so the first collective failure is kept
// and returned by Step (or the next call); the communicator fails every later
// call at once and bounds every wait by its timeout, so a dead rank makes the
// others fail, never hang. One DataParallel per model, used by the training
// thread only; every rank makes the same calls in the same order.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "parallel/buffer_ops.h"
#include "comm/communicator.h"
#include "models/loss_scaler.h"
#include "models/optimizer.h"
#include "models/step_hooks.h"

namespace estuary::parallel {

enum class ZeroStage { kDdp = 0, kZero1 = 1, kZero2 = 2, kZero3 = 3 };
// "ddp", "zero1", "zero2", "zero3".
std::string_view ZeroStageName(ZeroStage stage);

struct DataParallelOptions {
  ZeroStage stage = ZeroStage::kDdp;
  size_t bucket_bytes = size_t(25) << 20;
  size_t first_bucket_bytes = size_t(1) << 20;
  // Copy rank 0's parameters to every rank in Create. Off when every rank
  // already holds the same weights (a federated round's global model).
  bool broadcast_parameters = true;
  // Clip the global gradient norm to this (torch's clip_grad_norm_); 0: off.
  double max_grad_norm = 0;
  // Dynamic loss scaling (models::LossScaler's semantics); none: off.
  std::optional<models::LossScalerOptions> loss_scaler = std::nullopt;
  // FedProx (Li et al. 2020): μ of the proximal term μ/2 ‖w − w₀‖² added to
  // the local objective, w₀ the parameters at Create (the round's global
  // model). Each Step adds μ (w − w₀) to the reduced, unscaled gradients of
  // this rank's slices before clipping and the optimizer, as autograd would
  // through the loss; w₀ is kept for those slices only (1/N of P under ZeRO).
  // 0: off.
  float proximal_mu = 0;
  // SCAFFOLD (Karimireddy et al. 2020): the server's control variate c and
  // the site's c_i, over the whole flat layout, in host memory the caller
  // keeps alive until the round's last Step. Each Step adds (c - c_i) to
  // the reduced, unscaled gradients, after FedProx's term and before
  // clipping and the optimizer. Empty: off. For now a site of one CPU rank
  // under DDP only (Create refuses the rest).
  std::span<const float> control;
  std::span<const float> site_control;
  // Buffers on a GPU: the stream (a cudaStream_t) the model's kernels run on
  // and the communicator follows; DataParallel's own buffer work runs there.
  void* device_stream = nullptr;
};

struct StepResult {
  bool stepped = true;        // false: some rank found inf/NaN, the step was skipped everywhere
  double grad_norm = 0;       // the global norm before clipping (when clipping)
  float loss_scale = 1;       // the scale this step's gradients were formed with
  double wait_seconds = 0;    // training-thread time blocked on collectives this step (exposed communication)
};

// Bytes this rank holds, measured: resident pages of the flat buffers
// (mincore), sizes of the engine's own buffers, and the optimizer state the
// caller passes in (the optimizer owns it).
struct MemoryUse {
  size_t parameters = 0;       // resident bytes of the flat parameter buffer
  size_t gradients = 0;        // resident bytes of the flat gradient buffer
  size_t shard_parameters = 0; // this rank's pieces of the parameters (ZeRO)
  size_t shard_gradients = 0;  // this rank's pieces of the reduced gradients (ZeRO)
  size_t optimizer_state = 0;  // as passed to Memory()
  size_t staging = 0;          // the engine's small per-bucket remainder buffers
  size_t total() const {
    return parameters + gradients + shard_parameters + shard_gradients + optimizer_state + staging;
  }
};

class DataParallel : private models::StepHooks {
 public:
  // Steps the slices (models::AdamW::Step and models::Sgd::Step take them).
  using OptimizerStep = std::function<void(std::span<const models::ParameterSlice> slices)>;

  // parameters and gradients are the model's flat buffers (same layout, page
  // aligned for ZeRO-2/3's page release); units tile them in order. Under
  // ZeRO-3 the parameter buffer is released here (after the broadcast).
  // Collective: every rank calls it.
  static Result<std::unique_ptr<DataParallel>> Create(comm::Communicator& comm, std::span<float> parameters,
                                                      std::span<float> gradients,
                                                      std::vector<models::ParameterUnit> units,
                                                      const DataParallelOptions& options);
  // Any model with parameters(), gradients() and units() (models::Model, models::Llama).
  template <typename M>
  static Result<std::unique_ptr<DataParallel>> Create(comm::Communicator& comm, M& model, const DataParallelOptions& options) {
    return Create(comm, model.parameters(), model.gradients(), model.units(), options);
  }
  ~DataParallel() override;

  // The options for the next micro-batch's ForwardBackward. weight is its
  // examples on this rank over the examples of the whole global batch (all
  // ranks, all micro-batches); last marks the step's last micro-batch.
  models::BackwardOptions MicroBatch(double weight, bool last);

  // Finishes the step (see above). Fails on a collective failure, or if the
  // last micro-batch was not run.
  Result<StepResult> Step(const OptimizerStep& optimizer_step);

  // Hands out the full parameters in buffer order, one unit at a time:
  // fn(offset, values) with values the parameters at flat offsets
  // [offset, offset + size). Under ZeRO-3 each unit is gathered, handed out
  // and released, so the whole model never sits on one rank (collective:
  // every rank calls it); otherwise the slices are views of the buffer.
  Status ForEachSlice(const std::function<Status(uint64_t offset, std::span<const float> values)>& fn);

  // The sum of value over all ranks (a loss, an example count), in double.
  Result<double> SumOverRanks(double value);

  Result<MemoryUse> Memory(size_t optimizer_state_bytes = 0) const;

  ZeroStage stage() const { return options_.stage; }
  float loss_scale() const { return scaler_ ? scaler_->scale() : 1.0f; }
  // How many parameters this rank's optimizer steps: the whole buffer under
  // DDP, this rank's pieces under ZeRO (what its optimizer state holds).
  size_t shard_size() const { return models::SliceElements(slices_); }
  // [begin, end) of each bucket, in launch order (highest offsets first).
  std::vector<std::pair<uint64_t, uint64_t>> buckets() const;

 private:
  struct Bucket;
  DataParallel(comm::Communicator& comm, std::span<float> parameters, std::span<float> gradients,
               std::vector<models::ParameterUnit> units, const DataParallelOptions& options);
  Status Init();  // InitBuffers, then the proximal anchor
  Status InitBuffers();
  void MakeSlices();  // slices_ and grad_pieces_

  // StepHooks.
  void BeforeUnit(int unit, models::Pass pass) override;
  void AfterUnit(int unit, models::Pass pass) override;
  void GradientsFinal(uint64_t offset) override;

  void LaunchReduction(Bucket& b);
  void FinishReduction(Bucket& b);
  void LaunchGather(Bucket& b);
  void FinishGather(Bucket& b);
  void ReleaseParameters(Bucket& b);
  Status FinishMicroBatch();
  Status Wait(std::unique_ptr<comm::Work>& work);
  void Keep(Status status);

  comm::Communicator& comm_;
  const int rank_, size_;
  std::span<float> params_, grads_;
  std::vector<models::ParameterUnit> units_;
  DataParallelOptions options_;
  std::optional<models::LossScaler> scaler_;

  std::vector<Bucket> buckets_;           // launch order: descending offsets
  std::vector<int> unit_bucket_;          // ZeRO-3: unit -> bucket
  std::unique_ptr<BufferOps> ops_;            // how this engine touches its buffers (host or GPU)
  std::shared_ptr<float> shard_params_owner_, shard_grads_owner_;
  std::span<float> shard_params_, shard_grads_;   // ZeRO-3's parameters, ZeRO-2/3's gradients
  std::vector<models::ParameterSlice> slices_;       // what the optimizer steps
  BufferPieces grad_pieces_;                         // their gradients: unscaled, measured, clipped here
  std::shared_ptr<float> anchor_;  // FedProx: the slices' parameters as the step began, slice after slice
  std::shared_ptr<double> agreed_;           // found-inf and norm², where collectives can take them

  // The micro-batch in flight.
  int micro_ = 0;                // micro-batches run since the last step
  bool communicating_ = false;   // this micro-batch reduces its gradients
  bool last_ = false;            // ... and is the step's last
  size_t next_reduction_ = 0;    // the next bucket whose reduction GradientsFinal launches
  // ZeRO-3 prefetch: the order of BeforeUnit calls in a micro-batch, recorded
  // on the first one (it depends on the model only, so it is the same on
  // every rank) and used to gather the next unit while this one computes.
  std::vector<int> unit_order_;
  bool recording_ = true;
  size_t unit_event_ = 0;

  double wait_seconds_ = 0;
  Status error_;
};

}  // namespace estuary::parallel
