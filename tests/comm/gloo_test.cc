// The Gloo engine with 2 and 4 real processes on 127.0.0.1, over both
// rendezvous kinds. Inputs are small integers (and halves) chosen per rank, so
// every sum and average is exact in fp32 and each rank can check its result
// bit for bit.
#include <signal.h>

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <numeric>
#include <vector>

#include "comm/gloo_communicator.h"
#include "tests/comm/ranks.h"

namespace estuary::comm {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::FreeTcpAddress;
using testing::FreshDirAddress;
using testing::RankOutcome;
using testing::RunRanks;


Result<std::unique_ptr<Communicator>> Connect(const std::string& address, int rank, int size,
                                              std::chrono::milliseconds timeout = 30s) {
  return ConnectGloo({.address = address, .rank = rank, .size = size, .timeout = timeout}, {.host = "127.0.0.1"});
}

void ExpectAllOk(const std::vector<RankOutcome>& outcomes) {
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << o.Describe() << " (its message is above)";
}

long long MsSince(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
}

// Sizes that are not powers of two; 300001 floats span several of the ring's segments.
const size_t kSizes[] = {1, 7, 1000, 300001};

Status CheckAllReduce(Communicator& c) {
  const int n = c.size(), r = c.rank();
  for (size_t len : kSizes) {
    std::vector<float> x(len);
    for (size_t i = 0; i < len; ++i) x[i] = static_cast<float>((r + 1) * (i % 5 + 1) + i % 97);
    ESTUARY_RETURN_IF_ERROR(c.AllReduce(x, ReduceOp::kSum)->Wait());
    for (size_t i = 0; i < len; ++i) {
      const float want = static_cast<float>(n * (n + 1) / 2 * (i % 5 + 1) + n * (i % 97));
      CHECK_OR_RETURN(x[i] == want, "all-reduce sum of {}: x[{}] = {}, want {}", len, i, x[i], want);
    }
    std::vector<double> d(len);
    for (size_t i = 0; i < len; ++i) d[i] = 0.5 * (r + 1) + static_cast<double>(i % 1000);
    ESTUARY_RETURN_IF_ERROR(c.AllReduce(d, ReduceOp::kAverage)->Wait());
    for (size_t i = 0; i < len; ++i) {
      const double want = 0.25 * (n + 1) + static_cast<double>(i % 1000);
      CHECK_OR_RETURN(d[i] == want, "all-reduce average (double) of {}: d[{}] = {}, want {}", len, i, d[i], want);
    }
    std::vector<float> a(len, static_cast<float>(2 * r + 1));  // averages to n exactly
    ESTUARY_RETURN_IF_ERROR(c.AllReduce(a, ReduceOp::kAverage)->Wait());
    for (size_t i = 0; i < len; ++i) {
      CHECK_OR_RETURN(a[i] == static_cast<float>(n), "all-reduce average of {}: a[{}] = {}, want {}", len, i, a[i], n);
    }
  }
  return Status::Ok();
}

Status CheckReduceScatter(Communicator& c) {
  const int n = c.size(), r = c.rank();
  for (size_t m : kSizes) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
      std::vector<float> in(n * m), out(m, -1.0f);
      for (int b = 0; b < n; ++b) {
        for (size_t j = 0; j < m; ++j) in[b * m + j] = static_cast<float>((r + 1) * (b + 1) + j % 13);
      }
      ESTUARY_RETURN_IF_ERROR(c.ReduceScatter(in, out, op)->Wait());
      for (size_t j = 0; j < m; ++j) {
        float want = static_cast<float>(n * (n + 1) / 2 * (r + 1) + n * (j % 13));
        if (op == ReduceOp::kAverage) want /= static_cast<float>(n);
        CHECK_OR_RETURN(out[j] == want, "reduce-scatter of {} per rank: out[{}] = {}, want {}", m, j, out[j], want);
      }
    }
  }
  return Status::Ok();
}

