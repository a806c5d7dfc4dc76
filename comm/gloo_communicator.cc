#include "comm/gloo_communicator.h"

#include <pthread.h>
#include <signal.h>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>

// Plain Asio, without base/asio.h's SSL: <utility> first for Boost 1.74 (see there).
#include <utility>

#include <boost/asio.hpp>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

#include "base/host_port.h"
#include "comm/rendezvous.h"

namespace estuary::comm {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Gloo's slot prefixes stop at 0x08; the ring reduce-scatter takes its own.
constexpr uint8_t kReduceScatterSlotPrefix = 0x40;
// The ring pipelines each block in segments, adding one while the next arrives.
constexpr size_t kSegmentFloats = 256 << 10;

// Gloo's rendezvous runs on our Store; it reports failure by throwing, which
// ConnectGloo catches. Keys get a prefix so NCCL's can share the address.
class GlooStore final : public gloo::rendezvous::Store {
 public:
  GlooStore(comm::Store& store, milliseconds timeout) : store_(store), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    Check(store_.Set(Key(key), std::string_view(data.data(), data.size())));
  }
  std::vector<char> get(const std::string& key) override {
    auto value = store_.Get(Key(key), timeout_);
    Check(value.status());
    return {value->begin(), value->end()};
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const milliseconds& timeout) override {
    const auto deadline = Clock::now() + timeout;
    for (const auto& key : keys) {
      auto left = std::max(milliseconds(0), std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
      Check(store_.Get(Key(key), left).status());
    }
  }

 private:
  static std::string Key(const std::string& key) { return "gloo." + key; }
  static void Check(const Status& status) {
    if (!status.ok()) throw gloo::IoException(status.message());
  }
  comm::Store& store_;
  const milliseconds timeout_;
};

// The local address that routes toward host:port (a connected UDP socket
// sends nothing; it only asks the kernel which interface it would use).
Result<std::string> LocalAddressToward(const std::string& address) {
  std::string host;
  uint16_t port = 0;
  ESTUARY_RETURN_IF_ERROR(ParseHostPort(address.substr(6), &host, &port));
  namespace asio = boost::asio;
  asio::io_context io;
  boost::system::error_code ec;
  asio::ip::udp::resolver resolver(io);
  auto found = resolver.resolve(host, std::to_string(port), ec);
  if (ec || found.empty()) return IoError("gloo: cannot resolve '{}' of {}: {}", host, address, ec.message());
  asio::ip::udp::socket socket(io);
  socket.connect(*found.begin(), ec);
  if (ec) return IoError("gloo: no route to {}: {}", address, ec.message());
  return socket.local_endpoint().address().to_string();
}

// Gloo writes to its sockets without MSG_NOSIGNAL, so a peer that died would
// kill this process with SIGPIPE. Threads inherit the creator's signal mask:
// with SIGPIPE blocked while Gloo's event loop and our worker start, only the
// threads that touch Gloo's sockets ignore it (their writes then fail with
// EPIPE, which Gloo reports), and the caller's own mask is left as it was.
class BlockSigpipe {
 public:
  BlockSigpipe() {
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, &saved_);
  }
  ~BlockSigpipe() { pthread_sigmask(SIG_SETMASK, &saved_, nullptr); }

 private:
  sigset_t saved_;
};

class GlooWork final : public Work {
 public:
  explicit GlooWork(std::shared_future<Status> done) : done_(std::move(done)) {}
  Status Wait() override { return done_.get(); }

