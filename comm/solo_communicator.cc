#include <algorithm>

#include "comm/communicator.h"

namespace estuary::comm {

namespace {

class Done : public Work {
 public:
  explicit Done(Status status = Status::Ok()) : status_(std::move(status)) {}
  Status Wait() override { return status_; }

 private:
  Status status_;
};

class SoloCommunicator final : public Communicator {
 public:
  explicit SoloCommunicator(Device device) : device_(device) {}

  int rank() const override { return 0; }
  int size() const override { return 1; }
  Device device() const override { return device_; }
  std::string_view backend() const override { return "solo"; }

  std::unique_ptr<Work> AllReduce(std::span<float>, ReduceOp) override { return std::make_unique<Done>(); }
  std::unique_ptr<Work> AllReduce(std::span<double>, ReduceOp) override { return std::make_unique<Done>(); }
  std::unique_ptr<Work> ReduceScatter(std::span<const float> in, std::span<float> out, ReduceOp) override {
    return Copy("reduce-scatter", in, out);
  }
  std::unique_ptr<Work> AllGather(std::span<const float> in, std::span<float> out) override {
    return Copy("all-gather", in, out);
  }
  std::unique_ptr<Work> Broadcast(std::span<float>, int) override { return std::make_unique<Done>(); }
  std::unique_ptr<Work> Broadcast(std::span<std::byte>, int) override { return std::make_unique<Done>(); }
  std::unique_ptr<Work> Barrier() override { return std::make_unique<Done>(); }

 private:
  std::unique_ptr<Work> Copy(std::string_view what, std::span<const float> in, std::span<float> out) const {
    if (in.size() != out.size()) {
      return std::make_unique<Done>(
          InvalidArgument("solo {}: {} elements in, room for {} (one rank: the same)", what, in.size(), out.size()));
    }
    if (in.data() == out.data()) return std::make_unique<Done>();
    if (device_ != Device::kCpu) {
      return std::make_unique<Done>(
          FailedPrecondition("solo {}: one rank on a GPU would copy device memory; run DDP", what));
    }
    std::copy(in.begin(), in.end(), out.begin());
    return std::make_unique<Done>();
  }

  Device device_;
};

}  // namespace

std::unique_ptr<Communicator> MakeSoloCommunicator(Device device) {
  return std::make_unique<SoloCommunicator>(device);
}

}  // namespace estuary::comm
