// The rendezvous Store on its own: rank 0 serving tcp://, another rank's
// client, and the file:// directory. The store is plain I/O, so one process
// with a second thread stands in for the other rank here; the engines' tests
// use real processes.
#include "comm/rendezvous.h"

#include <gtest/gtest.h>

#include <thread>

#include "tests/comm/ranks.h"

namespace estuary::comm {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

void ExerciseStores(const std::string& address) {
  auto server = OpenStore({.address = address, .rank = 0, .size = 2, .timeout = 5s});
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  auto client = OpenStore({.address = address, .rank = 1, .size = 2, .timeout = 5s});
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  Store& a = **server;
  Store& b = **client;

  ASSERT_TRUE(a.Set("greeting", std::string("hello\0world", 11)).ok());
  auto got = b.Get("greeting", 1s);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, std::string("hello\0world", 11));
  EXPECT_TRUE(*b.Has("greeting"));
  EXPECT_FALSE(*a.Has("absent"));

  // A Get waits for a Set made later by the other side.
  std::thread later([&] { ASSERT_TRUE(a.Set("late key/with odd chars", "v").ok()); });
  auto waited = b.Get("late key/with odd chars", 5s);
  later.join();
  ASSERT_TRUE(waited.ok()) << waited.status().ToString();
  EXPECT_EQ(*waited, "v");
  ASSERT_TRUE(b.Set("from-b", "").ok());
  auto empty = a.Get("from-b", 1s);
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_EQ(*empty, "");

  // A key nobody sets: the Get gives up after its timeout, not before, and the store still works after.
  const auto start = Clock::now();
  auto missing = b.Get("never", 300ms);
  const auto elapsed = Clock::now() - start;
  EXPECT_EQ(missing.status().code(), Code::kAborted) << missing.status().ToString();
  EXPECT_GE(elapsed, 290ms);
  EXPECT_LT(elapsed, 2s);
  EXPECT_TRUE(*b.Has("greeting"));
}

TEST(Rendezvous, TcpStore) { ExerciseStores(testing::FreeTcpAddress()); }
TEST(Rendezvous, FileStore) { ExerciseStores(testing::FreshDirAddress()); }

TEST(Rendezvous, AwaitRanksNamesEveryMissingRank) {
  const std::string address = testing::FreshDirAddress();
  RendezvousOptions options{.address = address, .rank = 1, .size = 4, .timeout = 200ms};
  auto store = OpenStore(options);
  ASSERT_TRUE(store.ok());
  Status status = AwaitRanks(**store, options, "test");
  EXPECT_EQ(status.code(), Code::kAborted);
  EXPECT_NE(status.message().find("ranks 0, 2, 3 of 4 did not arrive within 200 ms"), std::string::npos)
      << status.ToString();
}

// The single-node default serves before anyone is told the port: the port
// it names is held (a second server there fails), and a rank that connects
// to that address reaches this store.
TEST(Rendezvous, LoopbackStoreServesThePortItNames) {
  auto served = ServeLoopbackStore();
  ASSERT_TRUE(served.ok()) << served.status().ToString();
  const std::string address = (*served)->address();
  ASSERT_TRUE(address.starts_with("tcp://127.0.0.1:")) << address;
  EXPECT_NE(address, "tcp://127.0.0.1:0");
  auto second = OpenStore({.address = address, .rank = 0, .size = 2});
  EXPECT_EQ(second.status().code(), Code::kIo) << second.status().ToString();
  auto client = OpenStore({.address = address, .rank = 1, .size = 2, .timeout = 5s});
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  ASSERT_TRUE((*served)->Set("k", "v").ok());
  auto got = (*client)->Get("k", 1s);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, "v");
}

TEST(Rendezvous, TcpPortAlreadyServedIsAnError) {
  const std::string address = testing::FreeTcpAddress();
  auto first = OpenStore({.address = address, .rank = 0, .size = 2});
  ASSERT_TRUE(first.ok());
  auto second = OpenStore({.address = address, .rank = 0, .size = 2});
  EXPECT_EQ(second.status().code(), Code::kIo) << second.status().ToString();
}

}  // namespace
}  // namespace estuary::comm