Status CheckAllGather(Communicator& c) {
  const int n = c.size(), r = c.rank();
  for (size_t m : kSizes) {
    std::vector<float> in(m), out(n * m, -1.0f);
    for (size_t j = 0; j < m; ++j) in[j] = static_cast<float>(r * 1000 + j % 1000);
    ESTUARY_RETURN_IF_ERROR(c.AllGather(in, out)->Wait());
    for (int q = 0; q < n; ++q) {
      for (size_t j = 0; j < m; ++j) {
        const float want = static_cast<float>(q * 1000 + j % 1000);
        CHECK_OR_RETURN(out[q * m + j] == want, "all-gather of {}: out[{}] = {}, want {}", m, q * m + j,
                        out[q * m + j], want);
      }
    }
  }
  return Status::Ok();
}

Status CheckBroadcast(Communicator& c) {
  const int n = c.size(), r = c.rank();
  for (size_t len : kSizes) {
    const int root = n - 1;
    std::vector<float> x(len);
    for (size_t i = 0; i < len; ++i) x[i] = static_cast<float>(r * 7 + i % 101);
    ESTUARY_RETURN_IF_ERROR(c.Broadcast(std::span<float>(x), root)->Wait());
    for (size_t i = 0; i < len; ++i) {
      const float want = static_cast<float>(root * 7 + i % 101);
      CHECK_OR_RETURN(x[i] == want, "broadcast of {}: x[{}] = {}, want {}", len, i, x[i], want);
    }
  }
  // Control bytes from rank 1: every rank ends with rank 1's text.
  std::string text = fmt::format("task from rank {:02d}: epochs 3, batch 17", r);
  ESTUARY_RETURN_IF_ERROR(c.Broadcast(std::as_writable_bytes(std::span<char>(text.data(), text.size())), 1)->Wait());
  CHECK_OR_RETURN(text == "task from rank 01: epochs 3, batch 17", "byte broadcast: got '{}'", text);
  return c.Barrier()->Wait();
}

class GlooRanks : public ::testing::TestWithParam<std::tuple<int, const char*>> {
 protected:
  int size() const { return std::get<0>(GetParam()); }
  std::string Address() const {
    return std::string(std::get<1>(GetParam())) == "tcp" ? FreeTcpAddress() : FreshDirAddress();
  }
};

TEST_P(GlooRanks, EveryOperationGivesTheExactResult) {
  const std::string address = Address();
  ExpectAllOk(RunRanks(size(), [&](int rank) -> Status {
    ESTUARY_ASSIGN_OR_RETURN(auto c, Connect(address, rank, size()));
    CHECK_OR_RETURN(c->rank() == rank && c->size() == size() && c->backend() == "gloo", "wrong identity");
    ESTUARY_RETURN_IF_ERROR(CheckAllReduce(*c));
    ESTUARY_RETURN_IF_ERROR(CheckReduceScatter(*c));
    ESTUARY_RETURN_IF_ERROR(CheckAllGather(*c));
    return CheckBroadcast(*c);
  }));
}

// Three all-reduces launched back to back, then a reduce-scatter, an
// all-gather and a broadcast, all in flight before the first Wait().
TEST_P(GlooRanks, SeveralOperationsInFlight) {
  const std::string address = Address();
  ExpectAllOk(RunRanks(size(), [&](int rank) -> Status {
    ESTUARY_ASSIGN_OR_RETURN(auto c, Connect(address, rank, size()));
    const int n = size();
    std::vector<std::vector<float>> bufs;
    for (int k = 0; k < 3; ++k) bufs.emplace_back(100003 + k, static_cast<float>((rank + 1) * (k + 1)));
    std::vector<float> rs_in(n * 999, static_cast<float>(rank)), rs_out(999);
    std::vector<float> ag_in(321, static_cast<float>(rank)), ag_out(n * 321);
    std::vector<float> bc(77, static_cast<float>(rank));
    std::vector<std::unique_ptr<Work>> works;
    for (auto& b : bufs) works.push_back(c->AllReduce(b, ReduceOp::kSum));
    works.push_back(c->ReduceScatter(rs_in, rs_out, ReduceOp::kSum));
    works.push_back(c->AllGather(ag_in, ag_out));
    works.push_back(c->Broadcast(std::span<float>(bc), 0));
    for (auto& w : works) ESTUARY_RETURN_IF_ERROR(w->Wait());
    for (int k = 0; k < 3; ++k) {
      const float want = static_cast<float>(n * (n + 1) / 2 * (k + 1));
      for (float v : bufs[k]) CHECK_OR_RETURN(v == want, "all-reduce #{}: {} != {}", k, v, want);
    }
    for (float v : rs_out) CHECK_OR_RETURN(v == static_cast<float>(n * (n - 1) / 2), "reduce-scatter: {}", v);
    for (int q = 0; q < n; ++q) CHECK_OR_RETURN(ag_out[q * 321 + 5] == static_cast<float>(q), "all-gather");
    for (float v : bc) CHECK_OR_RETURN(v == 0.0f, "broadcast: {}", v);
    return Status::Ok();
  }));
}