 private:
  std::shared_future<Status> done_;
};

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(std::unique_ptr<Store> store, std::shared_ptr<gloo::Context> context, milliseconds timeout)
      : store_(std::move(store)), context_(std::move(context)), timeout_(timeout) {
    worker_ = std::thread([this] { Run(); });
  }

  // Operations not started yet fail; the one running finishes (bounded by its timeout).
  ~GlooCommunicator() override {
    {
      std::lock_guard lock(mu_);
      closing_ = true;
    }
    wake_.notify_all();
    worker_.join();
  }

  int rank() const override { return context_->rank; }
  int size() const override { return context_->size; }
  Device device() const override { return Device::kCpu; }
  std::string_view backend() const override { return "gloo"; }

  std::unique_ptr<Work> AllReduce(std::span<float> data, ReduceOp op) override { return AllReduceOf(data, op); }
  std::unique_ptr<Work> AllReduce(std::span<double> data, ReduceOp op) override { return AllReduceOf(data, op); }

  std::unique_ptr<Work> ReduceScatter(std::span<const float> in, std::span<float> out, ReduceOp op) override {
    const std::string what = fmt::format("reduce-scatter ({} -> {} floats, {})", in.size(), out.size(), OpName(op));
    if (in.size() != out.size() * static_cast<size_t>(size())) {
      return Fail(what, InvalidArgument("the input holds {} floats, not size() x {}", in.size(), out.size()));
    }
    return Enqueue(what, [=, this](uint32_t tag) { return RingReduceScatter(in, out, op, tag); });
  }

  std::unique_ptr<Work> AllGather(std::span<const float> in, std::span<float> out) override {
    const std::string what = fmt::format("all-gather ({} -> {} floats)", in.size(), out.size());
    if (out.size() != in.size() * static_cast<size_t>(size())) {
      return Fail(what, InvalidArgument("the output holds {} floats, not size() x {}", out.size(), in.size()));
    }
    return Enqueue(what, [=, this](uint32_t tag) {
      if (size() == 1 || in.empty()) {
        if (in.data() != out.data()) std::copy(in.begin(), in.end(), out.begin());
        return Status::Ok();
      }
      gloo::AllgatherOptions opts(context_);
      // Gloo runs in place when it is given no input.
      if (in.data() != out.data() + static_cast<size_t>(rank()) * in.size()) {
        opts.setInput(const_cast<float*>(in.data()), in.size());
      }
      opts.setOutput(out.data(), out.size());
      opts.setTag(tag);
      opts.setTimeout(timeout_);
      gloo::allgather(opts);
      return Status::Ok();
    });
  }

  std::unique_ptr<Work> Broadcast(std::span<float> data, int root) override {
    return BroadcastOf(data, root, fmt::format("broadcast ({} floats from rank {})", data.size(), root));
  }
  std::unique_ptr<Work> Broadcast(std::span<std::byte> data, int root) override {
    std::span<uint8_t> bytes(reinterpret_cast<uint8_t*>(data.data()), data.size());
    return BroadcastOf(bytes, root, fmt::format("broadcast ({} bytes from rank {})", data.size(), root));
  }

  std::unique_ptr<Work> Barrier() override {
    return Enqueue("barrier", [this](uint32_t tag) {
      if (size() == 1) return Status::Ok();
      gloo::BarrierOptions opts(context_);
      opts.setTag(tag);
      opts.setTimeout(timeout_);
      gloo::barrier(opts);
      return Status::Ok();
    });
  }

 private:
  // Runs on the worker; a tag unique to the operation keeps its messages apart.
  using Job = std::function<Status(uint32_t tag)>;
  struct Pending {
    std::string what;
    Job job;
    std::promise<Status> done;
  };

  static const char* OpName(ReduceOp op) { return op == ReduceOp::kSum ? "sum" : "average"; }

  template <typename T>
  std::unique_ptr<Work> AllReduceOf(std::span<T> data, ReduceOp op) {
    const std::string what =
        fmt::format("all-reduce ({} {}s, {})", data.size(), sizeof(T) == 4 ? "float" : "double", OpName(op));
    return Enqueue(what, [=, this](uint32_t tag) {
      if (size() > 1 && !data.empty()) {
        gloo::AllreduceOptions opts(context_);
        opts.setOutput(data.data(), data.size());
        opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<T>));
        opts.setTag(tag);
        opts.setTimeout(timeout_);
        gloo::allreduce(opts);
      }
      // Gloo's ring leaves identical sums on every rank, so the quotients agree too.
      if (op == ReduceOp::kAverage) {
        for (T& x : data) x /= static_cast<T>(size());
      }
      return Status::Ok();
    });
  }

  template <typename T>
  std::unique_ptr<Work> BroadcastOf(std::span<T> data, int root, std::string what) {
    if (root < 0 || root >= size()) return Fail(what, InvalidArgument("no rank {} among {}", root, size()));
    return Enqueue(what, [=, this](uint32_t tag) {
      if (size() == 1 || data.empty()) return Status::Ok();
      gloo::BroadcastOptions opts(context_);
      opts.setOutput(data.data(), data.size());
      opts.setRoot(root);
      opts.setTag(tag);
      opts.setTimeout(timeout_);
      gloo::broadcast(opts);
      return Status::Ok();
    });
  }

  // Rank r ends with block r of the reduction. At step s (0 <= s < n-1) it
  // receives block r-s-2's partial sum from rank r-1, adds its own share and
  // sends it on to rank r+1 (at the last step the sum is complete: block r).
  // Step s receives into half s%2 of the scratch while half (s-1)%2 is sent.
  Status RingReduceScatter(std::span<const float> in, std::span<float> out, ReduceOp op, uint32_t tag) {
    const int n = size(), r = rank();
    const size_t m = out.size();
    if (n == 1 || m == 0) {
      if (in.data() != out.data()) std::copy(in.begin(), in.end(), out.begin());
      return Status::Ok();
    }
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    auto block = [&](int b) { return static_cast<size_t>(((b % n) + n) % n) * m; };
    const size_t seg = std::min(m, kSegmentFloats), segments = (m + seg - 1) / seg;
    auto length = [&](size_t i) { return std::min(seg, m - i * seg); };

    // Kept across calls: fresh pages for every call would cost more than the additions.
    if (scratch_.size() < 2 * m) scratch_.resize(2 * m);
    std::span<float> scratch(scratch_.data(), 2 * m);
    const uint64_t slot = gloo::Slot::build(kReduceScatterSlotPrefix, tag);
    auto mine = context_->createUnboundBuffer(const_cast<float*>(in.data()), in.size_bytes());
    auto tmp = context_->createUnboundBuffer(scratch.data(), scratch.size_bytes());
    size_t tmp_sent = 0, tmp_confirmed = 0;
    std::vector<size_t> sent_before_step(n, 0);
    auto confirm_sends = [&](size_t until) {
      for (; tmp_confirmed < until; ++tmp_confirmed) {
        if (!tmp->waitSend(timeout_)) return Aborted("send to rank {} aborted", next);
      }
      return Status::Ok();
    };

    for (size_t i = 0; i < segments; ++i) {
      mine->send(next, slot, (block(r - 1) + i * seg) * sizeof(float), length(i) * sizeof(float));
    }
    for (int s = 0; s < n - 1; ++s) {
      sent_before_step[s] = tmp_sent;
      const size_t half = static_cast<size_t>(s % 2) * m;
      // This half was the source of step s-2's sends: they must be out first.
      if (s >= 2) ESTUARY_RETURN_IF_ERROR(confirm_sends(sent_before_step[s - 1]));
      for (size_t i = 0; i < segments; ++i) {
        tmp->recv(prev, slot, (half + i * seg) * sizeof(float), length(i) * sizeof(float));
      }
      const float* own = in.data() + block(r - s - 2);
      for (size_t i = 0; i < segments; ++i) {
        if (!tmp->waitRecv(timeout_)) return Aborted("receive from rank {} aborted", prev);
        const float* got = scratch.data() + half + i * seg;
        if (s < n - 2) {
          float* acc = scratch.data() + half + i * seg;
          for (size_t k = 0; k < length(i); ++k) acc[k] = got[k] + own[i * seg + k];
          tmp->send(next, slot, (half + i * seg) * sizeof(float), length(i) * sizeof(float));
          ++tmp_sent;
        } else {
          float* dst = out.data() + i * seg;
          for (size_t k = 0; k < length(i); ++k) dst[k] = got[k] + own[i * seg + k];
        }
      }
    }
    for (size_t i = 0; i < segments; ++i) {
      if (!mine->waitSend(timeout_)) return Aborted("send to rank {} aborted", next);
    }
    ESTUARY_RETURN_IF_ERROR(confirm_sends(tmp_sent));
    if (op == ReduceOp::kAverage) {
      for (float& x : out) x /= static_cast<float>(n);
    }
    return Status::Ok();
  }

  std::string Describe(const std::string& what) const {
    return fmt::format("gloo {} on rank {} of {}", what, rank(), size());
  }

  // A Work that has already failed (no operation runs); it poisons the communicator.
  std::unique_ptr<Work> Fail(const std::string& what, Status why) {
    Status status(why.code(), fmt::format("{}: {}", Describe(what), why.message()));
    {
      std::lock_guard lock(mu_);
      if (failed_.ok()) failed_ = status;
    }
    std::promise<Status> done;
    done.set_value(status);
    return std::make_unique<GlooWork>(done.get_future().share());
  }

  std::unique_ptr<Work> Enqueue(std::string what, Job job) {
    std::promise<Status> done;
    auto future = done.get_future().share();
    {
      std::lock_guard lock(mu_);
      if (!failed_.ok()) {
        done.set_value(Aborted("{}: not run, an earlier operation failed: {}", Describe(what), failed_.message()));
        return std::make_unique<GlooWork>(std::move(future));
      }
      queue_.push_back({std::move(what), std::move(job), std::move(done)});
    }
    wake_.notify_one();
    return std::make_unique<GlooWork>(std::move(future));
  }

  void Run() {
    uint32_t tag = 0;
    for (;;) {
      Pending next;
      Status failed;
      {
        std::unique_lock lock(mu_);
        wake_.wait(lock, [&] { return closing_ || !queue_.empty(); });
        if (queue_.empty()) return;
        next = std::move(queue_.front());
        queue_.pop_front();
        failed = closing_ ? Aborted("the communicator was destroyed") : failed_;
      }
      if (!failed.ok()) {
        next.done.set_value(
            Aborted("{}: not run, an earlier operation failed: {}", Describe(next.what), failed.message()));
        continue;
      }
      Status status;
      try {
        status = next.job(tag++);
      } catch (const std::exception& e) {
        status = Aborted("{}", e.what());
      }
      if (!status.ok()) {
        status = Status(status.code(), fmt::format("{}: {}", Describe(next.what), status.message()));
        {
          std::lock_guard lock(mu_);
          failed_ = status;
        }
        // Closing our sockets tells every peer at once, instead of after their timeouts.
        try {
          context_->closeConnections();
        } catch (const std::exception&) {
        }
      }
      next.done.set_value(status);
    }
  }

  const std::unique_ptr<Store> store_;  // rank 0 serves tcp:// rendezvous while it lives
  const std::shared_ptr<gloo::Context> context_;
  const milliseconds timeout_;
  std::vector<float> scratch_;  // the ring reduce-scatter's, used on the worker only

  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<Pending> queue_;
  Status failed_;
  bool closing_ = false;
  std::thread worker_;
};

}  // namespace

