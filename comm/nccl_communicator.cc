#include "comm/nccl_communicator.h"

#include <nccl.h>

#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "comm/nccl_kernels.h"
#include "comm/rendezvous.h"
#include "base/cuda_status.h"

namespace estuary::comm {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

Status NcclError(ncclResult_t result, ncclComm_t comm, const char* call, const char* file, int line) {
  const char* detail = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  return Internal("{}:{}: {} failed: {}{}{}", file, line, call, ncclGetErrorString(result),
                  detail != nullptr && *detail != '\0' ? ": " : "", detail != nullptr ? detail : "");
}

// A nonblocking communicator may answer ncclInProgress while it finishes a
// call in the background: poll until it settles or the deadline passes.
ncclResult_t Settle(ncclComm_t comm, ncclResult_t result, Clock::time_point deadline) {
  for (int spins = 0; result == ncclInProgress; ++spins) {
    if (Clock::now() > deadline) return ncclInProgress;
    if (spins < 1000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    if (ncclCommGetAsyncError(comm, &result) != ncclSuccess) return ncclInternalError;
  }
  return result;
}

}  // namespace
}  // namespace estuary::comm

// An NCCL call on the communicator's comm(), settled within its timeout(); a
// failure returns an internal-error Status naming file:line and the call.
#define ESTUARY_NCCL_RETURN_IF_ERROR(call)                                                                \
  do {                                                                                                    \
    const ncclResult_t estuary_nccl_ =                                                                    \
        ::estuary::comm::Settle(comm(), (call), std::chrono::steady_clock::now() + timeout());          \
    if (estuary_nccl_ != ncclSuccess)                                                                     \
      return ::estuary::comm::NcclError(estuary_nccl_, comm(), #call, __FILE__, __LINE__);              \
  } while (0)

namespace estuary::comm {
namespace {

// Host bytes on their way through the GPU; freed once their event has fired.
struct Staging {
  void* pinned = nullptr;
  ~Staging() {
    if (pinned != nullptr) cudaFreeHost(pinned);
  }
};

// Everything an operation's Work needs after the call returned; shared, so a
// Work may outlive its communicator.
class State {
 public:
  State(int device, int rank, int size, milliseconds timeout, cudaStream_t compute)
      : device_(device), rank_(rank), size_(size), timeout_(timeout), compute_(compute) {}
  ~State();

  Status Init(const ncclUniqueId& id, std::unique_ptr<Store> store);
  Status Failed() {
    std::lock_guard lock(mu_);
    return failed_;
  }
  // Records `status` as the communicator's failure and aborts NCCL.
  Status Fail(Status status);
  // Polls until `done` fires, NCCL reports an error, or the timeout passes.
  Status WaitFor(cudaEvent_t done, const std::string& what);

  int device_, rank_, size_;
  milliseconds timeout_;
  cudaStream_t compute_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;  // recorded on compute_, waited for by stream_
  float* scratch_ = nullptr;     // the barrier's one float
  ncclComm_t comm_ = nullptr;
  std::unique_ptr<Store> store_;
  // Staging buffers whose operation may still run, with the event that says it has not.
  std::deque<std::pair<cudaEvent_t, std::shared_ptr<Staging>>> staged_;

 private:
  std::mutex mu_;
  Status failed_;
};

Status State::Init(const ncclUniqueId& id, std::unique_ptr<Store> store) {
  store_ = std::move(store);
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaMalloc(&scratch_, sizeof(float)));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t started = ncclCommInitRankConfig(&comm_, size_, id, rank_, &config);
  if (started != ncclSuccess && started != ncclInProgress) {
    return NcclError(started, nullptr, "ncclCommInitRankConfig(&comm_, size_, id, rank_, &config)", __FILE__,
                     __LINE__);
  }
  const ncclResult_t joined = Settle(comm_, started, Clock::now() + timeout_);
  if (joined == ncclInProgress) {
    return Fail(Aborted("nccl: rank {} of {} on GPU {}: the communicator did not form within {} ms", rank_, size_,
                        device_, timeout_.count()));
  }
  if (joined != ncclSuccess) return Fail(NcclError(joined, comm_, "ncclCommInitRankConfig", __FILE__, __LINE__));
  return Status::Ok();
}

Status State::Fail(Status status) {
  std::lock_guard lock(mu_);
  if (failed_.ok()) failed_ = status;
  if (comm_ != nullptr) {
    // Abort ends this rank's kernels, so the stream drains and the peers see the failure.
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  return failed_;
}

Status State::WaitFor(cudaEvent_t done, const std::string& what) {
  const auto start = Clock::now();
  for (int spins = 0;; ++spins) {
    const cudaError_t query = cudaEventQuery(done);
    if (query == cudaSuccess) return Failed();
    if (query != cudaErrorNotReady) {
      return Fail(Internal("nccl {} on rank {} of {}: {}", what, rank_, size_,
                           CudaError(query, "cudaEventQuery(done)", __FILE__, __LINE__).message()));
    }
    Status peer_failure;
    {
      std::lock_guard lock(mu_);
      ncclResult_t async = ncclSuccess;
      if (comm_ != nullptr) ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        peer_failure = Aborted("nccl {} on rank {} of {}: {}", what, rank_, size_,
                               NcclError(async, comm_, "ncclCommGetAsyncError", __FILE__, __LINE__).message());
      }
    }
    if (!peer_failure.ok()) return Fail(peer_failure);
    if (!Failed().ok()) return Failed();
    if (Clock::now() - start > timeout_) {
      return Fail(Aborted("nccl {} on rank {} of {}: not done after {} ms (a peer died or stalled); aborted", what,
                          rank_, size_, timeout_.count()));
    }
    // NCCL reports a peer's failure only when asked: poll, gently once the
    // operation has clearly not finished at once.
    if (spins < 1000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

State::~State() {
  cudaSetDevice(device_);
  if (Failed().ok() && stream_ != nullptr) {
    // Let issued work finish (bounded), then leave NCCL cleanly; abort otherwise.
    cudaEvent_t drained = nullptr;
    if (cudaEventCreateWithFlags(&drained, cudaEventDisableTiming) == cudaSuccess) {
      if (cudaEventRecord(drained, stream_) != cudaSuccess || !WaitFor(drained, "shutdown").ok()) {
        (void)Fail(Aborted("shutdown"));
      }
      cudaEventDestroy(drained);
    }
  }
  if (comm_ != nullptr) {
    ncclResult_t result = ncclCommFinalize(comm_);
    if (Settle(comm_, result, Clock::now() + timeout_) == ncclSuccess) {
      ncclCommDestroy(comm_);
    } else {
      ncclCommAbort(comm_);
    }
    comm_ = nullptr;
  }
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  for (auto& [event, staging] : staged_) cudaEventDestroy(event);
  staged_.clear();
  if (scratch_ != nullptr) cudaFree(scratch_);
  if (ready_ != nullptr) cudaEventDestroy(ready_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<State> state, std::string what, cudaEvent_t done, std::function<void()> finish)
      : state_(std::move(state)), what_(std::move(what)), done_(done), finish_(std::move(finish)) {}
  explicit NcclWork(Status status) : status_(std::move(status)), waited_(true) {}
  ~NcclWork() override {
    if (done_ != nullptr) cudaEventDestroy(done_);  // legal while pending: the event is released once it fires
  }

  Status Wait() override {
    if (waited_) return status_;
    waited_ = true;
    status_ = state_->WaitFor(done_, what_);
    if (status_.ok() && finish_) finish_();
    return status_;
  }

 private:
  std::shared_ptr<State> state_;
  std::string what_;
  cudaEvent_t done_ = nullptr;
  std::function<void()> finish_;  // runs on the host once the operation is done
  Status status_;
  bool waited_ = false;
};

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(std::shared_ptr<State> state) : state_(std::move(state)) {}

  int rank() const override { return state_->rank_; }
  int size() const override { return state_->size_; }
  Device device() const override { return Device::kCuda; }
  std::string_view backend() const override { return "nccl"; }

  std::unique_ptr<Work> AllReduce(std::span<float> data, ReduceOp op) override {
    return AllReduceOf(data, op, ncclFloat, "float");
  }
  std::unique_ptr<Work> AllReduce(std::span<double> data, ReduceOp op) override {
    return AllReduceOf(data, op, ncclDouble, "double");
  }

  std::unique_ptr<Work> ReduceScatter(std::span<const float> in, std::span<float> out, ReduceOp op) override {
    const std::string what = fmt::format("reduce-scatter ({} -> {} floats)", in.size(), out.size());
    if (in.size() != out.size() * static_cast<size_t>(size())) {
      return Reject(what, InvalidArgument("the input holds {} floats, not size() x {}", in.size(), out.size()));
    }
    return Launch(what, {in.data(), out.data()}, out.empty(), [&]() -> Status {
      ESTUARY_NCCL_RETURN_IF_ERROR(
          ncclReduceScatter(in.data(), out.data(), out.size(), ncclFloat, ncclSum, comm(), stream()));
      if (op == ReduceOp::kAverage) {
        ESTUARY_CUDA_RETURN_IF_ERROR(
            internal::DivideInPlace(out.data(), out.size(), static_cast<float>(size()), stream()));
      }
      return Status::Ok();
    });
  }

  std::unique_ptr<Work> AllGather(std::span<const float> in, std::span<float> out) override {
    const std::string what = fmt::format("all-gather ({} -> {} floats)", in.size(), out.size());
    if (out.size() != in.size() * static_cast<size_t>(size())) {
      return Reject(what, InvalidArgument("the output holds {} floats, not size() x {}", out.size(), in.size()));
    }
    return Launch(what, {in.data(), out.data()}, in.empty(), [&]() -> Status {
      ESTUARY_NCCL_RETURN_IF_ERROR(ncclAllGather(in.data(), out.data(), in.size(), ncclFloat, comm(), stream()));
      return Status::Ok();
    });
  }

  std::unique_ptr<Work> Broadcast(std::span<float> data, int root) override {
    const std::string what = fmt::format("broadcast ({} floats from rank {})", data.size(), root);
    if (root < 0 || root >= size()) return Reject(what, InvalidArgument("no rank {} among {}", root, size()));
    return Launch(what, {data.data()}, data.empty(), [&]() -> Status {
      ESTUARY_NCCL_RETURN_IF_ERROR(
          ncclBroadcast(data.data(), data.data(), data.size(), ncclFloat, root, comm(), stream()));
      return Status::Ok();
    });
  }

  // Host bytes: copied into pinned memory now (on the root), up to the GPU,
  // broadcast, back down; Wait() copies them out to `data` on the others.
  std::unique_ptr<Work> Broadcast(std::span<std::byte> data, int root) override {
    const std::string what = fmt::format("broadcast ({} bytes from rank {})", data.size(), root);
    if (root < 0 || root >= size()) return Reject(what, InvalidArgument("no rank {} among {}", root, size()));
    auto staging = std::make_shared<Staging>();
    std::function<void()> finish;
    if (rank() != root) {
      finish = [staging, data] { std::memcpy(data.data(), staging->pinned, data.size()); };
    }
    return Launch(
        what, {}, data.empty(),
        [&]() -> Status {
          ESTUARY_CUDA_RETURN_IF_ERROR(cudaMallocHost(&staging->pinned, data.size()));
          if (rank() == root) std::memcpy(staging->pinned, data.data(), data.size());
          void* device = nullptr;
          ESTUARY_CUDA_RETURN_IF_ERROR(cudaMallocAsync(&device, data.size(), stream()));
          ESTUARY_CUDA_RETURN_IF_ERROR(
              cudaMemcpyAsync(device, staging->pinned, data.size(), cudaMemcpyHostToDevice, stream()));
          ESTUARY_NCCL_RETURN_IF_ERROR(ncclBroadcast(device, device, data.size(), ncclUint8, root, comm(), stream()));
          ESTUARY_CUDA_RETURN_IF_ERROR(
              cudaMemcpyAsync(staging->pinned, device, data.size(), cudaMemcpyDeviceToHost, stream()));
          ESTUARY_CUDA_RETURN_IF_ERROR(cudaFreeAsync(device, stream()));
          return Status::Ok();
        },
        std::move(finish), staging);
  }

  // NCCL has no barrier: an all-reduce of one float stands in for it.
  std::unique_ptr<Work> Barrier() override {
    return Launch("barrier", {}, false, [&]() -> Status {
      ESTUARY_NCCL_RETURN_IF_ERROR(ncclAllReduce(state_->scratch_, state_->scratch_, 1, ncclFloat, ncclSum, comm(), stream()));
      return Status::Ok();
    });
  }

 private:
  template <typename T>
  std::unique_ptr<Work> AllReduceOf(std::span<T> data, ReduceOp op, ncclDataType_t type, const char* name) {
    const std::string what = fmt::format("all-reduce ({} {}s)", data.size(), name);
    return Launch(what, {data.data()}, data.empty(), [&]() -> Status {
      ESTUARY_NCCL_RETURN_IF_ERROR(ncclAllReduce(data.data(), data.data(), data.size(), type, ncclSum, comm(), stream()));
      if (op == ReduceOp::kAverage) {
        ESTUARY_CUDA_RETURN_IF_ERROR(
            internal::DivideInPlace(data.data(), data.size(), static_cast<T>(size()), stream()));
      }
      return Status::Ok();
    });
  }

  std::string Describe(const std::string& what) const {
    return fmt::format("nccl {} on rank {} of {}", what, rank(), size());
  }

  std::unique_ptr<Work> Reject(const std::string& what, Status why) {
    return std::make_unique<NcclWork>(
        state_->Fail(Status(why.code(), fmt::format("{}: {}", Describe(what), why.message()))));
  }

  // Checks that every buffer is device memory of this rank's GPU.
  Status CheckDevice(std::initializer_list<const void*> buffers) {
    for (const void* p : buffers) {
      cudaPointerAttributes attributes{};
      ESTUARY_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attributes, p));
      const bool on_device = attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
      if (!on_device || attributes.device != state_->device_) {
        return InvalidArgument("buffer {} is not device memory of GPU {}", p, state_->device_);
      }
    }
    return Status::Ok();
  }

  // Orders the operation after the caller's compute stream, enqueues it, and
  // records its completion event.
  template <typename Enqueue>
  std::unique_ptr<Work> Launch(const std::string& what, std::initializer_list<const void*> device_buffers, bool empty,
                               Enqueue enqueue, std::function<void()> finish = {},
                               std::shared_ptr<Staging> staging = nullptr) {
    if (Status failed = state_->Failed(); !failed.ok()) {
      return std::make_unique<NcclWork>(
          Aborted("{}: not run, an earlier operation failed: {}", Describe(what), failed.message()));
    }
    if (empty) return std::make_unique<NcclWork>(Status::Ok());
    cudaEvent_t done = nullptr;
    Status status = [&]() -> Status {
      ESTUARY_CUDA_RETURN_IF_ERROR(cudaSetDevice(state_->device_));
      ESTUARY_RETURN_IF_ERROR(CheckDevice(device_buffers));
      Reclaim();
      ESTUARY_CUDA_RETURN_IF_ERROR(cudaEventRecord(state_->ready_, state_->compute_));
      ESTUARY_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(state_->stream_, state_->ready_, 0));
      ESTUARY_RETURN_IF_ERROR(enqueue());
      ESTUARY_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
      ESTUARY_CUDA_RETURN_IF_ERROR(cudaEventRecord(done, state_->stream_));
      if (staging) {
        cudaEvent_t fired = nullptr;
        ESTUARY_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&fired, cudaEventDisableTiming));
        ESTUARY_CUDA_RETURN_IF_ERROR(cudaEventRecord(fired, state_->stream_));
        state_->staged_.emplace_back(fired, staging);
      }
      return Status::Ok();
    }();
    if (!status.ok()) {
      if (done != nullptr) cudaEventDestroy(done);
      return Reject(what, status);
    }
    return std::make_unique<NcclWork>(state_, what, done, std::move(finish));
  }

  // Frees the staging buffers of operations that have finished.
  void Reclaim() {
    auto& staged = state_->staged_;
    while (!staged.empty() && cudaEventQuery(staged.front().first) == cudaSuccess) {
      cudaEventDestroy(staged.front().first);
      staged.pop_front();
    }
  }

  // For the enqueue lambdas and ESTUARY_NCCL_RETURN_IF_ERROR.
  ncclComm_t comm() const { return state_->comm_; }
  cudaStream_t stream() const { return state_->stream_; }
  milliseconds timeout() const { return state_->timeout_; }

  std::shared_ptr<State> state_;
};

}  // namespace