INSTANTIATE_TEST_SUITE_P(Sizes, GlooRanks,
                         ::testing::Combine(::testing::Values(2, 4), ::testing::Values("tcp", "file")),
                         [](const auto& info) {
                           return fmt::format("{}ranks_{}", std::get<0>(info.param), std::get<1>(info.param));
                         });

// Rank 1 is SIGKILLed between two all-reduces. The others' second Wait() must
// fail well inside the timeout (the dead process's sockets close at once), and
// every later call must fail at once, saying why.
TEST(GlooFailure, KilledRankFailsTheOthersWithinTheTimeout) {
  constexpr int kSize = 4;
  constexpr auto kTimeout = 5s;
  const std::string address = FreeTcpAddress();
  auto outcomes = RunRanks(kSize, [&](int rank) -> Status {
    ESTUARY_ASSIGN_OR_RETURN(auto c, Connect(address, rank, kSize, kTimeout));
    std::vector<float> x(50000, 1.0f);
    ESTUARY_RETURN_IF_ERROR(c->AllReduce(x, ReduceOp::kSum)->Wait());
    if (rank == 1) raise(SIGKILL);
    const auto start = Clock::now();
    Status status = c->AllReduce(x, ReduceOp::kSum)->Wait();
    const auto elapsed = MsSince(start);
    CHECK_OR_RETURN(!status.ok(), "the all-reduce succeeded without rank 1");
    CHECK_OR_RETURN(elapsed < 2000, "Wait() took {} ms to fail (timeout {} ms)", elapsed, kTimeout.count() * 1000);
    CHECK_OR_RETURN(status.message().find("all-reduce") != std::string::npos &&
                        status.message().find(fmt::format("on rank {} of 4", rank)) != std::string::npos,
                    "the message names neither the operation nor the rank: {}", status.ToString());
    std::fprintf(stderr, "rank %d failed after %lld ms: %s\n", rank, elapsed, status.ToString().c_str());
    const auto later = Clock::now();
    Status after = c->Barrier()->Wait();
    CHECK_OR_RETURN(!after.ok() && MsSince(later) < 100, "a call after the failure did not fail at once");
    CHECK_OR_RETURN(after.message().find("earlier operation failed") != std::string::npos, "{}", after.ToString());
    return Status::Ok();
  });
  for (const auto& o : outcomes) {
    if (o.rank == 1) {
      EXPECT_EQ(o.signal, SIGKILL) << o.Describe();
    } else {
      EXPECT_TRUE(o.ok()) << o.Describe();
    }
  }
}

// Rank 1 stays alive but never joins the all-reduce: rank 0 fails after the
// timeout, not before and not much after; rank 1's own operation then fails too.
TEST(GlooFailure, StalledRankTimesOut) {
  constexpr auto kTimeout = 1500ms;
  const std::string address = FreeTcpAddress();
  ExpectAllOk(RunRanks(2, [&](int rank) -> Status {
    ESTUARY_ASSIGN_OR_RETURN(auto c, Connect(address, rank, 2, kTimeout));
    std::vector<float> x(1000, 1.0f);
    const auto start = Clock::now();
    Status status = rank == 0 ? c->AllReduce(x, ReduceOp::kSum)->Wait() : c->Barrier()->Wait();
    const auto elapsed = MsSince(start);
    CHECK_OR_RETURN(!status.ok(), "rank {} succeeded against a peer doing something else", rank);
    if (rank == 0) {
      CHECK_OR_RETURN(elapsed >= kTimeout.count() - 50 && elapsed < kTimeout.count() + 1500,
                      "failed after {} ms, timeout {} ms: {}", elapsed, kTimeout.count(), status.ToString());
    }
    CHECK_OR_RETURN(elapsed < kTimeout.count() + 1500, "rank {} failed only after {} ms", rank, elapsed);
    return Status::Ok();
  }));
}