Result<std::unique_ptr<Communicator>> ConnectGloo(const RendezvousOptions& options, const GlooOptions& gloo_options,
                                                  std::unique_ptr<Store> store) {
  if (!store) {
    ESTUARY_ASSIGN_OR_RETURN(store, OpenStore(options));
  }
  ESTUARY_RETURN_IF_ERROR(AwaitRanks(*store, options, "gloo"));

  gloo::transport::tcp::attr attr;
  attr.hostname = gloo_options.host;
  if (attr.hostname.empty() && options.address.starts_with("tcp://")) {
    ESTUARY_ASSIGN_OR_RETURN(attr.hostname, LocalAddressToward(options.address));
  }
  BlockSigpipe sigpipe;  // the connection and the worker thread start below
  try {
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(options.rank, options.size);
    context->setTimeout(options.timeout);
    GlooStore gloo_store(*store, options.timeout);
    context->connectFullMesh(gloo_store, device);
    return std::unique_ptr<Communicator>(
        std::make_unique<GlooCommunicator>(std::move(store), std::move(context), options.timeout));
  } catch (const std::exception& e) {
    return Aborted("gloo: rank {} of {} could not connect its peers through {}: {}", options.rank, options.size,
                   options.address, e.what());
  }
}

}  // namespace estuary::comm
