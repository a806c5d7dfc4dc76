#include "parallel/data_parallel.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "parallel/buffer_ops.h"
#include "models/flat_buffer.h"

namespace estuary::parallel {

namespace {

using Clock = std::chrono::steady_clock;

// ZeRO-2/3 keep at most this many buckets' reductions in flight before
// waiting for the oldest and handing its gradient pages back: bounds the
// gradient memory of a step without serialising backward on each bucket.
constexpr size_t kReductionsInFlight = 4;

}  // namespace

std::string_view ZeroStageName(ZeroStage stage) {
  switch (stage) {
    case ZeroStage::kDdp: return "ddp";
    case ZeroStage::kZero1: return "zero1";
    case ZeroStage::kZero2: return "zero2";
    case ZeroStage::kZero3: return "zero3";
  }
  return "unknown";
}

// A slice [begin, end) of the flat buffers and the collectives on it. Under
// ZeRO it is cut into size() pieces of `piece` elements, laid end to end from
// begin, plus a remainder of fewer than size() elements after them, one
// element per rank below it: rank r owns [begin + r piece, begin + (r+1) piece)
// and, when r < remainder, element begin + size() piece + r. Its pieces sit at
// `shard` in the shard buffers, the remainder's slot (0 when it has none)
// right after the main piece. The main piece goes through the collectives in
// place; only the remainder passes through the two small staging arrays.
struct DataParallel::Bucket {
  uint64_t begin = 0, end = 0;
  uint64_t piece = 0, remainder = 0;
  uint64_t shard = 0;
  std::shared_ptr<float> tails;                  // reduce_tail then gather_tail, when remainder > 0
  float* reduce_tail = nullptr;                  // size() floats each
  float* gather_tail = nullptr;
  std::unique_ptr<comm::Work> reduce, reduce_rest, gather, gather_rest;
  bool present = true;  // ZeRO-3: the parameters are in the flat buffer

