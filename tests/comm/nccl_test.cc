// The NCCL engine on every visible GPU, one process per GPU, and DDP over the
// GPU decoder engine through it. It skips, with the reason, in builds without
// NCCL and on machines without a CUDA device.
// Nothing in this process touches CUDA before the ranks fork: a CUDA context
// does not survive fork, so even counting the devices happens in a child.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <cmath>
#include <random>
#include <vector>

#include "tests/comm/ranks.h"

#ifdef ESTUARY_HAVE_NCCL
#include <cuda_runtime_api.h>

#include "parallel/data_parallel.h"
#include "comm/nccl_communicator.h"
#include "models/cuda/llama_engine.h"
#include "models/cuda/optimizer.h"
#endif

namespace estuary::comm {
namespace {

#ifdef ESTUARY_HAVE_NCCL
using namespace std::chrono_literals;

#define CHECK_OR_RETURN(cond, ...) \
  do {                             \
    if (!(cond)) return Internal(__VA_ARGS__); \
  } while (0)
#define CUDA_OR_RETURN(call)                                                              \
  do {                                                                                    \
    const cudaError_t e = (call);                                                         \
    if (e != cudaSuccess) return Internal("{} failed: {}", #call, cudaGetErrorString(e)); \
  } while (0)

// The number of CUDA devices, counted in a child process that writes its
// answer (or CUDA's error) into a pipe; 0 and the reason when there is none.
int CountDevices(std::string* why) {
  int fds[2];
  if (pipe(fds) != 0) {
    *why = "no CUDA device: pipe() failed";
    return 0;
  }
  testing::RunRanks(1, [&](int) -> Status {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    const std::string answer = e == cudaSuccess ? std::to_string(n) : fmt::format("error {}", cudaGetErrorString(e));
    if (write(fds[1], answer.data(), answer.size()) != static_cast<ssize_t>(answer.size())) return IoError("write");
    return Status::Ok();
  });
  close(fds[1]);
  char buf[256] = {};
  const ssize_t got = read(fds[0], buf, sizeof(buf) - 1);
  close(fds[0]);
  const std::string answer(buf, got > 0 ? got : 0);
  if (answer.empty() || answer.starts_with("error ")) {
    *why = fmt::format("no CUDA device: cudaGetDeviceCount: {}", answer.empty() ? "no answer" : answer.substr(6));
    return 0;
  }
  if (answer == "0") *why = "no CUDA device: cudaGetDeviceCount found none";
  return std::stoi(answer);
}

// Device buffers filled from and read back to host vectors.
struct DeviceFloats {
  float* p = nullptr;
  size_t n = 0;
  ~DeviceFloats() { cudaFree(p); }
  Status Load(const std::vector<float>& host) {
    n = host.size();
    CUDA_OR_RETURN(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(n, 1) * sizeof(float)));
    CUDA_OR_RETURN(cudaMemcpy(p, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    return Status::Ok();
  }
  Result<std::vector<float>> Read() const {
    std::vector<float> host(n);
    const cudaError_t e = cudaMemcpy(host.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) return Internal("cudaMemcpy: {}", cudaGetErrorString(e));
    return host;
  }
  std::span<float> span() { return {p, n}; }
};

Status RunRank(const std::string& address, int rank, int size) {
  ESTUARY_ASSIGN_OR_RETURN(auto c, ConnectNccl({.address = address, .rank = rank, .size = size, .timeout = 60s}, rank));
  CHECK_OR_RETURN(c->backend() == "nccl" && c->device() == Device::kCuda, "wrong identity");
  const int n = size;
  for (size_t len : {size_t{1}, size_t{1000}, size_t{300001}}) {
    // All-reduce sum and average.
    std::vector<float> x(len);
    for (size_t i = 0; i < len; ++i) x[i] = static_cast<float>((rank + 1) + i % 97);
    DeviceFloats dx;
    ESTUARY_RETURN_IF_ERROR(dx.Load(x));
    ESTUARY_RETURN_IF_ERROR(c->AllReduce(dx.span(), ReduceOp::kSum)->Wait());
    ESTUARY_ASSIGN_OR_RETURN(auto got, dx.Read());
    for (size_t i = 0; i < len; ++i) {
      const float want = static_cast<float>(n * (n + 1) / 2 + n * (i % 97));
      CHECK_OR_RETURN(got[i] == want, "all-reduce: [{}] = {}, want {}", i, got[i], want);
    }
    DeviceFloats da;
    ESTUARY_RETURN_IF_ERROR(da.Load(std::vector<float>(len, static_cast<float>(2 * rank + 1))));
    ESTUARY_RETURN_IF_ERROR(c->AllReduce(da.span(), ReduceOp::kAverage)->Wait());
    ESTUARY_ASSIGN_OR_RETURN(got, da.Read());
    for (float v : got) CHECK_OR_RETURN(v == static_cast<float>(n), "all-reduce average: {}", v);
    // Reduce-scatter and all-gather.
    std::vector<float> in(n * len);
    for (int b = 0; b < n; ++b) {
      for (size_t j = 0; j < len; ++j) in[b * len + j] = static_cast<float>((rank + 1) * (b + 1) + j % 13);
    }
    DeviceFloats din, dout;
    ESTUARY_RETURN_IF_ERROR(din.Load(in));
    ESTUARY_RETURN_IF_ERROR(dout.Load(std::vector<float>(len)));
    ESTUARY_RETURN_IF_ERROR(c->ReduceScatter(din.span(), dout.span(), ReduceOp::kSum)->Wait());
    ESTUARY_ASSIGN_OR_RETURN(got, dout.Read());
    for (size_t j = 0; j < len; ++j) {
      const float want = static_cast<float>(n * (n + 1) / 2 * (rank + 1) + n * (j % 13));
      CHECK_OR_RETURN(got[j] == want, "reduce-scatter: [{}] = {}, want {}", j, got[j], want);
    }
    DeviceFloats gin, gout;
    ESTUARY_RETURN_IF_ERROR(gin.Load(std::vector<float>(len, static_cast<float>(rank))));
    ESTUARY_RETURN_IF_ERROR(gout.Load(std::vector<float>(n * len, -1)));
    ESTUARY_RETURN_IF_ERROR(c->AllGather(gin.span(), gout.span())->Wait());
    ESTUARY_ASSIGN_OR_RETURN(got, gout.Read());
    for (int q = 0; q < n; ++q) CHECK_OR_RETURN(got[q * len] == static_cast<float>(q), "all-gather block {}", q);
    // Broadcast from the last rank.
    DeviceFloats db;
    ESTUARY_RETURN_IF_ERROR(db.Load(std::vector<float>(len, static_cast<float>(rank))));
    ESTUARY_RETURN_IF_ERROR(c->Broadcast(db.span(), n - 1)->Wait());
    ESTUARY_ASSIGN_OR_RETURN(got, db.Read());
    for (float v : got) CHECK_OR_RETURN(v == static_cast<float>(n - 1), "broadcast: {}", v);
  }
  // Host bytes from rank 0, and three all-reduces in flight at once.
  std::string text = fmt::format("task from rank {:02d}", rank);
  ESTUARY_RETURN_IF_ERROR(c->Broadcast(std::as_writable_bytes(std::span<char>(text.data(), text.size())), 0)->Wait());
  CHECK_OR_RETURN(text == "task from rank 00", "byte broadcast: '{}'", text);
  std::vector<DeviceFloats> bufs(3);
  std::vector<std::unique_ptr<Work>> works;
  for (int k = 0; k < 3; ++k) {
    ESTUARY_RETURN_IF_ERROR(bufs[k].Load(std::vector<float>(4099 + k, static_cast<float>(k + 1))));
    works.push_back(c->AllReduce(bufs[k].span(), ReduceOp::kSum));
  }
  for (auto& w : works) ESTUARY_RETURN_IF_ERROR(w->Wait());
  for (int k = 0; k < 3; ++k) {
    ESTUARY_ASSIGN_OR_RETURN(auto got, bufs[k].Read());
    for (float v : got) CHECK_OR_RETURN(v == static_cast<float>(n * (k + 1)), "in-flight all-reduce #{}: {}", k, v);
  }
  // Host memory where device memory is due is refused, and poisons the communicator.
  std::vector<float> host(10);
  CHECK_OR_RETURN(c->AllReduce(host, ReduceOp::kSum)->Wait().code() == Code::kInvalidArgument, "host buffer taken");
  CHECK_OR_RETURN(!c->Barrier()->Wait().ok(), "a call after a failure succeeded");
  return Status::Ok();
}

// DDP and ZeRO-1 over cuda::LlamaEngine's device buffers (what a --gpus site
// runs): each rank trains its share of every global batch with buckets of a
// few KB, so many collectives follow backward on the engine's stream; after
// every AdamW step the parameters equal one engine's on the whole batch, on
// the same GPU (fp32, within 1e-5). ZeRO-1 clips to a norm the steps exceed,
// agreed across ranks (the whole-batch engine clips its own). ZeRO-2/3 are
// refused on device buffers.
Status RunDataParallelRank(const std::string& address, int rank, int size, parallel::ZeroStage stage) {
  CUDA_OR_RETURN(cudaSetDevice(rank));
  cudaStream_t stream = nullptr;
  CUDA_OR_RETURN(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ESTUARY_ASSIGN_OR_RETURN(auto c, ConnectNccl({.address = address, .rank = rank, .size = size, .timeout = 60s},
                                               rank, stream));
  models::LlamaConfig config;
  config.vocab_size = 61;
  config.hidden_size = 32;
  config.intermediate_size = 48;
  config.num_layers = 3;
  config.num_heads = 4;
  config.num_kv_heads = 2;
  config.max_seq_len = 16;
  const int per_rank = 2, global = per_rank * size, seq = 16;
  models::cuda::LlamaEngineOptions on_stream;
  on_stream.stream = stream;
  ESTUARY_ASSIGN_OR_RETURN(auto engine, models::cuda::LlamaEngine::Create(config, per_rank, on_stream));
  ESTUARY_ASSIGN_OR_RETURN(auto whole, models::cuda::LlamaEngine::Create(config, global));
  ESTUARY_RETURN_IF_ERROR(engine.Initialize(7));
  ESTUARY_RETURN_IF_ERROR(whole.Initialize(7));
  const size_t count = size_t(engine.parameter_count());
  const std::span<float> params(engine.parameters(), count), grads(engine.gradients(), count);

  parallel::DataParallelOptions zero2;
  zero2.stage = parallel::ZeroStage::kZero2;
  zero2.device_stream = stream;
  auto refused = parallel::DataParallel::Create(*c, params, grads, engine.units(), zero2);
  CHECK_OR_RETURN(!refused.ok() && refused.status().message().find("DDP or ZeRO-1 only") != std::string::npos,
                  "ZeRO-2 on device buffers: {}", refused.ok() ? "accepted" : refused.status().message());

  parallel::DataParallelOptions options;
  options.stage = stage;
  options.bucket_bytes = 4096;
  options.first_bucket_bytes = 1028;  // buckets whose sizes do not split evenly: remainders too
  options.device_stream = stream;
  const double max_norm = stage == parallel::ZeroStage::kZero1 ? 0.5 : 0.0;
  options.max_grad_norm = max_norm;
  ESTUARY_ASSIGN_OR_RETURN(auto dp, parallel::DataParallel::Create(*c, params, grads, engine.units(), options));
  CHECK_OR_RETURN(dp->buckets().size() > 10, "only {} buckets", dp->buckets().size());
  const size_t stepped = stage == parallel::ZeroStage::kDdp ? count : dp->shard_size();
  const models::AdamWOptions adamw{.lr = 1e-2f, .weight_decay = 0.1f};
  ESTUARY_ASSIGN_OR_RETURN(auto opt, models::cuda::AdamW::Create(int64_t(stepped), adamw, stream));
  ESTUARY_ASSIGN_OR_RETURN(auto whole_opt, models::cuda::AdamW::Create(int64_t(count), adamw, whole.stream()));

  std::mt19937 rng(11);
  std::vector<float> mine(count), want(count);
  for (int step = 0; step < 3; ++step) {
    std::vector<int32_t> tokens(size_t(global) * seq), targets(tokens.size());
    for (auto& t : tokens) t = int32_t(rng() % 61);
    for (auto& t : targets) t = int32_t(rng() % 61);
    const size_t at = size_t(rank) * per_rank * seq;
    ESTUARY_RETURN_IF_ERROR(engine.ForwardBackwardAsync(tokens.data() + at, targets.data() + at, per_rank, seq,
                                                        dp->MicroBatch(double(per_rank) / global, true)));
    Status step_status;
    ESTUARY_ASSIGN_OR_RETURN(const parallel::StepResult result, dp->Step([&](std::span<const models::ParameterSlice> slices) {
      // DDP: the engine's own step over its buffers; ZeRO-1: this rank's pieces.
      step_status = stage == parallel::ZeroStage::kDdp ? engine.Step(opt).status() : opt.Step(slices, stream);
    }));
    ESTUARY_RETURN_IF_ERROR(step_status);
    if (stage != parallel::ZeroStage::kDdp) ESTUARY_RETURN_IF_ERROR(engine.RefreshWorkingCopy());
    CHECK_OR_RETURN(max_norm == 0 || result.grad_norm > max_norm, "step {}: norm {} does not exceed the clip {}", step,
                    result.grad_norm, max_norm);
    ESTUARY_RETURN_IF_ERROR(whole.ForwardBackward(tokens.data(), targets.data(), global, seq).status());
    ESTUARY_RETURN_IF_ERROR(whole.Step(whole_opt, max_norm).status());
    ESTUARY_RETURN_IF_ERROR(engine.CopyParametersTo(mine));
    ESTUARY_RETURN_IF_ERROR(whole.CopyParametersTo(want));
    double diff = 0, scale = 1e-30;
    for (size_t i = 0; i < count; ++i) {
      diff = std::max(diff, std::abs(double(mine[i]) - want[i]));
      scale = std::max(scale, std::abs(double(want[i])));
    }
    CHECK_OR_RETURN(diff / scale <= 1e-5, "{} step {}: parameters {} off the whole batch's (relative)",
                    parallel::ZeroStageName(stage), step, diff / scale);
  }
  dp.reset();
  c.reset();
  CUDA_OR_RETURN(cudaStreamDestroy(stream));
  return Status::Ok();
}
#endif

// Runs body(address, rank, size) in one process per visible GPU, meeting at
// a fresh address; skips, with the reason, without NCCL or a GPU.
#ifdef ESTUARY_HAVE_NCCL
#define SKIP_WITHOUT_GPUS(gpus)                           \
  std::string why;                                        \
  const int gpus = CountDevices(&why);                    \
  if (gpus <= 0) GTEST_SKIP() << why
#else
#define SKIP_WITHOUT_GPUS(gpus) \
  GTEST_SKIP() << "this build has no NCCL engine (CUDA or NCCL not found by CMake)"
#endif

#ifdef ESTUARY_HAVE_NCCL
void ExpectEveryRankOk(int gpus, const std::function<Status(const std::string&, int, int)>& body) {
  const std::string address = testing::FreeTcpAddress();
  for (const auto& o : testing::RunRanks(gpus, [&](int rank) { return body(address, rank, gpus); })) {
    EXPECT_TRUE(o.ok()) << o.Describe();
  }
}
#endif

TEST(NcclCommunicator, DdpAndZero1OverTheGpuEngineEqualOneGpuOnTheWholeBatch) {
  SKIP_WITHOUT_GPUS(gpus);
#ifdef ESTUARY_HAVE_NCCL
  for (parallel::ZeroStage stage : {parallel::ZeroStage::kDdp, parallel::ZeroStage::kZero1}) {
    SCOPED_TRACE(std::string(parallel::ZeroStageName(stage)));
    ExpectEveryRankOk(gpus, [stage](const std::string& address, int rank, int size) {
      return RunDataParallelRank(address, rank, size, stage);
    });
  }
#endif
}

TEST(NcclCommunicator, EveryOperationOnEveryGpu) {
  SKIP_WITHOUT_GPUS(gpus);
#ifdef ESTUARY_HAVE_NCCL
  ExpectEveryRankOk(gpus, RunRank);
#endif
}

}  // namespace
}  // namespace estuary::comm
