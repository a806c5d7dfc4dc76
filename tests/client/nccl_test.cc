// The NCCL engine on every visible GPU, one process per GPU. It skips, with
// the reason, in builds without NCCL and on machines without a CUDA device.
// Nothing in this process touches CUDA before the ranks fork: a CUDA context
// does not survive fork, so even counting the devices happens in a child.
#include <gtest/gtest.h>
#include <unistd.h>

#include <vector>

#include "tests/client/ranks.h"

#ifdef ESTUARY_HAVE_NCCL
#include <cuda_runtime_api.h>

#include "client/nccl_communicator.h"
#endif

namespace estuary::client {
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
  CHECK_OR_RETURN(c->backend() == "nccl" && c->device() == models::Device::kCuda, "wrong identity");
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
#endif

TEST(NcclCommunicator, EveryOperationOnEveryGpu) {
#ifndef ESTUARY_HAVE_NCCL
  GTEST_SKIP() << "this build has no NCCL engine (CUDA or NCCL not found by CMake)";
#else
  std::string why;
  const int gpus = CountDevices(&why);
  if (gpus <= 0) GTEST_SKIP() << why;
  const std::string address = testing::FreeTcpAddress();
  for (const auto& o : testing::RunRanks(gpus, [&](int rank) { return RunRank(address, rank, gpus); })) {
    EXPECT_TRUE(o.ok()) << o.Describe();
  }
#endif
}

}  // namespace
}  // namespace estuary::client
