// What a certified site can cost the running estuary-server, and what the
// server does about a site that does not read or holds its place: the
// memory a connection may buffer, alone and all of them together, before
// and after its Hello; the model downloads a site that does not read holds
// up; which version a site is taken to hold; the idle timeout of a site the
// server itself holds paused. Each test is an attack that the
// server before these limits failed, and prints what it measured.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "proto/frame.h"
#include "tests/e2e/attacker.h"
#include "tests/e2e/federation.h"

namespace estuary::testing {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr uint64_t kMiB = 1u << 20;

// Under a sanitizer the server's resident size says nothing of its buffers
// (freed memory waits in quarantine; shadow memory): the attacks run, the
// bounds on memory are not checked.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kMemoryMeasurable = false;
#else
constexpr bool kMemoryMeasurable = true;
#endif

double MiB(uint64_t bytes) { return double(bytes) / double(kMiB); }
double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// The server's resident size once it has settled after starting.
uint64_t SettledResident(pid_t pid) {
  std::this_thread::sleep_for(milliseconds(300));
  return ResidentBytes(pid);
}

// A Hello as the real client sends it, keeping its models or not.
Status SayHello(RawClient& site, bool keeps_model) {
  v1::Envelope hello;
  hello.mutable_hello()->set_protocol_version(proto::kProtocolVersion);
  hello.mutable_hello()->set_num_examples(10);
  hello.mutable_hello()->set_keeps_model(keeps_model);
  ESTUARY_RETURN_IF_ERROR(site.Send(hello));
  ESTUARY_ASSIGN_OR_RETURN(auto welcome, site.Receive());
  if (!welcome.has_welcome()) return ProtocolError("expected welcome, got {}", proto::BodyName(welcome));
  return Status::Ok();
}

// A zero update for `start`'s round: UpdateBegin, chunks of 256 KiB, UpdateCommit.
Status SendZeroUpdate(RawClient& site, const v1::RoundStart& start) {
  const std::vector<float> zeros(start.manifest().total_elements(), 0.0f);
  ESTUARY_RETURN_IF_ERROR(site.Send(MakeUpdateBegin(start, zeros, 50)));
  const size_t bytes = zeros.size() * sizeof(float);
  for (size_t offset = 0; offset < bytes; offset += 256 << 10) {
    ESTUARY_RETURN_IF_ERROR(site.Send(MakeChunk(start.round(), offset,
                                                reinterpret_cast<const char*>(zeros.data()) + offset,
                                                std::min<size_t>(256 << 10, bytes - offset))));
  }
  return site.Send(MakeCommit(start.round(), zeros));
}

// The next UpdateAck, past heartbeat echoes and round messages.
Result<v1::UpdateAck> AwaitAck(RawClient& site) {
  for (;;) {
    ESTUARY_ASSIGN_OR_RETURN(auto envelope, site.Receive());
    if (envelope.has_update_ack()) return envelope.update_ack();
    if (envelope.has_error()) return Aborted("server error: {}", envelope.error().message());
  }
}

// Before: heartbeats from a site that never read the echoes
// took the server to 783 MB (7.6 MB per MiB sent). One echo now waits at a
// time, rebuilt from the timestamp alone, so neither many heartbeats nor
// large ones (fields the protocol does not define, which protobuf would
// echo) queue anything. (Once the socket is full, the write deadline cuts
// such a site off: TwoSelectedSitesThatNeverReadDoNotStallTheRound.)
TEST(ServerLimits, ASiteThatNeverReadsItsHeartbeatEchoesCostsTheServerNoMemory) {
  Federation f;
  f.Issue("site-1");
  // Two clients per round: this one alone starts none.
  const uint16_t port = f.StartServer(1, 2);
  ASSERT_NE(port, 0);
  const pid_t pid = f.server().pid();
  auto site = RawClient::Connect(port, f.Files("site-1"));
  ASSERT_TRUE(site.ok()) << site.status().ToString();
  ASSERT_TRUE((*site)->Handshake().ok());
  const uint64_t before = SettledResident(pid);

  v1::Envelope beat;
  beat.mutable_heartbeat()->set_sent_unix_ms(1);
  const std::string small = Frames(beat, 1 << 16);                    // 64 Ki heartbeats of a few bytes
  const std::string padded = Frames(PaddedHeartbeat(4 << 10), 256);  // 1 MiB of heartbeats of 4 KiB
  uint64_t sent = 0, grown = 0;
  const auto start = Clock::now();
  {
    PeakResident peak(pid);
    if ((*site)->SendBytes(small).ok()) sent += small.size();
    for (int i = 0; i < 48 && (*site)->SendBytes(padded).ok(); ++i) sent += padded.size();
    std::this_thread::sleep_for(milliseconds(200));
    grown = peak.peak() > before ? peak.peak() - before : 0;
  }
  const double sending = SecondsSince(start);
  EXPECT_EQ(sent, small.size() + 48 * padded.size()) << "the server read all of it";
  if (kMemoryMeasurable) {
    EXPECT_LT(grown, 16 * kMiB) << "resident growth while " << MiB(sent) << " MiB of heartbeats arrived";
  }
  std::printf("heartbeats never read: %.1f MiB sent in %.2f s; server resident %.1f MiB before, peak +%.1f MiB\n",
              MiB(sent), sending, MiB(before), MiB(grown));
}

// Before: 200 connections each holding a 4 MiB frame less one byte
// before any Hello took the server to 864 MB. Until its Hello a frame may
// hold 64 KiB: a larger one is refused at its length prefix, unread.
TEST(ServerLimits, AFrameLargerThanAHelloBeforeTheHelloIsRefusedUnread) {
  Federation f;
  f.Issue("site-1");
  const uint16_t port = f.StartServer(1, 2, {"--event-interval", "1"});
  ASSERT_NE(port, 0);
  const pid_t pid = f.server().pid();
  const uint64_t before = SettledResident(pid);
  constexpr int kConnections = 64;
  const uint32_t size = (4u << 20) - 1;
  const std::string frame = FrameHeader(size) + std::string(size - 1, 'x');  // the last byte held back
  std::vector<std::unique_ptr<RawClient>> held;
  uint64_t grown = 0;
  const auto start = Clock::now();
  {
    PeakResident peak(pid);
    for (int i = 0; i < kConnections; ++i) {
      auto connection = RawClient::Connect(port, f.Files("site-1"));
      ASSERT_TRUE(connection.ok()) << connection.status().ToString();
      (*connection)->SetTimeouts(milliseconds(500));
      (void)(*connection)->SendBytes(frame);  // refused after its first four bytes
      held.push_back(std::move(connection).value());
    }
    std::this_thread::sleep_for(milliseconds(200));
    grown = peak.peak() > before ? peak.peak() - before : 0;
  }
  if (kMemoryMeasurable) {
    EXPECT_LT(grown, 32 * kMiB) << kConnections << " frames of 4 MiB before hello";
  }
  EXPECT_TRUE(f.AwaitLog("exceeds the limit of 65536 bytes before hello", seconds(5))) << f.ServerLog();
  std::printf("%d connections sending a 4 MiB frame before hello: %.2f s; server resident %.1f MiB before, "
              "peak +%.1f MiB\n",
              kConnections, SecondsSince(start), MiB(before), MiB(grown));
}

// Before: the frames all sessions are receiving share one budget
// (--frame-memory). Sixteen sites each send a frame of the largest size but
// its last byte: four fit in 16 MiB, the others wait unread. Once they are
// gone the memory goes back to the system.
TEST(ServerLimits, FramesBeingReceivedStayWithinTheServersBudgetAndAreGivenBack) {
  Federation f;
  constexpr int kSites = 16;
  for (int i = 0; i < kSites; ++i) f.Issue(fmt::format("site-{}", i));
  // One more client than connects: no round starts.
  const uint16_t port = f.StartServer(1, kSites + 1, {"--frame-memory", std::to_string(16 * kMiB)});
  ASSERT_NE(port, 0);
  const pid_t pid = f.server().pid();
  std::vector<std::unique_ptr<RawClient>> sites;
  for (int i = 0; i < kSites; ++i) {
    auto site = RawClient::Connect(port, f.Files(fmt::format("site-{}", i)));
    ASSERT_TRUE(site.ok()) << site.status().ToString();
    ASSERT_TRUE((*site)->Handshake().ok());
    sites.push_back(std::move(site).value());
  }
  const uint64_t before = SettledResident(pid);
  const uint32_t size = uint32_t(proto::kDefaultMaxFrameBytes);
  const std::string frame = FrameHeader(size) + std::string(size - 1, 'x');
  uint64_t grown = 0;
  {
    PeakResident peak(pid);
    for (auto& site : sites) {
      // A site the server does not read blocks: it gives up after 200 ms.
      site->SetTimeouts(milliseconds(200));
      (void)site->SendBytes(frame);
    }
    std::this_thread::sleep_for(milliseconds(300));
    grown = peak.peak() > before ? peak.peak() - before : 0;
  }
  if (kMemoryMeasurable) {
    EXPECT_LT(grown, 28 * kMiB) << "16 MiB of frames at most, not " << kSites * 4;
  }
  for (auto& site : sites) site->Abort();
  sites.clear();
  const auto gone = Clock::now();
  uint64_t after = ResidentBytes(pid);
  while (kMemoryMeasurable && after > before + 6 * kMiB && Clock::now() - gone < seconds(5)) {
    std::this_thread::sleep_for(milliseconds(100));
    after = ResidentBytes(pid);
  }
  if (kMemoryMeasurable) {
    EXPECT_LT(after, before + 6 * kMiB) << "given back";
  }
  std::printf("%d sites each sending a 4 MiB frame less its last byte (budget 16 MiB): server resident %.1f MiB "
              "before, peak +%.1f MiB, +%.1f MiB %.1f s after they left\n",
              kSites, MiB(before), MiB(grown), MiB(after > before ? after - before : 0), SecondsSince(gone));
}

// Before: two selected sites that never read held both download places;
// the three honest sites received none of the 6.65 MB model and the round
// failed. Now a download gives its place to the next after
// --download-slot-timeout, and a site that reads nothing is cut off by the
// write deadline, so the round commits with the honest sites' updates.
TEST(ServerLimits, TwoSelectedSitesThatNeverReadDoNotStallTheRound) {
  Federation f;
  // Sampled sites are offered in name order: the stalled ones first.
  const std::vector<std::string> stalled_names = {"a-stalled-1", "a-stalled-2"};
  const std::vector<std::string> honest_names = {"site-1", "site-2", "site-3"};
  for (const auto& name : stalled_names) f.Issue(name);
  for (const auto& name : honest_names) f.Issue(name);
  const uint16_t port = f.StartServer(
      1, 5, {"--model", "cnn", "--write-timeout", "3", "--download-slot-timeout", "1", "--min-updates", "3"});
  ASSERT_NE(port, 0);
  std::vector<std::unique_ptr<RawClient>> stalled;
  for (const auto& name : stalled_names) {
    auto site = RawClient::Connect(port, f.Files(name));
    ASSERT_TRUE(site.ok()) << site.status().ToString();
    ASSERT_TRUE((*site)->Handshake().ok());  // and never reads again
    stalled.push_back(std::move(site).value());
  }
  const auto start = Clock::now();
  std::vector<std::unique_ptr<ChildProcess>> honest;
  for (const auto& name : honest_names) honest.push_back(f.StartClient(name, port));
  ASSERT_TRUE(f.AwaitCommitted(1, seconds(30))) << f.ServerLog();
  const double committed = SecondsSince(start);
  EXPECT_EQ(f.WaitServer(), 0) << f.ServerLog();
  for (auto& client : honest) EXPECT_EQ(client->Wait(), 0);

  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  const auto participants = ParticipationsByName(*store, 1);
  for (const auto& name : stalled_names) {
    ASSERT_EQ(participants.count(name), 1u) << name;
    EXPECT_EQ(participants.at(name).status, "dropped") << name;
  }
  for (const auto& name : honest_names) {
    ASSERT_EQ(participants.count(name), 1u) << name;
    EXPECT_EQ(participants.at(name).status, "committed") << name;
  }
  const std::string log = f.ServerLog();
  EXPECT_NE(log.find("the next starts beside it"), std::string::npos) << log;
  EXPECT_NE(log.find("the peer does not read"), std::string::npos) << log;
  std::printf("two selected sites that never read: round 1 committed %.2f s after the honest sites started\n",
              committed);
}

// Before: on a retried round the server told sites that never received
// the model that they held it (model_follows = false). A site holds a
// version once its update for the round confirms it (and it keeps models);
// a download written to its socket is not enough.
TEST(ServerLimits, ARetriedRoundSendsTheModelAgainToASiteThatNeverConfirmedIt) {
  Federation f;
  f.Issue("site-1");
  f.Issue("site-2");
  // Two updates needed: one arrives, and the round fails at its deadline.
  const uint16_t port = f.StartServer(1, 2, {"--round-deadline", "2", "--min-updates", "2"});
  ASSERT_NE(port, 0);
  std::vector<std::unique_ptr<RawClient>> sites;
  for (const char* name : {"site-1", "site-2"}) {
    auto site = RawClient::Connect(port, f.Files(name));
    ASSERT_TRUE(site.ok()) << site.status().ToString();
    ASSERT_TRUE(SayHello(**site, /*keeps_model=*/true).ok());
    sites.push_back(std::move(site).value());
  }
  std::vector<float> model;
  std::vector<v1::RoundStart> first;
  for (auto& site : sites) {
    auto start = site->AwaitRound(&model);  // the whole model, read
    ASSERT_TRUE(start.ok()) << start.status().ToString();
    EXPECT_TRUE(start->model_follows());
    first.push_back(*start);
  }
  // site-1 uploads (confirming what it trained on); site-2 never does.
  ASSERT_TRUE(SendZeroUpdate(*sites[0], first[0]).ok());
  auto ack = AwaitAck(*sites[0]);
  ASSERT_TRUE(ack.ok()) << ack.status().ToString();
  EXPECT_TRUE(ack->accepted()) << ack->detail();

  ASSERT_TRUE(f.AwaitLog("round 1 failed", seconds(10))) << f.ServerLog();
  std::vector<v1::RoundStart> retried;
  for (auto& site : sites) {
    auto start = site->AwaitRound(&model);
    ASSERT_TRUE(start.ok()) << start.status().ToString();
    EXPECT_EQ(start->round(), 1u);
    retried.push_back(*start);
  }
  EXPECT_FALSE(retried[0].model_follows()) << "site-1 confirmed version 0 with its update";
  EXPECT_TRUE(retried[1].model_follows()) << "site-2 was sent the model but never confirmed it";
}

// Before: a site paused for a staging slot kept its idle timer running
// and was closed while it waited for the server. One slot: site-1 holds it
// (sending heartbeats), site-2 waits paused, silent for 4.5 s with an idle
// timeout of 2 s, and still uploads once site-1 is done.
TEST(ServerLimits, ASitePausedForAStagingSlotIsNotClosedAsIdle) {
  Federation f;
  f.Issue("site-1");
  f.Issue("site-2");
  const uint16_t port = f.StartServer(1, 2, {"--staging-slots", "1", "--idle-timeout", "2"});
  ASSERT_NE(port, 0);
  std::vector<std::unique_ptr<RawClient>> sites;
  for (const char* name : {"site-1", "site-2"}) {
    auto site = RawClient::Connect(port, f.Files(name));
    ASSERT_TRUE(site.ok()) << site.status().ToString();
    ASSERT_TRUE((*site)->Handshake().ok());
    sites.push_back(std::move(site).value());
  }
  std::vector<float> model;
  std::vector<v1::RoundStart> starts;
  for (auto& site : sites) {
    auto start = site->AwaitRound(&model);
    ASSERT_TRUE(start.ok()) << start.status().ToString();
    starts.push_back(*start);
  }
  const std::vector<float> zeros(model.size(), 0.0f);
  auto& holder = *sites[0];
  auto& waiter = *sites[1];
  ASSERT_TRUE(holder.Send(MakeUpdateBegin(starts[0], zeros, 50)).ok());
  std::this_thread::sleep_for(milliseconds(100));  // site-1's UpdateBegin is staged first
  ASSERT_TRUE(waiter.Send(MakeUpdateBegin(starts[1], zeros, 50)).ok());
  v1::Envelope beat;
  beat.mutable_heartbeat()->set_sent_unix_ms(1);
  for (int i = 0; i < 18; ++i) {  // 4.5 s: site-1 stays alive, site-2 says nothing
    std::this_thread::sleep_for(milliseconds(250));
    ASSERT_TRUE(holder.Send(beat).ok());
  }
  // site-1 finishes; its slot passes to site-2, which sends its update now.
  const size_t bytes = zeros.size() * sizeof(float);
  for (size_t offset = 0; offset < bytes; offset += 256 << 10) {
    ASSERT_TRUE(holder.Send(MakeChunk(1, offset, reinterpret_cast<const char*>(zeros.data()) + offset,
                                      std::min<size_t>(256 << 10, bytes - offset))).ok());
  }
  ASSERT_TRUE(holder.Send(MakeCommit(1, zeros)).ok());
  for (size_t offset = 0; offset < bytes; offset += 256 << 10) {
    ASSERT_TRUE(waiter.Send(MakeChunk(1, offset, reinterpret_cast<const char*>(zeros.data()) + offset,
                                      std::min<size_t>(256 << 10, bytes - offset))).ok());
  }
  ASSERT_TRUE(waiter.Send(MakeCommit(1, zeros)).ok());
  for (auto* site : {&holder, &waiter}) {
    auto ack = AwaitAck(*site);
    ASSERT_TRUE(ack.ok()) << ack.status().ToString() << "\n" << f.ServerLog();
    EXPECT_TRUE(ack->accepted()) << ack->detail();
  }
  EXPECT_TRUE(f.AwaitCommitted(1, seconds(10)));
  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto round = store->GetRound(1);
  ASSERT_TRUE(round.ok() && round->has_value());
  EXPECT_EQ((*round)->updates_received, 2u);
  EXPECT_EQ(f.ServerLog().find("client site-2 dropped out of round 1"), std::string::npos) << f.ServerLog();
}

// A session reads an update's next chunk while the server stages the last
// (one frame ahead), each charged to the frame budget. With a budget of one
// frame and chunks of 3 MiB, two never fit at once: the read ahead waits for
// the staged chunk's charge to come back, and every charge does come back
// (one kept would stall the next chunk, and the site would get no ack).
TEST(ServerLimits, ChunksReadAheadWaitForABudgetOfOneFrameAndTheUpdateCommits) {
  Federation f;
  f.Issue("site-1");
  const uint16_t port =
      f.StartServer(1, 1, {"--model", "cnn", "--frame-memory", std::to_string(proto::kDefaultMaxFrameBytes)});
  ASSERT_NE(port, 0);
  auto connected = RawClient::Connect(port, f.Files("site-1"));
  ASSERT_TRUE(connected.ok()) << connected.status().ToString();
  auto& site = **connected;
  ASSERT_TRUE(SayHello(site, /*keeps_model=*/false).ok());
  std::vector<float> model;
  auto start = site.AwaitRound(&model);
  ASSERT_TRUE(start.ok()) << start.status().ToString();
  std::vector<float> delta(model.size());
  for (size_t i = 0; i < delta.size(); ++i) delta[i] = float(i % 7) * 1e-3f;
  const size_t bytes = delta.size() * sizeof(float);
  constexpr size_t kChunk = 3 * kMiB;
  ASSERT_GT(bytes, 2 * kChunk) << "the update needs three chunks at least";
  ASSERT_TRUE(site.Send(MakeUpdateBegin(*start, delta, 50)).ok());
  for (size_t offset = 0; offset < bytes; offset += kChunk) {
    ASSERT_TRUE(site.Send(MakeChunk(start->round(), offset, reinterpret_cast<const char*>(delta.data()) + offset,
                                    std::min(kChunk, bytes - offset))).ok());
  }
  ASSERT_TRUE(site.Send(MakeCommit(start->round(), delta)).ok());
  auto ack = AwaitAck(site);
  ASSERT_TRUE(ack.ok()) << ack.status().ToString() << "\n" << f.ServerLog();
  EXPECT_TRUE(ack->accepted()) << ack->detail();
  EXPECT_TRUE(f.AwaitCommitted(1, seconds(10))) << f.ServerLog();
}

}  // namespace
}  // namespace estuary::testing