  uint64_t shard_size() const { return piece + (remainder > 0 ? 1 : 0); }
};

DataParallel::DataParallel(comm::Communicator& comm, std::span<float> parameters, std::span<float> gradients,
                           std::vector<models::ParameterUnit> units, const DataParallelOptions& options)
    : comm_(comm),
      rank_(comm.rank()),
      size_(comm.size()),
      params_(parameters),
      grads_(gradients),
      units_(std::move(units)),
      options_(options) {
  if (options_.loss_scaler) scaler_.emplace(*options_.loss_scaler);
}

DataParallel::~DataParallel() {
  // A Work may still be writing into our buffers; let it end first.
  for (Bucket& b : buckets_) {
    for (auto* w : {&b.reduce, &b.reduce_rest, &b.gather, &b.gather_rest}) {
      if (*w) (void)(*w)->Wait();
    }
  }
}

Result<std::unique_ptr<DataParallel>> DataParallel::Create(comm::Communicator& comm, std::span<float> parameters,
                                                           std::span<float> gradients,
                                                           std::vector<models::ParameterUnit> units,
                                                           const DataParallelOptions& options) {
  if (parameters.size() != gradients.size()) {
    return InvalidArgument("data parallel: {} parameters but {} gradients", parameters.size(), gradients.size());
  }
  if (parameters.empty()) return InvalidArgument("data parallel: the model has no parameters");
  if (options.bucket_bytes < sizeof(float) || options.first_bucket_bytes < sizeof(float)) {
    return InvalidArgument("data parallel: bucket sizes {} and {} bytes hold no gradient", options.bucket_bytes,
                           options.first_bucket_bytes);
  }
  if (!(options.proximal_mu >= 0) || !std::isfinite(options.proximal_mu)) {
    return InvalidArgument("data parallel: proximal_mu {} must be finite and >= 0", options.proximal_mu);
  }
  if (!options.control.empty() || !options.site_control.empty()) {
    if (options.control.size() != parameters.size() || options.site_control.size() != parameters.size()) {
      return InvalidArgument("data parallel: control variates of {} and {} values for {} parameters",
                             options.control.size(), options.site_control.size(), parameters.size());
    }
    if (comm.device() != Device::kCpu || comm.size() != 1 || options.stage != ZeroStage::kDdp) {
      return InvalidArgument("data parallel: SCAFFOLD's gradient correction runs on a site of one CPU rank under "
                             "DDP for now; this one has {} {} rank(s) under {}",
                             comm.size(), comm.backend(), ZeroStageName(options.stage));
    }
  }
  if (options.max_grad_norm < 0 || !std::isfinite(options.max_grad_norm)) {
    return InvalidArgument("data parallel: max_grad_norm {} must be finite and >= 0", options.max_grad_norm);
  }
  std::unique_ptr<BufferOps> ops;
  if (comm.device() == Device::kCpu) {
    ops = MakeHostBufferOps();
  } else {
    // ZeRO-2 and -3 hand pages of the flat buffers back to the OS between
    // uses; one cudaMalloc'd buffer cannot give back part of itself.
    if (options.stage == ZeroStage::kZero2 || options.stage == ZeroStage::kZero3) {
      return InvalidArgument("data parallel: {} releases pages of the flat buffers, which device ({}) buffers cannot; "
                             "GPU buffers run DDP or ZeRO-1 only (--zero 0|1)",
                             ZeroStageName(options.stage), comm.backend());
    }
    ESTUARY_ASSIGN_OR_RETURN(ops, MakeCudaBufferOps(options.device_stream));
  }
  if (units.empty()) units.push_back({"all", 0, parameters.size()});
  uint64_t at = 0;
  for (const auto& u : units) {
    if (u.begin != at || u.end <= u.begin) {
      return InvalidArgument("data parallel: unit {} [{}, {}) does not continue the tiling at {}", u.name, u.begin,
                             u.end, at);
    }
    at = u.end;
  }
  if (at != parameters.size()) {
    return InvalidArgument("data parallel: units end at {}, the buffer at {}", at, parameters.size());
  }
  std::unique_ptr<DataParallel> dp(new DataParallel(comm, parameters, gradients, std::move(units), options));
  dp->ops_ = std::move(ops);
  ESTUARY_RETURN_IF_ERROR(dp->Init());
  return dp;
}

Status DataParallel::Init() {
  ESTUARY_RETURN_IF_ERROR(InitBuffers());
  if (options_.proximal_mu == 0) return Status::Ok();
  ESTUARY_ASSIGN_OR_RETURN(anchor_, ops_->Allocate(models::SliceElements(slices_)));
  size_t at = 0;
  for (const models::ParameterSlice& s : slices_) {
    ESTUARY_RETURN_IF_ERROR(ops_->Copy(anchor_.get() + at, s.params, s.size));
    at += s.size;
  }
  return Status::Ok();
}

Status DataParallel::InitBuffers() {
  const bool zero = options_.stage != ZeroStage::kDdp;
  // Buckets, in launch order: from the end of the buffer down.
  if (options_.stage == ZeroStage::kZero3) {
    unit_bucket_.resize(units_.size());
    for (size_t i = units_.size(); i-- > 0;) {
      unit_bucket_[i] = int(buckets_.size());
      Bucket& b = buckets_.emplace_back();
      b.begin = units_[i].begin;
      b.end = units_[i].end;
    }
  } else {
    uint64_t end = params_.size();
    uint64_t floats = std::max<uint64_t>(1, options_.first_bucket_bytes / sizeof(float));
    while (end > 0) {
      Bucket& b = buckets_.emplace_back();
      b.end = end;
      b.begin = end > floats ? end - floats : 0;
      end = b.begin;
      floats = std::max<uint64_t>(1, options_.bucket_bytes / sizeof(float));
    }
  }
  if (zero) {
    uint64_t shard = 0;
    for (Bucket& b : buckets_) {
      const uint64_t n = b.end - b.begin;
      b.piece = n / size_;
      b.remainder = n - b.piece * size_;
      b.shard = shard;
      shard += b.shard_size();
      if (b.remainder > 0) {
        ESTUARY_ASSIGN_OR_RETURN(b.tails, ops_->Allocate(2 * size_t(size_)));
        b.reduce_tail = b.tails.get();
        b.gather_tail = b.tails.get() + size_;
      }
    }
    // ZeRO-1 reduces into the gradient buffer and steps the parameter
    // buffer where its pieces lie; ZeRO-2 releases the gradient pages, so its
    // reduced gradients need a home; ZeRO-3 releases both.
    if (options_.stage >= ZeroStage::kZero2) {
      ESTUARY_ASSIGN_OR_RETURN(shard_grads_owner_, ops_->Allocate(shard));
      shard_grads_ = {shard_grads_owner_.get(), shard};
    }
    if (options_.stage == ZeroStage::kZero3) {
      ESTUARY_ASSIGN_OR_RETURN(shard_params_owner_, ops_->Allocate(shard));
      shard_params_ = {shard_params_owner_.get(), shard};
    }
  }
  MakeSlices();
  ESTUARY_ASSIGN_OR_RETURN(agreed_, ops_->AllocateDoubles(2));

  if (options_.broadcast_parameters && size_ > 1) {
    auto work = comm_.Broadcast(params_, 0);
    ESTUARY_RETURN_IF_ERROR(Wait(work));
  }
  if (!zero) return Status::Ok();

  if (options_.stage >= ZeroStage::kZero2) {
    auto released = models::ReleasePages(grads_);
    if (!released.ok()) return released.status();
  }
  if (options_.stage == ZeroStage::kZero3) {
    // This rank's pieces become the only copy of its parameters.
    for (const Bucket& b : buckets_) {
      ESTUARY_RETURN_IF_ERROR(ops_->Copy(&shard_params_[b.shard], &params_[b.begin + rank_ * b.piece], b.piece));
      if (uint64_t(rank_) < b.remainder) {
        ESTUARY_RETURN_IF_ERROR(ops_->Copy(&shard_params_[b.shard + b.piece], &params_[b.begin + size_ * b.piece + rank_], 1));
      }
    }
    for (Bucket& b : buckets_) ReleaseParameters(b);
    ESTUARY_RETURN_IF_ERROR(error_);
  }
  return Status::Ok();
}

void DataParallel::MakeSlices() {
  auto add = [&](float* params, float* grads, size_t n) {
    slices_.push_back({params, grads, n});
    grad_pieces_.push_back({grads, n});
  };
  switch (options_.stage) {
    case ZeroStage::kDdp:
      return add(params_.data(), grads_.data(), params_.size());
    case ZeroStage::kZero3:
      // Ranks past a bucket's remainder step a zero gradient on a slot no
      // gather reads: one contiguous slice is worth it.
      return add(shard_params_.data(), shard_grads_.data(), shard_params_.size());
    case ZeroStage::kZero1:
    case ZeroStage::kZero2:
      break;
  }
  // The pieces where they lie in the parameter buffer; their reduced
  // gradients at the same offsets of the gradient buffer (ZeRO-1) or in the
  // shard (ZeRO-2).
  const bool in_buffer = options_.stage == ZeroStage::kZero1;
  for (const Bucket& b : buckets_) {
    const uint64_t main = b.begin + rank_ * b.piece, tail = b.begin + size_ * b.piece + rank_;
    if (b.piece > 0) add(&params_[main], in_buffer ? &grads_[main] : &shard_grads_[b.shard], b.piece);
    if (uint64_t(rank_) < b.remainder) {
      add(&params_[tail], in_buffer ? &grads_[tail] : &shard_grads_[b.shard + b.piece], 1);
    }
  }
}

std::vector<std::pair<uint64_t, uint64_t>> DataParallel::buckets() const {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (const Bucket& b : buckets_) out.emplace_back(b.begin, b.end);
  return out;
}

void DataParallel::Keep(Status status) {
  if (error_.ok() && !status.ok()) error_ = std::move(status);
}

Status DataParallel::Wait(std::unique_ptr<comm::Work>& work) {
  if (!work) return Status::Ok();
  const auto start = Clock::now();
  Status status = work->Wait();
  wait_seconds_ += std::chrono::duration<double>(Clock::now() - start).count();
  work.reset();
  if (!status.ok()) {
    status = Status(status.code(), fmt::format("data parallel rank {}: {}", rank_, status.message()));
  }
  Keep(status);
  return status;
}

// ---- gradients --------------------------------------------------------------

void DataParallel::LaunchReduction(Bucket& b) {
  if (!error_.ok()) return;  // the communicator fails everything from here on anyway
  if (options_.stage == ZeroStage::kDdp) {
    b.reduce = comm_.AllReduce(grads_.subspan(b.begin, b.end - b.begin), comm::ReduceOp::kSum);
    return;
  }
  // ZeRO-2/3 sum every micro-batch into the shard. Adding what the shard holds
  // into this rank's own block before the reduce-scatter does that with no
  // staging: the block's reduction is the sum of every rank's block, and only
  // this rank added its running sum to it.
  // ZeRO-1 reduces in place: this rank's block of the gradient buffer, and
  // its slot of the remainder's staging, receive the sums.
  const bool in_place = options_.stage == ZeroStage::kZero1;
  const bool add_shard = options_.stage >= ZeroStage::kZero2 && micro_ > 1;
  const uint64_t whole = b.piece * size_;
  if (b.piece > 0) {
    float* mine = &grads_[b.begin + rank_ * b.piece];
    if (add_shard) Keep(ops_->Add(mine, &shard_grads_[b.shard], b.piece));
    b.reduce = comm_.ReduceScatter(grads_.subspan(b.begin, whole),
                                   in_place ? std::span<float>(mine, b.piece) : shard_grads_.subspan(b.shard, b.piece),
                                   comm::ReduceOp::kSum);
  }
  if (b.remainder > 0) {
    Keep(ops_->Copy(b.reduce_tail, &grads_[b.begin + whole], b.remainder));
    Keep(ops_->Fill(b.reduce_tail + b.remainder, size_t(size_) - b.remainder, 0.0f));
    if (add_shard) Keep(ops_->Add(b.reduce_tail + rank_, &shard_grads_[b.shard + b.piece], 1));
    b.reduce_rest = comm_.ReduceScatter(std::span<const float>(b.reduce_tail, size_t(size_)),
                                        in_place ? std::span<float>(b.reduce_tail + rank_, 1)
                                                 : shard_grads_.subspan(b.shard + b.piece, 1),
                                        comm::ReduceOp::kSum);
  }
}

void DataParallel::FinishReduction(Bucket& b) {
  if (!b.reduce && !b.reduce_rest) return;
  const bool rest = b.reduce_rest != nullptr;
  (void)Wait(b.reduce);
  (void)Wait(b.reduce_rest);
  if (options_.stage == ZeroStage::kZero1 && rest && uint64_t(rank_) < b.remainder && error_.ok()) {
    Keep(ops_->Copy(&grads_[b.begin + size_ * b.piece + rank_], b.reduce_tail + rank_, 1));
  }
  // ZeRO-2/3 keep only the shard's gradients: this bucket's pages go back.
  if (options_.stage >= ZeroStage::kZero2) {
    auto released = models::ReleasePages(grads_.subspan(b.begin, b.end - b.begin));
    if (!released.ok()) Keep(released.status());
  }
}

void DataParallel::GradientsFinal(uint64_t offset) {
  if (!communicating_) return;
  while (next_reduction_ < buckets_.size() && buckets_[next_reduction_].begin >= offset) {
    LaunchReduction(buckets_[next_reduction_]);
    ++next_reduction_;
    if (options_.stage >= ZeroStage::kZero2 && next_reduction_ > kReductionsInFlight) {
      FinishReduction(buckets_[next_reduction_ - 1 - kReductionsInFlight]);
    }
  }
}

// ---- parameters (ZeRO) ------------------------------------------------------

void DataParallel::LaunchGather(Bucket& b) {
  if (!error_.ok()) return;
  // ZeRO-3 gathers from its shard; ZeRO-1/2 in place, from the pieces
  // their step just updated where they lie.
  const bool in_place = options_.stage != ZeroStage::kZero3;
  if (b.piece > 0) {
    std::span<const float> mine = in_place ? params_.subspan(b.begin + rank_ * b.piece, b.piece)
                                           : std::span<const float>(shard_params_).subspan(b.shard, b.piece);
    b.gather = comm_.AllGather(mine, params_.subspan(b.begin, b.piece * size_));
  }
  if (b.remainder > 0) {
    if (in_place && uint64_t(rank_) < b.remainder) {
      Keep(ops_->Copy(b.gather_tail + rank_, &params_[b.begin + size_ * b.piece + rank_], 1));
    }
    const std::span<const float> mine = in_place ? std::span<const float>(b.gather_tail + rank_, 1)
                                                 : std::span<const float>(shard_params_).subspan(b.shard + b.piece, 1);
    b.gather_rest = comm_.AllGather(mine, std::span<float>(b.gather_tail, size_t(size_)));
  }
}

void DataParallel::FinishGather(Bucket& b) {
  const bool rest = b.gather_rest != nullptr;
  (void)Wait(b.gather);
  (void)Wait(b.gather_rest);
  if (rest && error_.ok()) {
    Keep(ops_->Copy(&params_[b.begin + b.piece * size_], b.gather_tail, b.remainder));
  }
  b.present = true;
}

void DataParallel::ReleaseParameters(Bucket& b) {
  auto released = models::ReleasePages(params_.subspan(b.begin, b.end - b.begin));
  if (!released.ok()) Keep(released.status());
  b.present = false;
}

void DataParallel::BeforeUnit(int unit, models::Pass) {
  if (options_.stage != ZeroStage::kZero3) return;
  const size_t event = unit_event_++;
  if (recording_) unit_order_.push_back(unit);
  Bucket& b = buckets_[unit_bucket_[unit]];
  if (!b.present) {
    if (!b.gather && !b.gather_rest) LaunchGather(b);
    FinishGather(b);
  }
  // Prefetch the unit the model opens next; the order is the model's, the
  // same on every rank, so the ranks still issue the same collectives.
  if (!recording_ && event + 1 < unit_order_.size()) {
    Bucket& next = buckets_[unit_bucket_[unit_order_[event + 1]]];
    if (!next.present && !next.gather && !next.gather_rest) LaunchGather(next);
  }
}

void DataParallel::AfterUnit(int unit, models::Pass) {
  if (options_.stage != ZeroStage::kZero3) return;
  // Kept when it is also the next unit opened (backward's first is forward's last).
  if (!recording_ && unit_event_ < unit_order_.size() && unit_order_[unit_event_] == unit) return;
  ReleaseParameters(buckets_[unit_bucket_[unit]]);
}

// ---- the step ---------------------------------------------------------------

models::BackwardOptions DataParallel::MicroBatch(double weight, bool last) {
  if (micro_ > 0) {
    if (last_) Keep(FailedPrecondition("data parallel: a micro-batch after the last one, before Step"));
    Keep(FinishMicroBatch());
  }
  ++micro_;
  last_ = last;
  const bool zero23 = options_.stage >= ZeroStage::kZero2;
  communicating_ = last || zero23;
  next_reduction_ = 0;
  unit_event_ = 0;

  models::BackwardOptions o;
  // DDP and ZeRO-1 sum micro-batches in the gradient buffer; ZeRO-2/3 in the
  // shard (their gradient pages are gone after each reduce-scatter).
  o.accumulate = !zero23 && micro_ > 1;
  o.grad_scale = float(weight * (scaler_ ? double(scaler_->scale()) : 1.0));
  if (communicating_ || options_.stage == ZeroStage::kZero3) o.hooks = this;
  return o;
}

Status DataParallel::FinishMicroBatch() {
  // A model that did not report its gradients (no hooks passed) still gets
  // every bucket reduced, in the same order as everywhere else.
  if (communicating_) GradientsFinal(0);
  for (Bucket& b : buckets_) FinishReduction(b);
  if (options_.stage == ZeroStage::kZero3) {
    for (Bucket& b : buckets_) {
      if (b.gather || b.gather_rest) FinishGather(b);  // a prefetch nobody used
      if (b.present) ReleaseParameters(b);
    }
    if (unit_order_.empty()) {
      // Its parameters were released and never gathered: what it computed is wrong.
      Keep(FailedPrecondition("data parallel: ZeRO-3 needs a model that brackets its parameter reads "
                              "(BeforeUnit/AfterUnit); this one opened no unit"));
    }
    recording_ = false;
  }
  communicating_ = false;
  return error_;
}

Result<StepResult> DataParallel::Step(const OptimizerStep& optimizer_step) {
  if (micro_ == 0 || !last_) {
    return FailedPrecondition("data parallel: Step before the step's last micro-batch");
  }
  StepResult result;
  result.loss_scale = loss_scale();
  Keep(FinishMicroBatch());
  micro_ = 0;
  last_ = false;
  if (!error_.ok()) return error_;

  const bool zero = options_.stage != ZeroStage::kDdp;

  // Under DDP every rank holds the same reduced gradients, so found-inf and
  // the norm agree by construction; a shard sees only its part of them.
  double agreed[2] = {0, 0};  // found inf (as a count), norm²
  if (scaler_) {
    ESTUARY_ASSIGN_OR_RETURN(const bool found_inf, ops_->UnscaleAndCheckFinite(grad_pieces_, scaler_->inv_scale()));
    agreed[0] = found_inf ? 1 : 0;
  }
  if (anchor_) {
    size_t at = 0;
    for (size_t i = 0; i < slices_.size(); ++i) {  // grad_pieces_[i] is slices_[i]'s gradient
      const models::ParameterSlice& s = slices_[i];
      ESTUARY_RETURN_IF_ERROR(
          ops_->AddScaledDifference(grad_pieces_[i].data, s.params, anchor_.get() + at, s.size, options_.proximal_mu));
      at += s.size;
    }
  }
  if (!options_.control.empty()) {  // one CPU rank under DDP (Create): the slices are views of params_
    for (size_t i = 0; i < slices_.size(); ++i) {
      const size_t at = size_t(slices_[i].params - params_.data());
      ESTUARY_RETURN_IF_ERROR(ops_->AddScaledDifference(grad_pieces_[i].data, options_.control.data() + at,
                                                        options_.site_control.data() + at, slices_[i].size, 1.0f));
    }
  }
  if (options_.max_grad_norm > 0) {
    ESTUARY_ASSIGN_OR_RETURN(agreed[1], ops_->SumSquares(grad_pieces_));
  }
  if (zero && (scaler_ || options_.max_grad_norm > 0) && size_ > 1) {
    // Through agreed_, which lives where the communicator's buffers do.
    ESTUARY_RETURN_IF_ERROR(ops_->CopyDoubles(agreed_.get(), agreed, 2));
    auto work = comm_.AllReduce(std::span<double>(agreed_.get(), 2), comm::ReduceOp::kSum);
    ESTUARY_RETURN_IF_ERROR(Wait(work));
    ESTUARY_RETURN_IF_ERROR(ops_->CopyDoubles(agreed, agreed_.get(), 2));
  }
  if (scaler_) {
    const bool found_inf = agreed[0] > 0;
    scaler_->Update(found_inf);
    if (found_inf) {
      result.stepped = false;
      result.wait_seconds = std::exchange(wait_seconds_, 0);
      return result;
    }
  }
  if (options_.max_grad_norm > 0) {
    result.grad_norm = std::sqrt(agreed[1]);
    const double coef = options_.max_grad_norm / (result.grad_norm + 1e-6);
    if (coef < 1.0) {
      for (const BufferPiece& g : grad_pieces_) ESTUARY_RETURN_IF_ERROR(ops_->Scale(g.data, g.size, float(coef)));
    }
  }
  optimizer_step(slices_);

  if (options_.stage == ZeroStage::kZero1 || options_.stage == ZeroStage::kZero2) {
    for (Bucket& b : buckets_) LaunchGather(b);
    for (Bucket& b : buckets_) FinishGather(b);
  }
  result.wait_seconds = std::exchange(wait_seconds_, 0);
  if (!error_.ok()) return error_;
  return result;
}

// ---- reading out ------------------------------------------------------------

Status DataParallel::ForEachSlice(const std::function<Status(uint64_t, std::span<const float>)>& fn) {
  ESTUARY_RETURN_IF_ERROR(error_);
  if (options_.stage != ZeroStage::kZero3) {
    for (const auto& u : units_) ESTUARY_RETURN_IF_ERROR(fn(u.begin, params_.subspan(u.begin, u.end - u.begin)));
    return Status::Ok();
  }
  // Every rank runs the same gathers even if fn fails on one of them; the
  // first failure is returned after the last unit.
  Status first;
  for (size_t u = 0; u < units_.size(); ++u) {
    Bucket& b = buckets_[unit_bucket_[u]];
    if (!b.gather && !b.gather_rest) LaunchGather(b);
    FinishGather(b);
    if (u + 1 < units_.size()) {  // the next unit travels while fn reads this one
      Bucket& next = buckets_[unit_bucket_[u + 1]];
      if (!next.present && !next.gather && !next.gather_rest) LaunchGather(next);
    }
    if (first.ok() && error_.ok()) first = fn(b.begin, params_.subspan(b.begin, b.end - b.begin));
    ReleaseParameters(b);
  }
  wait_seconds_ = 0;
  ESTUARY_RETURN_IF_ERROR(error_);
  return first;
}

Result<double> DataParallel::SumOverRanks(double value) {
  ESTUARY_RETURN_IF_ERROR(error_);
  double v[1] = {value};
  if (size_ > 1) {
    auto work = comm_.AllReduce(std::span<double>(v), comm::ReduceOp::kSum);
    ESTUARY_RETURN_IF_ERROR(Wait(work));
  }
  return v[0];
}

Result<MemoryUse> DataParallel::Memory(size_t optimizer_state_bytes) const {
  if (comm_.device() != Device::kCpu) {
    return FailedPrecondition("data parallel: Memory counts resident host pages; these buffers are on the {} device",
                              comm_.backend());
  }
  MemoryUse m;
  auto params = models::ResidentBytes(std::span<const float>(params_));
  if (!params.ok()) return params.status();
  auto grads = models::ResidentBytes(std::span<const float>(grads_));
  if (!grads.ok()) return grads.status();
  m.parameters = *params;
  m.gradients = *grads;
  m.shard_parameters = shard_params_.size() * sizeof(float);
  m.shard_gradients = shard_grads_.size() * sizeof(float);
  m.optimizer_state = optimizer_state_bytes;
  for (const Bucket& b : buckets_) m.staging += b.tails ? 2 * size_t(size_) * sizeof(float) : 0;
  return m;
}

}  // namespace estuary::parallel
