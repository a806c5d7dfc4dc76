// End-to-end: a client site of several ranks (estuary-client --ranks N) is
// one federated client. The real binaries on 127.0.0.1: a server, a
// multi-rank site and an ordinary one.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>

#include <chrono>
#include <map>
#include <regex>
#include <thread>

#include "client/compute.h"
#include "client/launch.h"
#include "models/language_model.h"
#include "models/llama.h"
#include "tests/e2e/federation.h"
#include "tests/e2e/harness.h"
#include "tests/models/tiny_hf_base.h"

namespace estuary::testing {
namespace {

using Clock = std::chrono::steady_clock;

// Where the site says each round trained, from its log ("round 2 trained on
// models::Model on cpu in f32, 2 ranks (gloo, ddp) in 0.41 s"), in round order.
std::vector<std::string> TrainedOn(const std::string& log) {
  static const std::regex line(R"(round (\d+) trained on (.+) in [0-9.]+ s; uploading)");
  std::map<int, std::string> by_round;
  for (auto it = std::sregex_iterator(log.begin(), log.end(), line); it != std::sregex_iterator(); ++it) {
    by_round[std::stoi((*it)[1].str())] = (*it)[2].str();
  }
  std::vector<std::string> out;
  for (const auto& [round, where] : by_round) out.push_back(where);
  return out;
}

struct SiteRound {
  std::string trained_on;  // as the site reported it
  std::string status;
  uint64_t examples = 0;
  double site_loss = 0;   // the multi-rank site's train loss, as the server recorded it
  double other_loss = 0;  // the ordinary site's
  double test_loss = 0;
  uint64_t clients = 0;   // participants the server saw in the round
};

// Two rounds with "site-multi" started with `flags` and an ordinary
// "site-plain"; the same certificates' names, data and seeds every time, so
// only the multi-rank site's flags differ between calls.
// second_node: flags of a second node's estuary-client for the same site
// (started without certificates: only global rank 0 talks to the server).
std::vector<SiteRound> RunTwoRounds(const std::vector<std::string>& flags,
                                    const std::vector<std::string>& second_node = {}, bool several_ranks = true) {
  Federation f;
  f.Issue("site-multi");
  f.Issue("site-plain");
  // 270 training examples (300 less the 10% --eval-split holds out by default) in batches of 7: 38
  // batches split 4/3 (or 3/2/2), and a short last one of 4.
  const uint16_t port = f.StartServer(2, 2, {"--batch", "7", "--momentum", "0.5"});
  auto multi = f.StartClient("site-multi", port, {}, flags);
  std::unique_ptr<ChildProcess> node1;
  if (!second_node.empty()) {
    std::vector<std::string> argv = {BinaryPath("estuary-client").string(), "--data", f.data().string()};
    argv.insert(argv.end(), second_node.begin(), second_node.end());
    node1 = std::make_unique<ChildProcess>(argv, f.dir() / "node1.log");
  }
  auto plain = f.StartClient("site-plain", port);
  EXPECT_EQ(multi->Wait(), 0) << f.ClientLog("site-multi");
  if (node1) {
    EXPECT_EQ(node1->Wait(), 0) << f.ClientLog("node1");
  }
  EXPECT_EQ(plain->Wait(), 0) << f.ClientLog("site-plain");
  EXPECT_EQ(f.WaitServer(), 0) << f.ServerLog();
  std::vector<SiteRound> out;
  auto store = f.OpenStore();
  if (!store) return out;
  auto rounds = store->Rounds();
  EXPECT_TRUE(rounds.ok());
  if (!rounds.ok()) return out;
  const std::vector<std::string> trained_on = TrainedOn(f.ClientLog("site-multi"));
  EXPECT_EQ(trained_on.size(), rounds->size()) << f.ClientLog("site-multi");
  for (const auto& r : *rounds) {
    EXPECT_EQ(r.state, server::RoundState::kCommitted);
    auto participants = ParticipationsByName(*store, r.round);
    SiteRound s;
    if (out.size() < trained_on.size()) s.trained_on = trained_on[out.size()];
    s.status = participants["site-multi"].status;
    s.examples = participants["site-multi"].examples;
    s.site_loss = participants["site-multi"].train_loss;
    s.other_loss = participants["site-plain"].train_loss;
    s.test_loss = r.test_loss.value_or(-1);
    s.clients = participants.size();
    out.push_back(s);
  }
  if (several_ranks && std::find(flags.begin(), flags.end(), "1") == flags.end()) {
    // Every rank joined the one site.
    const std::string log = f.ClientLog("site-multi");
    EXPECT_NE(log.find("rank 1 of "), std::string::npos) << log;
  }
  return out;
}

// The site trained on N ranks (DDP, and ZeRO-3 on an uneven three-way split)
// reports what the same site trains in one process, to fp32 rounding: the
// per-round train loss the server logs, and the global model's test loss
// after the round, which depends on every weight of the site's update.
TEST(Site, RanksTrainTheUpdateOneProcessWould) {
  const auto reference = RunTwoRounds({"--ranks", "1"});
  ASSERT_EQ(reference.size(), 2u);
  for (const auto& r : reference) EXPECT_EQ(r.trained_on, "models::Model on cpu in f32, 1 rank (solo, ddp)");
  for (const auto& [flags, trained_on] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--ranks", "2", "--backend", "gloo"}, "2 ranks (gloo, ddp)"},
           {{"--ranks", "3", "--backend", "gloo", "--zero", "3"}, "3 ranks (gloo, zero3)"},
           // and node 1 below: 4 ranks
           {{"--nodes", "2", "--node-rank", "0", "--ranks", "2", "--zero", "1"}, "4 ranks (gloo, zero1)"},
           {{"--zero", "1"}, "1 rank (solo, zero1)"},  // ZeRO on one rank: honoured, not dropped
       }) {
    SCOPED_TRACE(fmt::format("{}", fmt::join(flags, " ")));
    std::vector<std::string> second_node;
    std::vector<std::string> first_node = flags;
    if (flags[0] == "--nodes") {
      auto address = comm::FreeLoopbackRendezvous();
      ASSERT_TRUE(address.ok());
      first_node.insert(first_node.end(), {"--rendezvous", *address});
      second_node = {"--nodes", "2", "--node-rank", "1", "--ranks", "2", "--zero", "1", "--rendezvous", *address};
    }
    const auto rounds = RunTwoRounds(first_node, second_node);
    ASSERT_EQ(rounds.size(), reference.size());
    for (size_t i = 0; i < rounds.size(); ++i) {
      SCOPED_TRACE(fmt::format("round {}", i + 1));
      std::printf("round %zu: site loss %.9g (one process %.9g), test loss %.9g (%.9g)\n", i + 1,
                  rounds[i].site_loss, reference[i].site_loss, rounds[i].test_loss, reference[i].test_loss);
      EXPECT_EQ(rounds[i].status, "committed");
      EXPECT_EQ(rounds[i].trained_on, "models::Model on cpu in f32, " + trained_on);
      EXPECT_EQ(rounds[i].clients, 2u);     // one client, not one per rank
      EXPECT_EQ(rounds[i].examples, 270u);  // the site's training examples, counted once
      EXPECT_NEAR(rounds[i].site_loss, reference[i].site_loss, 1e-5 * reference[i].site_loss);
      EXPECT_NEAR(rounds[i].test_loss, reference[i].test_loss, 1e-5 * reference[i].test_loss);
      EXPECT_NEAR(rounds[i].other_loss, reference[i].other_loss, 1e-5 * reference[i].other_loss);
    }
  }
}

struct TextRound {
  std::string trained_on;  // as the site reported it
  double train_loss = 0;  // the site's, as the server logged it
  double test_loss = 0;   // the global model's after the round: it depends on every value uploaded
  std::string model;      // the federation's, from the round log
};

// Two rounds of the server's language model (AdamW) trained by one text site
// started with `flags`; server_flags adds to the server's (a lora federation).
std::vector<TextRound> TextSiteLosses(const std::vector<std::string>& flags,
                                      const std::vector<std::string>& server_flags = {}) {
  Federation f;
  f.Issue("library");
  const fs::path text = f.dir() / "text";
  fs::create_directories(text);
  {
    std::ofstream out(text / "proverbs");
    for (int i = 0; i < 200; ++i) out << "a stitch in time saves nine, number " << i << "\n%\n";
  }
  std::vector<std::string> server = {"--model", "llama-tiny", "--eval-data", text.string(), "--optimizer",
                                     "adamw", "--lr", "0.003", "--batch", "5", "--seq-len", "32",
                                     "--max-local-steps", "3", "--eval-windows", "8"};
  server.insert(server.end(), server_flags.begin(), server_flags.end());
  const uint16_t port = f.StartServer(2, 1, server);
  auto site = f.StartClient("library", port, text, flags);
  EXPECT_EQ(site->Wait(), 0) << f.ClientLog("library");
  EXPECT_EQ(f.WaitServer(), 0) << f.ServerLog();
  std::vector<TextRound> out;
  auto store = f.OpenStore();
  if (!store) return out;
  auto rounds = store->Rounds();
  EXPECT_TRUE(rounds.ok());
  if (!rounds.ok() || rounds->size() != 2) return out;
  const std::vector<std::string> trained_on = TrainedOn(f.ClientLog("library"));
  auto model = store->GetMeta("model");
  EXPECT_TRUE(model.ok() && model->has_value());
  EXPECT_EQ(trained_on.size(), 2u) << f.ClientLog("library");
  for (const auto& r : *rounds) {
    auto p = ParticipationsByName(*store, r.round);
    EXPECT_EQ(p["library"].status, "committed");
    out.push_back({out.size() < trained_on.size() ? trained_on[out.size()] : "", p["library"].train_loss,
                   r.test_loss.value_or(-1), model.ok() ? model->value_or("") : ""});
  }
  return out;
}

// A text site on two ranks under ZeRO-2 trains the server's language model
// (AdamW) as it does on one: the logged train loss per round agrees to 1e-4
// (AdamW turns the ranks' different summation order into visible steps on a
// few weights; see tests/client/site_test.cc).
TEST(Site, ATextSiteOnTwoRanksTrainsTheLanguageModelAsOnOne) {
  const auto one = TextSiteLosses({"--ranks", "1"});
  const auto two = TextSiteLosses({"--ranks", "2", "--zero", "2"});
  ASSERT_EQ(one.size(), 2u);
  ASSERT_EQ(two.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(one[i].trained_on, "models::Llama on cpu in f32, 1 rank (solo, ddp)");
    EXPECT_EQ(two[i].trained_on, "models::Llama on cpu in f32, 2 ranks (gloo, zero2)");
    std::printf("round %zu: text site loss %.9g on 2 ranks, %.9g on one\n", i + 1, two[i].train_loss,
                one[i].train_loss);
    EXPECT_NEAR(two[i].train_loss, one[i].train_loss, 1e-4 * one[i].train_loss) << "round " << i + 1;
  }
}

// A site of a lora federation (rank-4 adapters, dropout 0.1, naive merge)
// trains its adapters on two ranks under ZeRO-1 as it does on one: the
// logged train loss, and the test loss of the global model after each round
// (base plus the merged adapters the site uploaded), agree to 1e-4.
TEST(Site, ALoraSiteOnTwoRanksTrainsItsAdaptersAsOnOne) {
  const std::vector<std::string> lora = {"--update-kind", "lora", "--lora-rank",    "4",   "--lora-alpha",
                                         "8",             "--lora-dropout", "0.1", "--lora-merge", "naive"};
  const auto one = TextSiteLosses({"--ranks", "1"}, lora);
  const auto two = TextSiteLosses({"--ranks", "2", "--zero", "1"}, lora);
  ASSERT_EQ(one.size(), 2u);
  ASSERT_EQ(two.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(one[i].trained_on, "models::LoraLlama on cpu in f32, 1 rank (solo, ddp)");
    EXPECT_EQ(two[i].trained_on, "models::LoraLlama on cpu in f32, 2 ranks (gloo, zero1)");
    std::printf("round %zu: lora site loss %.9g on 2 ranks, %.9g on one; test loss %.9g, %.9g\n", i + 1,
                two[i].train_loss, one[i].train_loss, two[i].test_loss, one[i].test_loss);
    EXPECT_NEAR(two[i].train_loss, one[i].train_loss, 1e-4 * one[i].train_loss) << "round " << i + 1;
    EXPECT_NEAR(two[i].test_loss, one[i].test_loss, 1e-4 * one[i].test_loss) << "round " << i + 1;
  }
  EXPECT_NE(one[0].test_loss, one[1].test_loss);  // the adapters moved the global model
}

// The same on a Hugging Face base the site holds (--base-model on the
// server and the site, each with its own copy): every rank loads the base
// from the site's copy, and two ranks under ZeRO-1 train as one does.
TEST(Site, ALoraSiteOnTwoRanksTrainsOnAHuggingFaceBaseAsOnOne) {
  TempDir dir;
  WriteTinyHfBase({dir / "server-base", dir / "site-base"}, 3);
  const std::vector<std::string> lora = {"--update-kind", "lora", "--lora-rank", "4", "--lora-alpha", "8",
                                         "--lora-merge", "naive", "--base-model", (dir / "server-base").string()};
  const std::vector<std::string> site = {"--base-model", (dir / "site-base").string()};
  auto with = [&](std::vector<std::string> flags) {
    flags.insert(flags.end(), site.begin(), site.end());
    return TextSiteLosses(flags, lora);
  };
  const auto one = with({"--ranks", "1"});
  const auto two = with({"--ranks", "2", "--zero", "1"});
  ASSERT_EQ(one.size(), 2u);
  ASSERT_EQ(two.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(one[i].trained_on, "models::LoraLlama on cpu in f32, 1 rank (solo, ddp)");
    EXPECT_EQ(two[i].trained_on, "models::LoraLlama on cpu in f32, 2 ranks (gloo, zero1)");
    std::printf("round %zu: lora site on an HF base, loss %.9g on 2 ranks, %.9g on one; test loss %.9g, %.9g\n",
                i + 1, two[i].train_loss, one[i].train_loss, two[i].test_loss, one[i].test_loss);
    EXPECT_NEAR(two[i].train_loss, one[i].train_loss, 1e-4 * one[i].train_loss) << "round " << i + 1;
    EXPECT_NEAR(two[i].test_loss, one[i].test_loss, 1e-4 * one[i].test_loss) << "round " << i + 1;
  }
  EXPECT_LT(one[1].test_loss, one[0].test_loss);
  EXPECT_EQ(two[0].model.rfind("server-base@", 0), 0u) << two[0].model;
}

// estuary-client --recompute trains the language model as the plain site
// does, bit for bit (the logged train loss, and the test loss of the global
// model it uploaded to), in full rounds on one rank and on two under ZeRO-3
// (whose gathers bracket the recomputation), and in lora rounds; and each
// round's report names the arena it ran with: the recomputing decoder's
// bytes for the task's batch, fewer than the plain decoder's.
TEST(Site, ATextSiteWithRecomputeTrainsAsWithoutAndReportsItsArena) {
  auto config = models::LlamaPreset("llama-tiny");
  ASSERT_TRUE(config.ok());
  auto kept = models::Llama::Create(*config, 5), recomputed = models::Llama::Create(*config, 5, true);
  ASSERT_TRUE(kept.ok() && recomputed.ok());
  const size_t arena = recomputed->activation_arena().size_bytes();
  EXPECT_LT(arena, kept->activation_arena().size_bytes());
  const std::vector<std::string> lora = {"--update-kind", "lora", "--lora-rank",    "4",   "--lora-alpha",
                                         "8",             "--lora-dropout", "0.1", "--lora-merge", "naive"};
  struct Case {
    std::vector<std::string> flags, server_flags;
    std::string engine, ranks;
  };
  for (const Case& c : {Case{{"--ranks", "1"}, {}, "models::Llama", "1 rank (solo, ddp)"},
                        Case{{"--ranks", "2", "--zero", "3"}, {}, "models::Llama", "2 ranks (gloo, zero3)"},
                        Case{{"--ranks", "1"}, lora, "models::LoraLlama", "1 rank (solo, ddp)"}}) {
    SCOPED_TRACE(fmt::format("{} {}", c.engine, c.ranks));
    std::vector<std::string> with = c.flags;
    with.push_back("--recompute");
    const auto plain = TextSiteLosses(c.flags, c.server_flags);
    const auto recompute = TextSiteLosses(with, c.server_flags);
    ASSERT_EQ(plain.size(), 2u);
    ASSERT_EQ(recompute.size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(plain[i].trained_on, fmt::format("{} on cpu in f32, {}", c.engine, c.ranks));
      EXPECT_EQ(recompute[i].trained_on,
                fmt::format("{} (recompute, arena {} bytes) on cpu in f32, {}", c.engine, arena, c.ranks));
      EXPECT_EQ(recompute[i].train_loss, plain[i].train_loss) << "round " << i + 1;
      EXPECT_EQ(recompute[i].test_loss, plain[i].test_loss) << "round " << i + 1;
    }
  }
}

// A site on one GPU (--gpus 0, or --device cuda) trains there, on the GPU
// engine in the precision asked, over a solo communicator; with --backend
// nccl the same one rank runs DDP and ZeRO-1 over NCCL instead and trains
// the same thing (the logged losses within 1e-5). Each run's own report says
// which engine, device, precision and communicator it ran.
TEST(Site, AnImageSiteOnOneGpuTrainsThereInThePrecisionAsked) {
#ifndef ESTUARY_HAVE_NCCL
  GTEST_SKIP() << "this build has no NCCL engine (CUDA or NCCL not found by CMake)";
#else
  if (auto usable = client::ParseCompute("cuda", "fp32"); !usable.ok()) GTEST_SKIP() << usable.status().message();
  const auto reference = RunTwoRounds({"--gpus", "0"}, {}, false);
  ASSERT_EQ(reference.size(), 2u);
  for (const auto& r : reference) {
    EXPECT_EQ(r.trained_on, "cuda::ClassifierEngine on cuda:0 in f32, 1 rank (solo, ddp)");
  }
  for (const auto& r : RunTwoRounds({"--device", "cuda"}, {}, false)) EXPECT_EQ(r.trained_on, reference[0].trained_on);
  for (const char* zero : {"0", "1"}) {
    const auto rounds = RunTwoRounds({"--gpus", "0", "--backend", "nccl", "--zero", zero}, {}, false);
    ASSERT_EQ(rounds.size(), reference.size());
    for (size_t i = 0; i < rounds.size(); ++i) {
      std::printf("round %zu: image site loss %.9g over NCCL (--zero %s), %.9g alone\n", i + 1, rounds[i].site_loss,
                  zero, reference[i].site_loss);
      EXPECT_EQ(rounds[i].status, "committed");
      EXPECT_EQ(rounds[i].trained_on, fmt::format("cuda::ClassifierEngine on cuda:0 in f32, 1 rank (nccl, {})",
                                                  zero[0] == '0' ? "ddp" : "zero1"));
      EXPECT_NEAR(rounds[i].site_loss, reference[i].site_loss, 1e-5 * reference[i].site_loss);
      EXPECT_NEAR(rounds[i].test_loss, reference[i].test_loss, 1e-5 * reference[i].test_loss);
    }
  }
  const auto bf16 = RunTwoRounds({"--gpus", "0", "--precision", "bf16"}, {}, false);
  ASSERT_EQ(bf16.size(), reference.size());
  for (size_t i = 0; i < bf16.size(); ++i) {
    EXPECT_EQ(bf16[i].trained_on, "cuda::ClassifierEngine on cuda:0 in bf16, 1 rank (solo, ddp)");
    EXPECT_NEAR(bf16[i].site_loss, reference[i].site_loss, 2e-2 * reference[i].site_loss);
  }
#endif
}

// The decoder on one GPU: --gpus 0 alone, over NCCL under DDP and ZeRO-1, and
// in bf16, each as its report says.
TEST(Site, ATextSiteOnOneGpuTrainsThereInThePrecisionAsked) {
#ifndef ESTUARY_HAVE_NCCL
  GTEST_SKIP() << "this build has no NCCL engine (CUDA or NCCL not found by CMake)";
#else
  if (auto usable = client::ParseCompute("cuda", "fp32"); !usable.ok()) GTEST_SKIP() << usable.status().message();
  const auto one = TextSiteLosses({"--gpus", "0"});
  ASSERT_EQ(one.size(), 2u);
  for (const auto& r : one) EXPECT_EQ(r.trained_on, "cuda::LlamaEngine on cuda:0 in f32, 1 rank (solo, ddp)");
  for (const char* zero : {"0", "1"}) {
    const auto nccl = TextSiteLosses({"--gpus", "0", "--backend", "nccl", "--zero", zero});
    ASSERT_EQ(nccl.size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      std::printf("round %zu: text site loss %.9g over NCCL (--zero %s), %.9g alone\n", i + 1, nccl[i].train_loss,
                  zero, one[i].train_loss);
      EXPECT_EQ(nccl[i].trained_on, fmt::format("cuda::LlamaEngine on cuda:0 in f32, 1 rank (nccl, {})",
                                                zero[0] == '0' ? "ddp" : "zero1"));
      EXPECT_NEAR(nccl[i].train_loss, one[i].train_loss, 1e-5 * one[i].train_loss)
          << "round " << i + 1 << ", --zero " << zero;
    }
  }
  const auto bf16 = TextSiteLosses({"--gpus", "0", "--precision", "bf16"});
  ASSERT_EQ(bf16.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(bf16[i].trained_on, "cuda::LlamaEngine on cuda:0 in bf16, 1 rank (solo, ddp)");
    EXPECT_NEAR(bf16[i].train_loss, one[i].train_loss, 2e-2 * one[i].train_loss);
  }
#endif
}

// A lora site on one GPU (cuda::LoraLlamaEngine, fp32): alone and over NCCL
// under DDP and ZeRO-1 it logs the same losses (1e-5), and follows the CPU
// site within 1e-3.
TEST(Site, ALoraSiteOnOneGpuTrainsThere) {
#ifndef ESTUARY_HAVE_NCCL
  GTEST_SKIP() << "this build has no NCCL engine (CUDA or NCCL not found by CMake)";
#else
  if (auto usable = client::ParseCompute("cuda", "fp32"); !usable.ok()) GTEST_SKIP() << usable.status().message();
  const std::vector<std::string> lora = {"--update-kind", "lora", "--lora-rank", "4", "--lora-alpha", "8",
                                         "--lora-merge", "exact"};
  const auto cpu = TextSiteLosses({}, lora);
  const auto one = TextSiteLosses({"--gpus", "0"}, lora);
  ASSERT_EQ(cpu.size(), 2u);
  ASSERT_EQ(one.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(cpu[i].trained_on, "models::LoraLlama on cpu in f32, 1 rank (solo, ddp)");
    EXPECT_EQ(one[i].trained_on, "cuda::LoraLlamaEngine on cuda:0 in f32, 1 rank (solo, ddp)");
    EXPECT_NEAR(one[i].train_loss, cpu[i].train_loss, 1e-3 * cpu[i].train_loss) << "round " << i + 1;
    EXPECT_NEAR(one[i].test_loss, cpu[i].test_loss, 1e-3 * cpu[i].test_loss) << "round " << i + 1;
  }
  for (const char* zero : {"0", "1"}) {
    const auto nccl = TextSiteLosses({"--gpus", "0", "--backend", "nccl", "--zero", zero}, lora);
    ASSERT_EQ(nccl.size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      std::printf("round %zu: lora site loss %.9g over NCCL (--zero %s), %.9g alone, %.9g on the CPU\n", i + 1,
                  nccl[i].train_loss, zero, one[i].train_loss, cpu[i].train_loss);
      EXPECT_EQ(nccl[i].trained_on, fmt::format("cuda::LoraLlamaEngine on cuda:0 in f32, 1 rank (nccl, {})",
                                                zero[0] == '0' ? "ddp" : "zero1"));
      EXPECT_NEAR(nccl[i].train_loss, one[i].train_loss, 1e-5 * one[i].train_loss)
          << "round " << i + 1 << ", --zero " << zero;
      EXPECT_NEAR(nccl[i].test_loss, one[i].test_loss, 1e-5 * one[i].test_loss)
          << "round " << i + 1 << ", --zero " << zero;
    }
  }
#endif
}

// Polls `read` until `pattern` matches, for up to `limit`; returns the match.
std::smatch AwaitLog(const std::function<std::string()>& read, const std::regex& pattern, std::chrono::seconds limit,
                     std::string* text) {
  const auto deadline = Clock::now() + limit;
  std::smatch match;
  while (Clock::now() < deadline) {
    *text = read();
    if (std::regex_search(*text, match, pattern)) return match;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return match;
}

// Sends `signal` to follower rank 1 in the middle of round 1 and checks that
// the site gave up within `limit` seconds of it, with a line holding
// `expected` ({pid} stands for rank 1's pid), and that the server recorded it
// as dropped from the round, which commits with the other site.
void BreakARankMidRound(int signal, const std::string& rank_timeout, double limit, const std::string& expected) {
  Federation f;
  f.Issue("site-multi");
  f.Issue("site-plain");
  const uint16_t port = f.StartServer(1, 2, {"--epochs", "60"});
  auto multi = f.StartClient("site-multi", port, {},
                             {"--ranks", "2", "--backend", "gloo", "--rank-timeout", rank_timeout, "--log-level", "debug"});
  auto plain = f.StartClient("site-plain", port);

  // Rank 1 announces its pid when it joins, and the round when it starts training it.
  std::string log;
  auto read = [&] { return f.ClientLog("site-multi"); };
  auto joined = AwaitLog(read, std::regex(R"(rank 1 of 2 \(pid (\d+),)"), std::chrono::seconds(60), &log);
  ASSERT_FALSE(joined.empty()) << log;
  const pid_t follower = std::stoi(joined[1].str());
  ASSERT_FALSE(AwaitLog(read, std::regex("site rank 1: round 1 "), std::chrono::seconds(60), &log).empty()) << log;
  ASSERT_EQ(kill(follower, signal), 0);
  const auto sent = Clock::now();

  const int code = multi->Wait();
  const double seconds = std::chrono::duration<double>(Clock::now() - sent).count();
  log = f.ClientLog("site-multi");
  EXPECT_NE(code, 0) << log;
  EXPECT_LT(seconds, limit) << log;
  const std::string line = fmt::format(fmt::runtime(expected), fmt::arg("pid", follower));
  EXPECT_NE(log.find(line), std::string::npos) << line << "\n" << log;
  EXPECT_EQ(plain->Wait(), 0) << f.ClientLog("site-plain");
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  // The stopped rank is gone too: the launcher killed and reaped it.
  EXPECT_NE(kill(follower, 0), 0);

  // The operator's view.
  auto show = RunCommand(fmt::format("{} rounds show 1 --db {} --json", BinaryPath("estuary-server").string(),
                                     f.db().string()));
  ASSERT_EQ(show.exit_code, 0) << show.output;
  auto json = nlohmann::json::parse(show.output, nullptr, false);
  ASSERT_FALSE(json.is_discarded()) << show.output;
  std::map<std::string, std::string> status;
  for (const auto& p : json["participants"]) status[p["client"].get<std::string>()] = p["status"].get<std::string>();
  EXPECT_EQ(status["site-multi"], "dropped") << show.output;
  EXPECT_EQ(status["site-plain"], "committed") << show.output;
  EXPECT_EQ(json["state"], "committed") << show.output;
}

// A follower killed mid-round: its sockets close and the launcher reaps it,
// so the site gives up at once, naming the rank.
TEST(Site, AKilledRankDropsTheSiteFromTheRound) {
  BreakARankMidRound(SIGKILL, "20", 20, "estuary-client: site rank 1 (pid {pid}) was killed by signal 9");
}

// A follower that stalls (SIGSTOP) mid-round: nothing closes, so only the
// communicator's timeout can tell; the site gives up after --rank-timeout.
TEST(Site, AStalledRankDropsTheSiteAfterTheTimeout) {
  BreakARankMidRound(SIGSTOP, "3", 3 + 5, "Timed out waiting 3000ms");
}

// Bad site flags: one line naming the flag, before anything starts.
TEST(Site, BadFlagsGetOneLine) {
  const std::string client = BinaryPath("estuary-client").string();
  for (const auto& [flags, expected] : {
           std::pair<std::string, std::string>{"--ranks 0", "--ranks 0: must be at least 1"},
           {"--zero 4", "--zero 4: expected 0 (DDP), 1, 2 or 3"},
           {"--gpus all", "--gpus all: "},
           {"--nodes 2 --node-rank 2 --rendezvous tcp://127.0.0.1:1", "--node-rank 2: must be in [0, --nodes 2)"},
           {"--nodes 2", "--nodes 2: a multi-node site needs --rendezvous"},
           {"--backend mpi", "--backend 'mpi': expected gloo or nccl"},
           {"--rank-timeout 0", "--rank-timeout 0"},
           {"--lora-base-dtype f16", "--lora-base-dtype 'f16': expected f32 or bf16"},
       }) {
    auto r = RunCommand(fmt::format("{} --data /nonexistent {}", client, flags));
    EXPECT_NE(r.exit_code, 0) << flags;
    EXPECT_NE(r.output.find(expected), std::string::npos) << flags << ": " << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << flags << ": " << r.output;
  }
}

}  // namespace
}  // namespace estuary::testing
