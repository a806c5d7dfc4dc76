#include "server/clock.h"

#include "server/store.h"

namespace estuary::server {
namespace {

class AsioTimer final : public Timer {
 public:
  explicit AsioTimer(const boost::asio::any_io_executor& io) : timer_(io) {}

  // Re-arming cancels the wait before: its handler sees operation_aborted.
  void Arm(std::chrono::steady_clock::duration delay, std::function<void()> fire) override {
    timer_.expires_after(delay);
    timer_.async_wait([fire = std::move(fire)](const boost::system::error_code& ec) {
      if (!ec) fire();
    });
  }
  void Cancel() override { timer_.cancel(); }

 private:
  boost::asio::steady_timer timer_;
};

}  // namespace

int64_t AsioClock::UnixMs() const { return NowMs(); }

std::unique_ptr<Timer> AsioClock::MakeTimer() { return std::make_unique<AsioTimer>(io_); }

}  // namespace estuary::server