// Rendezvous with rank 3 of 4 (or rank 0, who serves tcp://) never started.
void ExpectMissingRank(const std::string& address, int missing, const std::string& expected) {
  constexpr auto kTimeout = 1000ms;
  std::vector<int> present;
  for (int r = 0; r < 4; ++r) {
    if (r != missing) present.push_back(r);
  }
  ExpectAllOk(RunRanks(present, [&](int rank) -> Status {
    const auto start = Clock::now();
    auto c = Connect(address, rank, 4, kTimeout);
    const auto elapsed = MsSince(start);
    CHECK_OR_RETURN(!c.ok(), "rendezvous succeeded without rank {}", missing);
    CHECK_OR_RETURN(elapsed >= kTimeout.count() - 50 && elapsed < kTimeout.count() + 1500,
                    "failed after {} ms with a {} ms timeout", elapsed, kTimeout.count());
    CHECK_OR_RETURN(c.status().message().find(expected) != std::string::npos, "message '{}' lacks '{}'",
                    c.status().ToString(), expected);
    std::fprintf(stderr, "rank %d failed after %lld ms: %s\n", rank, elapsed, c.status().ToString().c_str());
    return Status::Ok();
  }));
}

// Rank 0 may give up a moment before the others and take the store with it:
// they then say which rank they were still waiting for.
TEST(GlooRendezvous, MissingRankFailsWithinTheTimeoutTcp) {
  ExpectMissingRank(FreeTcpAddress(), 3, "rank 3 of 4");
}
TEST(GlooRendezvous, MissingRankFailsWithinTheTimeoutFile) {
  ExpectMissingRank(FreshDirAddress(), 3, "rank 3 of 4 did not arrive within 1000 ms");
}
TEST(GlooRendezvous, MissingRankZeroFailsWithinTheTimeoutTcp) {
  ExpectMissingRank(FreeTcpAddress(), 0, "could not reach rank 0's store");
}

TEST(GlooRendezvous, BadAddressesAreRefused) {
  for (const char* bad : {"udp://127.0.0.1:1", "tcp://127.0.0.1", "tcp://127.0.0.1:0", "file://relative/dir", ""}) {
    auto c = ConnectGloo({.address = bad, .rank = 0, .size = 2, .timeout = 100ms});
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_EQ(c.status().code(), Code::kInvalidArgument) << c.status().ToString();
  }
  auto c = ConnectGloo({.address = FreshDirAddress(), .rank = 2, .size = 2, .timeout = 100ms});
  EXPECT_EQ(c.status().code(), Code::kInvalidArgument) << c.status().ToString();
}

// One rank: every operation is local, nothing to connect.
TEST(GlooSingle, OneRankIsItsOwnWorld) {
  auto c = Connect(FreshDirAddress(), 0, 1);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  std::vector<float> x{1, 2, 3}, out(3);
  EXPECT_TRUE((*c)->AllReduce(x, ReduceOp::kAverage)->Wait().ok());
  EXPECT_EQ(x, (std::vector<float>{1, 2, 3}));
  EXPECT_TRUE((*c)->ReduceScatter(x, out, ReduceOp::kSum)->Wait().ok());
  EXPECT_EQ(out, x);
  EXPECT_TRUE((*c)->Barrier()->Wait().ok());
  // A wrongly sized call fails, and so does everything after it.
  std::vector<float> short_out(2);
  EXPECT_EQ((*c)->AllGather(x, short_out)->Wait().code(), Code::kInvalidArgument);
  EXPECT_FALSE((*c)->Barrier()->Wait().ok());
}

}  // namespace
}  // namespace estuary::comm
