#include "client/local_deadline.h"

#include <array>

namespace estuary::client {

LocalDeadline::LocalDeadline(double seconds, comm::Communicator& comm, std::function<Clock::time_point()> now)
    : seconds_(seconds), comm_(comm), now_(std::move(now)), start_(now_()) {}

Result<bool> LocalDeadline::Reached() {
  if (seconds_ <= 0) return false;
  std::array<std::byte, 1> up{std::byte{0}};
  if (comm_.rank() == 0) {
    up[0] = std::byte(std::chrono::duration<double>(now_() - start_).count() >= seconds_);
  }
  if (comm_.size() > 1) {
    if (Status s = comm_.Broadcast(std::span<std::byte>(up), 0)->Wait(); !s.ok()) {
      return Status(s.code(), fmt::format("site: agreeing on the local time cap: {}", s.message()));
    }
  }
  return up[0] != std::byte{0};
}

}  // namespace estuary::client