Result<std::unique_ptr<Communicator>> ConnectNccl(const RendezvousOptions& options, int device,
                                                  cudaStream_t compute, std::unique_ptr<Store> store) {
  int devices = 0;
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&devices));
  if (device < 0 || device >= devices) {
    return InvalidArgument("nccl: rank {}: no GPU {} (this machine has {})", options.rank, device, devices);
  }
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  if (!store) {
    ESTUARY_ASSIGN_OR_RETURN(store, OpenStore(options));
  }
  ESTUARY_RETURN_IF_ERROR(AwaitRanks(*store, options, "nccl"));
  ncclUniqueId id;
  if (options.rank == 0) {
    const ncclResult_t made = ncclGetUniqueId(&id);
    if (made != ncclSuccess) return NcclError(made, nullptr, "ncclGetUniqueId(&id)", __FILE__, __LINE__);
    ESTUARY_RETURN_IF_ERROR(store->Set("nccl.id", std::string_view(id.internal, sizeof(id.internal))));
  } else {
    ESTUARY_ASSIGN_OR_RETURN(std::string bytes, store->Get("nccl.id", options.timeout));
    if (bytes.size() != sizeof(id.internal)) {
      return ProtocolError("nccl: rank {}: the unique id at {} has {} bytes, not {}", options.rank, options.address,
                           bytes.size(), sizeof(id.internal));
    }
    std::memcpy(id.internal, bytes.data(), bytes.size());
  }
  auto state = std::make_shared<State>(device, options.rank, options.size, options.timeout, compute);
  ESTUARY_RETURN_IF_ERROR(state->Init(id, std::move(store)));
  return std::unique_ptr<Communicator>(std::make_unique<NcclCommunicator>(std::move(state)));
}

}  // namespace estuary::comm
