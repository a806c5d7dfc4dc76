// The simulator end to end on a small synthetic federation: reproducibility
// in process, and agreement between the in-process and loopback modes.
#include <gtest/gtest.h>
#include <fmt/format.h>

#include <cmath>
#include <fstream>
#include <map>

#include "aggregation/lora_merge.h"
#include "aggregation/sampling.h"
#include "base/split.h"
#include "client/compute.h"
#include "client/task.h"
#include "client/site.h"
#include "crypto/certs.h"
#include "crypto/revocation.h"
#include "crypto/sha256.h"
#include "models/hf_base.h"
#include "models/language_model.h"
#include "models/llama.h"
#include "models/lora_federation.h"
#include "models/text_corpus.h"
#include "simulations/lora_fortunes.h"
#include "simulations/runner.h"
#include "tests/simulations/cuda_follows.h"
#include "tests/simulations/small_mnist.h"
#include "tests/models/tiny_hf_base.h"
#include "tests/simulations/text_topics.h"
#include "tests/e2e/harness.h"

namespace estuary::simulations {
namespace {

// The task the simulator hands its sites.
v1::TaskConfig SiteTask(const Scenario& s) { return FederationOf(s).task(); }

// A site of one process on `tokens`, training its own adapter rank.
std::unique_ptr<client::Trainer> TextSite(const std::vector<int32_t>& tokens, int lora_rank = 0) {
  auto site = client::MakeLocalSite({.text = std::make_shared<const std::vector<int32_t>>(tokens)},
                                    {.lora_rank = lora_rank});
  EXPECT_TRUE(site.ok()) << site.status().ToString();
  return std::move(site).value();
}

void SetTargets(Scenario& s, const std::string& modules) {
  s.task().mutable_lora()->clear_target_modules();
  for (const std::string& module : SplitCommas(modules)) s.task().mutable_lora()->add_target_modules(module);
}


TEST(Simulation, InprocIsBitwiseReproducibleFromTheSeed) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  const Scenario s = Small(dir / "data", dir / "run");
  auto first = RunInproc(s, nullptr);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto second = RunInproc(s, nullptr);
  ASSERT_TRUE(second.ok());
  ASSERT_EQ(first->rounds.size(), 3u);
  for (size_t r = 0; r < 3; ++r) {
    EXPECT_EQ(first->rounds[r].global_checksum, second->rounds[r].global_checksum) << "round " << r + 1;
    EXPECT_EQ(first->rounds[r].test_accuracy, second->rounds[r].test_accuracy);
  }
  EXPECT_NE(first->rounds[0].global_checksum, first->rounds[1].global_checksum);
  Scenario other = s;
  other.task().set_seed(12);
  auto third = RunInproc(other, nullptr);
  ASSERT_TRUE(third.ok());
  EXPECT_NE(third->rounds[0].global_checksum, first->rounds[0].global_checksum);
  // A thread count changes the schedule, not the result.
  Scenario one_thread = s;
  one_thread.threads = 1;
  auto fourth = RunInproc(one_thread, nullptr);
  ASSERT_TRUE(fourth.ok());
  EXPECT_EQ(fourth->rounds.back().global_checksum, first->rounds.back().global_checksum);
}

// The same federation with the clients' MLP on a GPU (fp32): it follows the
// CPU run to rounding.
TEST(Simulation, CudaClientsFollowTheCpuRun) {
  if (auto usable = client::ParseCompute("cuda", "fp32"); !usable.ok()) {
    GTEST_SKIP() << usable.status().message();
  }
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  const Scenario s = Small(dir / "data", dir / "run");
  auto cpu = RunInproc(s, nullptr);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  Scenario gpu = s;
  gpu.device = "cuda";
  auto run = RunInproc(gpu, nullptr);
  ASSERT_TRUE(run.ok()) << run.status().ToString();
  for (size_t r = 0; r < cpu->rounds.size(); ++r) {
    EXPECT_NEAR(run->rounds[r].test_loss, cpu->rounds[r].test_loss, 1e-3 * cpu->rounds[r].test_loss) << r + 1;
    EXPECT_NEAR(run->rounds[r].test_accuracy, cpu->rounds[r].test_accuracy, 0.01) << r + 1;
  }
}

TEST(Simulation, LoopbackAgreesWithInproc) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  Scenario s = Small(dir / "data", dir / "run");
  s.server_binary = testing::BinaryPath("estuary-server");
  auto inproc = RunInproc(s, nullptr);
  ASSERT_TRUE(inproc.ok()) << inproc.status().ToString();
  s.mode = "loopback";
  auto loopback = RunLoopback(s, nullptr);
  ASSERT_TRUE(loopback.ok()) << loopback.status().ToString();
  ASSERT_EQ(loopback->rounds.size(), 3u);
  EXPECT_FALSE(loopback->round_log.empty());
  for (size_t r = 0; r < 3; ++r) {
    EXPECT_EQ(loopback->rounds[r].clients_selected, 4u);
    EXPECT_EQ(loopback->rounds[r].updates_received, 4u);
    // Same clients, same data, same init: only the fold order differs.
    EXPECT_NEAR(loopback->rounds[r].test_accuracy, inproc->rounds[r].test_accuracy, 0.005) << "round " << r + 1;
    EXPECT_NEAR(loopback->rounds[r].test_loss, inproc->rounds[r].test_loss, 1e-3);
  }
}

// Under --secagg the loopback sites run SecAgg+ with the server over their
// TLS sessions (estuary-server serve --secagg): the same federation as in
// process, up to quantisation, rounding and fold order; the round log's bytes
// reach the report.
TEST(Simulation, LoopbackRunsSecAggOverTheSessions) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  Scenario s = Small(dir / "data", dir / "run");
  s.server_binary = testing::BinaryPath("estuary-server");
  s.secagg = true;
  s.federation.mutable_limits()->set_max_norm_over_median(0);  // as estuary-sim sets it under --secagg
  auto inproc = RunInproc(s, nullptr);
  ASSERT_TRUE(inproc.ok()) << inproc.status().ToString();
  s.mode = "loopback";
  auto loopback = RunLoopback(s, nullptr);
  ASSERT_TRUE(loopback.ok()) << loopback.status().ToString();
  ASSERT_EQ(loopback->rounds.size(), 3u);
  for (size_t r = 0; r < 3; ++r) {
    const RoundReport& row = loopback->rounds[r];
    EXPECT_EQ(row.updates_received, 4u);
    ASSERT_TRUE(row.secagg_bytes_per_site.has_value()) << "round " << r + 1;
    // The masked input (4 bytes a parameter of the MLP) and a little more.
    EXPECT_GT(*row.secagg_bytes_per_site, 4u * 199210);
    EXPECT_LT(*row.secagg_bytes_per_site, 4u * 199210 + 8192);
    EXPECT_EQ(row.secagg_dropouts, 0u);
    EXPECT_NEAR(row.test_accuracy, inproc->rounds[r].test_accuracy, 0.005) << "round " << r + 1;
  }
}

// The server runs the robust rules over its staged update files: the same
// sites' updates give the in-process run's global models bit for bit (the
// coordinate-wise rules do not depend on the order updates arrive in).
TEST(Simulation, LoopbackRunsTheRobustRulesAsInprocDoes) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  for (const char* rule : {"median", "trimmed-mean"}) {
    Scenario s = Small(dir / "data", dir / "run" / rule);
    s.rounds = 2;
    s.federation.mutable_strategy()->set_name(rule);
    if (std::string(rule) == "trimmed-mean") s.federation.mutable_strategy()->set_trim(0.25);
    s.server_binary = testing::BinaryPath("estuary-server");
    auto inproc = RunInproc(s, nullptr);
    ASSERT_TRUE(inproc.ok()) << rule << ": " << inproc.status().ToString();
    s.mode = "loopback";
    auto loopback = RunLoopback(s, nullptr);
    ASSERT_TRUE(loopback.ok()) << rule << ": " << loopback.status().ToString();
    ASSERT_EQ(loopback->rounds.size(), 2u);
    for (size_t r = 0; r < 2; ++r) {
      EXPECT_EQ(loopback->rounds[r].updates_received, 4u) << rule;
      EXPECT_EQ(loopback->rounds[r].global_checksum, inproc->rounds[r].global_checksum) << rule << " round " << r + 1;
    }
  }
}

// FedNova's τ and ‖a‖₁ travel in UpdateBegin: over TLS the server folds
// what the sites trained in process, in arrival order (so to rounding). On
// sites of unequal size (Dirichlet) the local steps differ, and FedNova is
// not FedAvg.
TEST(Simulation, FedNovaRunsOverTlsAsInprocAndDiffersFromFedAvgOnUnequalSites) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  Scenario s = Small(dir / "data", dir / "run" / "fednova");
  s.rounds = 2;
  s.partition = "dirichlet:0.3";
  s.task().set_momentum(0.5f);  // ‖a‖₁ ≠ τ: the normaliser is the site's, not the step count
  s.server_binary = testing::BinaryPath("estuary-server");
  auto fedavg = RunInproc(s, nullptr);
  ASSERT_TRUE(fedavg.ok()) << fedavg.status().ToString();
  s.federation.mutable_strategy()->set_name("fednova");
  auto inproc = RunInproc(s, nullptr);
  ASSERT_TRUE(inproc.ok()) << inproc.status().ToString();
  EXPECT_NE(inproc->rounds[0].global_checksum, fedavg->rounds[0].global_checksum);
  s.mode = "loopback";
  auto loopback = RunLoopback(s, nullptr);
  ASSERT_TRUE(loopback.ok()) << loopback.status().ToString();
  ASSERT_EQ(loopback->rounds.size(), 2u);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(loopback->rounds[r].updates_received, 4u) << "round " << r + 1;
    EXPECT_NEAR(loopback->rounds[r].test_loss, inproc->rounds[r].test_loss, 1e-4) << "round " << r + 1;
  }
  EXPECT_GT(std::abs(inproc->rounds[1].test_loss - fedavg->rounds[1].test_loss), 1e-3);
}

// SCAFFOLD in process: c and each site's c_i start at zero, so round 1 is
// FedAvg's (to rounding: FedAvg's sites fuse their SGD step, SCAFFOLD's
// correct the gradient first); from round 2 the correction moves it. Each
// round moves the control variates beside the model, both ways; a rerun
// gives the same bits.
TEST(Simulation, ScaffoldRunsInprocWithTwiceTheTraffic) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  Scenario s = Small(dir / "data", dir / "run" / "scaffold");
  s.rounds = 2;
  auto fedavg = RunInproc(s, nullptr);
  ASSERT_TRUE(fedavg.ok()) << fedavg.status().ToString();
  s.federation.mutable_strategy()->set_name("scaffold");
  auto first = RunInproc(s, nullptr);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto again = RunInproc(s, nullptr);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(first->scenario["federation"]["strategy"]["total_sites"], 12);  // --clients, where unset
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(first->rounds[r].global_checksum, again->rounds[r].global_checksum) << "round " << r + 1;
    EXPECT_EQ(first->rounds[r].bytes_up, 2 * fedavg->rounds[r].bytes_up) << "round " << r + 1;
    EXPECT_EQ(first->rounds[r].bytes_down, 2 * fedavg->rounds[r].bytes_down) << "round " << r + 1;
  }
  EXPECT_NEAR(first->rounds[0].test_loss, fedavg->rounds[0].test_loss, 1e-5);
  EXPECT_GT(std::abs(first->rounds[1].test_loss - fedavg->rounds[1].test_loss), 1e-4);
}

// SCAFFOLD over TLS (--mode loopback: the real estuary-server, an agent per
// site keeping its c_i): c goes down after the model, Δc up after the delta.
// Two sites a round, so the server's fold in arrival order sums as the
// simulator's in name order: the same models bit for bit, the same scores,
// the same bytes each way, round after round as c and the c_i move.
TEST(Simulation, ScaffoldOverLoopbackIsTheInprocRunBitForBit) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  Scenario s = Small(dir / "data", dir / "run");
  s.per_round = 2;
  s.server_binary = testing::BinaryPath("estuary-server");
  s.federation.mutable_strategy()->set_name("scaffold");
  auto inproc = RunInproc(s, nullptr);
  ASSERT_TRUE(inproc.ok()) << inproc.status().ToString();
  s.mode = "loopback";
  auto loopback = RunLoopback(s, nullptr);
  ASSERT_TRUE(loopback.ok()) << loopback.status().ToString();
  ASSERT_EQ(loopback->rounds.size(), 3u);
  for (size_t r = 0; r < 3; ++r) {
    SCOPED_TRACE(fmt::format("round {}", r + 1));
    const RoundReport &a = inproc->rounds[r], &b = loopback->rounds[r];
    EXPECT_EQ(b.updates_received, 2u);
    EXPECT_EQ(b.global_checksum, a.global_checksum);
    EXPECT_EQ(b.test_accuracy, a.test_accuracy);
    EXPECT_EQ(b.bytes_up, a.bytes_up);
    EXPECT_EQ(b.bytes_down, a.bytes_down);
  }
  EXPECT_NE(loopback->rounds[1].global_checksum, loopback->rounds[2].global_checksum);
}

// Malicious sites attack over TLS as in process: the same sites upload the
// same sign-flipped deltas, so under the median the loopback run's models
// equal the in-process run's bit for bit, and differ from a run without them.
TEST(Simulation, AttackersAttackOverTlsAsInProcess) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  Scenario s = Small(dir / "data", dir / "run");
  s.rounds = 2;
  s.federation.mutable_strategy()->set_name("median");
  s.server_binary = testing::BinaryPath("estuary-server");
  auto honest = RunInproc(s, nullptr);
  ASSERT_TRUE(honest.ok()) << honest.status().ToString();
  s.attack = "sign-flip:10";
  s.attackers = 0.25;
  auto inproc = RunInproc(s, nullptr);
  ASSERT_TRUE(inproc.ok()) << inproc.status().ToString();
  s.mode = "loopback";
  auto loopback = RunLoopback(s, nullptr);
  ASSERT_TRUE(loopback.ok()) << loopback.status().ToString();
  EXPECT_EQ(loopback->attackers, 3u);
  EXPECT_EQ(inproc->attackers, 3u);
  ASSERT_EQ(loopback->rounds.size(), 2u);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(loopback->rounds[r].global_checksum, inproc->rounds[r].global_checksum) << "round " << r + 1;
  }
  uint64_t attacked = 0;
  for (const auto& row : inproc->rounds) attacked += row.attackers.value_or(0);
  ASSERT_GT(attacked, 0u) << "no attacker was sampled: the comparison below proves nothing";
  EXPECT_NE(inproc->rounds.back().global_checksum, honest->rounds.back().global_checksum);
}

// A workdir whose certificates play the wrong roles (as every one issued
// before roles does: both usages; here the reverse ones) gets them issued
// anew: the server would refuse to start with them, the sites to connect.
TEST(Simulation, LoopbackIssuesCertificatesOfTheWrongRoleAnew) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  Scenario s = Small(dir / "data", dir / "run");
  s.rounds = 1;
  s.server_binary = testing::BinaryPath("estuary-server");
  s.mode = "loopback";
  const auto certs = dir / "run" / "certs";
  std::filesystem::create_directories(certs);
  ASSERT_TRUE(crypto::InitCa(certs).ok());
  ASSERT_TRUE(crypto::IssueCertificate(certs, "server", {.role = crypto::CertRole::kSite}).ok());
  ASSERT_TRUE(crypto::IssueCertificate(certs, "client-000", {.role = crypto::CertRole::kServer}).ok());
  ASSERT_TRUE(crypto::IssueCertificate(certs, "client-001").ok());
  const auto kept = crypto::CertificateSerial(certs / "client-001.pem");
  ASSERT_TRUE(kept.ok());
  auto report = RunLoopback(s, nullptr);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->rounds.size(), 1u);
  auto listed = crypto::ListCertificates(certs);
  ASSERT_TRUE(listed.ok());
  for (const auto& cert : *listed) EXPECT_EQ(cert.role, cert.name == "server" ? "server" : "site") << cert.name;
  EXPECT_EQ(crypto::CertificateSerial(certs / "client-001.pem").value(), *kept)
      << "a certificate of the right role is kept";
}

}  // namespace
}  // namespace estuary::simulations

namespace estuary::simulations {
namespace {

Scenario Text(const std::filesystem::path& data) {
  Scenario s;
  s.task().set_model("llama-tiny");
  s.partition = "topic";
  s.data_dir = data;
  s.clients = 3;
  s.per_round = 2;
  s.rounds = 3;
  s.task().set_epochs(1);
  s.task().set_batch_size(4);
  s.task().set_seq_len(32);
  s.task().set_max_local_steps(4);
  s.federation.set_eval_windows(16);
  s.task().set_optimizer("adamw");
  s.task().set_learning_rate(3e-3f);
  s.task().set_seed(5);
  return s;
}

TEST(TextSimulation, OneClientPerTopicLearnsAndIsReproducible) {
  testing::TempDir dir;
  const Scenario s = Text(WriteTopics(dir));
  auto first = RunInproc(s, nullptr);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto second = RunInproc(s, nullptr);
  ASSERT_TRUE(second.ok());
  ASSERT_EQ(first->rounds.size(), 3u);
  for (size_t r = 0; r < 3; ++r) {
    EXPECT_EQ(first->rounds[r].global_checksum, second->rounds[r].global_checksum) << "round " << r + 1;
  }
  // From ln(256) ~ 5.5 nats per byte at init, held-out loss falls round by round.
  EXPECT_LT(first->rounds[0].test_loss, 5.4);
  EXPECT_LT(first->rounds[2].test_loss, first->rounds[0].test_loss);
  EXPECT_EQ(first->rounds[0].updates_received, 2u);
}

// --recompute: every round's global model is the plain sites' bit for bit,
// and the report says where the sites trained — the decoder with the arena
// of one block's activations (its exact bytes, fewer than the plain arena's).
TEST(TextSimulation, RecomputeTrainsAsThePlainSitesAndReportsItsArena) {
  testing::TempDir dir;
  Scenario s = Text(WriteTopics(dir));
  auto plain = RunInproc(s, nullptr);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  s.recompute = true;
  auto recompute = RunInproc(s, nullptr);
  ASSERT_TRUE(recompute.ok()) << recompute.status().ToString();
  EXPECT_EQ(recompute->scenario.at("recompute"), true);
  ASSERT_EQ(recompute->rounds.size(), plain->rounds.size());
  for (size_t r = 0; r < plain->rounds.size(); ++r) {
    EXPECT_EQ(recompute->rounds[r].global_checksum, plain->rounds[r].global_checksum) << "round " << r + 1;
    EXPECT_EQ(recompute->rounds[r].train_loss, plain->rounds[r].train_loss) << "round " << r + 1;
  }
  auto config = models::LlamaPreset("llama-tiny");
  ASSERT_TRUE(config.ok());
  const int batch = int(s.task().batch_size());
  auto kept = models::Llama::Create(*config, batch), recomputed = models::Llama::Create(*config, batch, true);
  ASSERT_TRUE(kept.ok() && recomputed.ok());
  EXPECT_LT(recomputed->activation_arena().size_bytes(), kept->activation_arena().size_bytes());
  EXPECT_EQ(plain->trained_on, "models::Llama on cpu in f32, 1 rank (solo, ddp)");
  EXPECT_EQ(recompute->trained_on,
            fmt::format("models::Llama (recompute, arena {} bytes) on cpu in f32, 1 rank (solo, ddp)",
                        recomputed->activation_arena().size_bytes()));
}

// A real server and one TLS connection per topic: the server builds the same
// decoder from the seed and scores the same held-out text.
TEST(TextSimulation, LoopbackAgreesWithInproc) {
  testing::TempDir dir;
  Scenario s = Text(WriteTopics(dir));
  s.workdir = dir / "run";
  s.server_binary = testing::BinaryPath("estuary-server");
  auto inproc = RunInproc(s, nullptr);
  ASSERT_TRUE(inproc.ok()) << inproc.status().ToString();
  s.mode = "loopback";
  auto loopback = RunLoopback(s, nullptr);
  ASSERT_TRUE(loopback.ok()) << loopback.status().ToString();
  ASSERT_EQ(loopback->rounds.size(), inproc->rounds.size());
  for (size_t r = 0; r < inproc->rounds.size(); ++r) {
    EXPECT_EQ(loopback->rounds[r].updates_received, 2u);
    EXPECT_NEAR(loopback->rounds[r].test_loss, inproc->rounds[r].test_loss, 1e-4 * inproc->rounds[r].test_loss)
        << "round " << r + 1;
  }
  EXPECT_FALSE(loopback->round_log.empty());
}

// The same federation with the clients on a GPU.
TEST(TextSimulation, CudaClientsFollowTheCpuRun) {
  if (auto usable = client::ParseCompute("cuda", "fp32"); !usable.ok()) {
    GTEST_SKIP() << usable.status().message();
  }
  testing::TempDir dir;
  ExpectCudaFollowsTheCpu(Text(WriteTopics(dir)), "full");
  // Recomputing activations on both sides: the report says the GPU sites did.
  Scenario recompute = Text(WriteTopics(dir));
  recompute.recompute = true;
  ExpectCudaFollowsTheCpu(recompute, "full, recompute");
}

TEST(TextSimulation, BadScenariosNameTheProblem) {
  testing::TempDir dir;
  const auto data = WriteTopics(dir);
  Scenario too_many = Text(data);
  too_many.clients = 4;
  auto r = RunInproc(too_many, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("3 topics"), std::string::npos) << r.status().message();
  Scenario iid = Text(data);
  iid.partition = "iid";
  r = RunInproc(iid, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--partition topic"), std::string::npos) << r.status().message();
  Scenario optimizer = Text(data);
  optimizer.task().set_optimizer("adagrad");
  r = RunInproc(optimizer, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("adagrad"), std::string::npos) << r.status().message();
  Scenario half_on_cpu = Text(data);
  half_on_cpu.precision = "bf16";
  r = RunInproc(half_on_cpu, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("CPU backend trains in fp32"), std::string::npos) << r.status().message();
  Scenario no_such_device = Text(data);
  no_such_device.device = "tpu";
  r = RunInproc(no_such_device, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("'tpu'"), std::string::npos) << r.status().message();
  no_such_device.device = "cuda:x";
  r = RunInproc(no_such_device, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("cuda:x"), std::string::npos) << r.status().message();
  Scenario long_windows = Text(data);
  long_windows.task().set_seq_len(4096);
  r = RunInproc(long_windows, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("4096"), std::string::npos) << r.status().message();
}

// ---- LoRA: adapters on the wire, merged by the strategy ---------------------

Scenario Lora(const std::filesystem::path& data, const std::string& merge) {
  Scenario s = Text(data);
  s.task().set_update_kind("lora" == std::string("lora") ? v1::UPDATE_LORA : v1::UPDATE_FULL);
  s.task().mutable_lora()->set_rank(4);
  s.task().mutable_lora()->set_alpha(8);
  s.task().mutable_lora()->set_merge(merge);
  s.per_round = 3;  // every topic every round
  s.task().set_learning_rate(1e-2f);
  return s;
}

// A lora federation with its sites on a GPU (cuda::LoraLlamaEngine through
// the site's DataParallel step over one rank): fp32 follows the CPU run,
// bf16 within its precision, under each merge rule.
TEST(LoraSimulation, CudaClientsFollowTheCpuRun) {
  if (auto usable = client::ParseCompute("cuda", "fp32"); !usable.ok()) {
    GTEST_SKIP() << usable.status().message();
  }
  testing::TempDir dir;
  const auto data = WriteTopics(dir);
  for (const char* merge : {"naive", "exact", "frozen-a"}) ExpectCudaFollowsTheCpu(Lora(data, merge), merge);
  Scenario recompute = Lora(data, "naive");
  recompute.recompute = true;
  ExpectCudaFollowsTheCpu(recompute, "naive, recompute");
  // A base kept in bf16: the CPU holds it rounded and computes in fp32; the
  // GPU drops its fp32 master and computes in bf16.
  Scenario bf16_base = Lora(data, "exact");
  bf16_base.lora_base_dtype = "bf16";
  auto cpu = RunInproc(bf16_base, nullptr);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  Scenario gpu = bf16_base;
  gpu.device = "cuda";
  gpu.precision = "bf16";
  auto run = RunInproc(gpu, nullptr);
  ASSERT_TRUE(run.ok()) << run.status().ToString();
  for (size_t r = 0; r < cpu->rounds.size(); ++r) {
    EXPECT_NEAR(run->rounds[r].test_loss, cpu->rounds[r].test_loss, 2e-2 * cpu->rounds[r].test_loss)
        << "bf16 base, round " << r + 1;
  }
  // fp32 arithmetic over a bf16 base is refused in one line.
  gpu.precision = "fp32";
  auto refused = RunInproc(gpu, nullptr);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("--precision bf16"), std::string::npos) << refused.status().message();
}

// The simulator's round against one computed here by hand from the same
// sites: the same initial model and trainers, their adapters merged by
// MergeLoraUpdates, the merged factors written over the global adapter and the
// residuals added to the base weights. Bit for bit.
TEST(LoraSimulation, TheInprocGlobalIsMergeLoraUpdatesOfTheSitesAdapters) {
  testing::TempDir dir;
  Scenario s = Lora(WriteTopics(dir), "exact");
  s.rounds = 1;
  auto run = RunInproc(s, nullptr);
  ASSERT_TRUE(run.ok()) << run.status().ToString();
  ASSERT_EQ(run->rounds.size(), 1u);

  std::optional<models::LoraConfig> lora = aggregation::LoraConfigOf(s.task());
  auto initial = models::LoraInitialModel(s.task().model(), *lora, s.task().seed(), {});
  ASSERT_TRUE(initial.ok()) << initial.status().ToString();
  auto sources = models::LoadFortunes(s.data_dir, {.test_fraction = 0.1, .seed = s.task().seed(), .min_tokens = s.task().seq_len() + 1});
  ASSERT_TRUE(sources.ok());
  const v1::TaskConfig task = SiteTask(s);  // what the simulator sent its sites
  std::map<std::string, std::vector<int32_t>> text;
  std::vector<std::string> names;
  for (auto& source : *sources) {
    names.push_back(source.name);
    text[source.name] = source.train;
  }
  const auto order = aggregation::SampleClients(names, names.size(), s.task().seed(), 1);
  std::vector<aggregation::LoraUpdate> updates;
  std::vector<double> weights;
  for (const std::string& name : order) {
    auto update = TextSite(text[name])->Train(initial->values, initial->manifest, task, 1, name);
    ASSERT_TRUE(update.ok()) << update.status().ToString();
    EXPECT_EQ(update->kind, client::UpdateKind::kLora);
    EXPECT_EQ(run->rounds[0].bytes_per_update, update->payload.size() * sizeof(float));
    aggregation::LoraUpdate parsed;
    for (const auto& spec : update->manifest.tensors) {
      EXPECT_TRUE(spec.name.starts_with("base_model.model.model.layers.")) << spec.name;  // PEFT's names
      auto& adapter = parsed.modules[models::LoraModuleOf(spec.name)];
      adapter.alpha = s.task().lora().alpha();
      const float* v = update->payload.data() + spec.offset;
      if (models::IsLoraA(spec.name)) {
        adapter.rank = size_t(spec.shape[0]), adapter.in = size_t(spec.shape[1]);
        adapter.a.assign(v, v + spec.numel());
      } else {
        adapter.out = size_t(spec.shape[0]);
        adapter.b.assign(v, v + spec.numel());
      }
    }
    updates.push_back(std::move(parsed));
    weights.push_back(double(update->num_examples));
  }
  auto merged = aggregation::MergeLoraUpdates(
      updates, weights, {.rule = aggregation::LoraMergeRule::kExact, .rank = 4, .alpha = s.task().lora().alpha()});
  ASSERT_TRUE(merged.ok()) << merged.status().ToString();
  EXPECT_GT(merged->residual_bytes, 0u);  // three rank-4 adapters: the residual is folded into the base
  EXPECT_EQ(run->rounds[0].merge_bytes_down, merged->adapter_bytes + merged->residual_bytes);
  std::vector<float> expected = initial->values;
  for (const auto& spec : initial->manifest.tensors) {
    const std::string module = models::LoraModuleOf(spec.name);
    if (module.empty()) continue;
    const auto& m = merged->modules.at(module);
    const auto& factor = models::IsLoraA(spec.name) ? m.adapter.a : m.adapter.b;
    ASSERT_EQ(factor.size(), spec.numel());
    std::copy(factor.begin(), factor.end(), expected.begin() + spec.offset);
    if (models::IsLoraA(spec.name) && !m.residual.empty()) {
      const auto* w = initial->manifest.Find(module.substr(std::string("base_model.model.").size()) + ".weight");
      ASSERT_NE(w, nullptr);
      m.residual.AddTo(std::span<float>(expected).subspan(w->offset, w->numel()));
    }
  }
  EXPECT_EQ(crypto::Sha256Hex(expected.data(), expected.size() * sizeof(float)), run->rounds[0].global_checksum);
}

TEST(LoraSimulation, AdaptersAreAFractionOfAFullUpdateAndLearn) {
  testing::TempDir dir;
  const auto data = WriteTopics(dir);
  Scenario full = Text(data);
  full.rounds = 1;
  auto full_run = RunInproc(full, nullptr);
  ASSERT_TRUE(full_run.ok()) << full_run.status().ToString();
  const uint64_t full_bytes = full_run->rounds[0].bytes_per_update;
  EXPECT_EQ(full_run->rounds[0].merge_bytes_down, 0u);  // a full round changes the whole model
  for (const char* merge : {"naive", "exact", "frozen-a"}) {
    Scenario s = Lora(data, merge);
    auto run = RunInproc(s, nullptr);
    ASSERT_TRUE(run.ok()) << merge << ": " << run.status().ToString();
    ASSERT_EQ(run->rounds.size(), 3u);
    const uint64_t lora_bytes = run->rounds[0].bytes_per_update;
    // llama-tiny, rank 4 on q, k, v, o: 4 layers x (4 x 128 + 4 x (128 + 64 + 64 + 128)) floats = 3 % of a delta.
    EXPECT_LT(lora_bytes * 20, full_bytes) << merge;
    EXPECT_GT(lora_bytes, 0u);
    if (std::string(merge) == "frozen-a") {
      EXPECT_LT(lora_bytes, 4u * 4 * 4 * (128 + 64 + 64 + 128) + 1) << "frozen-a sends B alone";
    }
    // From ln(256) at the base, the adapted model's held-out loss falls.
    EXPECT_LT(run->rounds[2].test_loss, run->rounds[0].test_loss) << merge;
    EXPECT_GT(run->rounds[0].merge_bytes_down, 0u);
  }
}

// naive and frozen-a need only the mean upload, so they run through SecAgg+:
// the protocol sums how far each site moved its adapter (b = 32, C = 100), and
// the global model equals the plain federation's within the quantisation
// bound n / (s · W), s = ⌊(2^31 − 1 − n) / (C · W)⌋ — about n · C / 2^31 —
// plus float rounding; the base is untouched. exact is refused in one line.
TEST(LoraSimulation, SecAggEqualsThePlainMergeWithinTheQuantisationBound) {
  testing::TempDir dir;
  const auto data = WriteTopics(dir);
  for (const char* merge : {"naive", "frozen-a"}) {
    Scenario plain = Lora(data, merge);
    plain.rounds = 1;
    std::vector<float> plain_global, secure_global;
    auto plain_run = RunInproc(plain, nullptr, &plain_global);
    ASSERT_TRUE(plain_run.ok()) << merge << ": " << plain_run.status().ToString();
    Scenario secure = plain;
    secure.secagg = true;
    secure.federation.mutable_limits()->set_max_norm_over_median(0);  // as estuary-sim sets it under --secagg
    auto secure_run = RunInproc(secure, nullptr, &secure_global);
    ASSERT_TRUE(secure_run.ok()) << merge << ": " << secure_run.status().ToString();
    ASSERT_EQ(secure_run->rounds.size(), 1u);
    ASSERT_EQ(secure_global.size(), plain_global.size());
    const RoundReport& row = secure_run->rounds[0];
    ASSERT_TRUE(row.secagg_error_bound.has_value());
    EXPECT_EQ(row.updates_received, 3u);
    const double bound = *row.secagg_error_bound;
    EXPECT_NEAR(bound, 3 * 100 / std::ldexp(1.0, 31), 0.01 * 3 * 100 / std::ldexp(1.0, 31)) << merge;
    // Allowed: the bound, plus float rounding of the mean and of the model.
    std::optional<models::LoraConfig> lora = aggregation::LoraConfigOf(secure.task());
    auto initial = models::LoraInitialModel(secure.task().model(), *lora, secure.task().seed(), {});
    ASSERT_TRUE(initial.ok());
    double worst = 0, worst_excess = -1;
    size_t adapter_elements = 0;
    for (const auto& spec : initial->manifest.tensors) {
      const bool adapter = !models::LoraModuleOf(spec.name).empty();
      for (uint64_t i = spec.offset; i < spec.offset + spec.numel(); ++i) {
        const double diff = std::abs(double(secure_global[i]) - double(plain_global[i]));
        if (!adapter) {
          ASSERT_EQ(diff, 0) << merge << ": base tensor " << spec.name << " changed";
          continue;
        }
        ++adapter_elements;
        worst = std::max(worst, diff);
        worst_excess = std::max(worst_excess, diff - (bound + std::ldexp(1.0, -22) * (1 + std::abs(plain_global[i]))));
      }
    }
    EXPECT_GT(adapter_elements, 0u);
    EXPECT_LE(worst_excess, 0) << merge << ": worst difference " << worst;
    EXPECT_GT(worst, 0) << merge << ": quantisation changed nothing: the comparison proves nothing";
  }
  // Distributed DP noises the movement: the base stays, the adapter moves by far more than the bound.
  Scenario noised = Lora(data, "naive");
  noised.rounds = 1;
  noised.secagg = true;
  noised.dp = "distributed";
  noised.federation.mutable_limits()->set_max_norm_over_median(0);
  noised.federation.mutable_dp()->set_noise_multiplier(1);
  noised.federation.mutable_dp()->set_clip(1);
  std::vector<float> noised_global;
  auto noised_run = RunInproc(noised, nullptr, &noised_global);
  ASSERT_TRUE(noised_run.ok()) << noised_run.status().ToString();
  EXPECT_GT(noised_run->epsilon.value_or(0), 0);
  std::optional<models::LoraConfig> lora = aggregation::LoraConfigOf(noised.task());
  auto initial = models::LoraInitialModel(noised.task().model(), *lora, noised.task().seed(), {});
  ASSERT_TRUE(initial.ok());
  double adapter_moved = 0;
  for (const auto& spec : initial->manifest.tensors) {
    const bool adapter = !models::LoraModuleOf(spec.name).empty();
    for (uint64_t i = spec.offset; i < spec.offset + spec.numel(); ++i) {
      if (!adapter) ASSERT_EQ(noised_global[i], initial->values[i]) << spec.name;
      else adapter_moved = std::max(adapter_moved, double(std::abs(noised_global[i] - initial->values[i])));
    }
  }
  EXPECT_GT(adapter_moved, 1e-3);
  Scenario exact = Lora(data, "exact");
  exact.secagg = true;
  exact.federation.mutable_limits()->set_max_norm_over_median(0);
  EXPECT_EQ(RunInproc(exact, nullptr).status().message(),
            "sim: --secagg with --lora-merge exact: the exact merge needs each site's factors B_i, A_i (their "
            "products), which secure aggregation hides; naive and frozen-a take the sum");
}

// The real server and TLS connections: the server validates, stages and
// merges the same adapters, so the rounds agree with the in-process run.
TEST(LoraSimulation, LoopbackAgreesWithInproc) {
  testing::TempDir dir;
  Scenario s = Lora(WriteTopics(dir), "exact");
  s.rounds = 2;
  s.workdir = dir / "run";
  s.server_binary = testing::BinaryPath("estuary-server");
  auto inproc = RunInproc(s, nullptr);
  ASSERT_TRUE(inproc.ok()) << inproc.status().ToString();
  s.mode = "loopback";
  auto loopback = RunLoopback(s, nullptr);
  ASSERT_TRUE(loopback.ok()) << loopback.status().ToString();
  ASSERT_EQ(loopback->rounds.size(), inproc->rounds.size());
  for (size_t r = 0; r < inproc->rounds.size(); ++r) {
    EXPECT_EQ(loopback->rounds[r].updates_received, 3u);
    EXPECT_EQ(loopback->rounds[r].bytes_per_update, inproc->rounds[r].bytes_per_update);
    EXPECT_EQ(loopback->rounds[r].merge_bytes_down, inproc->rounds[r].merge_bytes_down);
    EXPECT_NEAR(loopback->rounds[r].test_loss, inproc->rounds[r].test_loss, 1e-4 * inproc->rounds[r].test_loss)
        << "round " << r + 1;
  }
}

// SecAgg+ over the sessions for a lora federation (naive, frozen-a): the
// loopback sites mask their adapters' movement and the real server unmasks
// and merges it (serve --secagg), as the in-process protocol does. The two
// runs differ only by the stochastic rounding's draws (seeded in process,
// RAND_bytes on a site: within n / (s · W) ≈ 1.4e-7 per element) and fold
// order, so their held-out losses agree; the masked input is the upload's
// elements (B alone under frozen-a), as WireBytes counts it in process, and
// the sessions add their framing, signatures and certificates.
TEST(LoraSimulation, SecAggLoopbackAgreesWithInproc) {
  testing::TempDir dir;
  const auto data = WriteTopics(dir);
  std::map<std::string, uint64_t> masked_bytes;
  for (const char* merge : {"naive", "frozen-a"}) {
    Scenario s = Lora(data, merge);
    s.rounds = 2;
    s.secagg = true;
    s.federation.mutable_limits()->set_max_norm_over_median(0);  // as estuary-sim sets it under --secagg
    s.workdir = dir / "run" / merge;
    s.server_binary = testing::BinaryPath("estuary-server");
    auto inproc = RunInproc(s, nullptr);
    ASSERT_TRUE(inproc.ok()) << merge << ": " << inproc.status().ToString();
    s.mode = "loopback";
    auto loopback = RunLoopback(s, nullptr);
    ASSERT_TRUE(loopback.ok()) << merge << ": " << loopback.status().ToString();
    ASSERT_EQ(loopback->rounds.size(), inproc->rounds.size());
    for (size_t r = 0; r < inproc->rounds.size(); ++r) {
      const RoundReport& row = loopback->rounds[r];
      EXPECT_EQ(row.updates_received, 3u) << merge;
      EXPECT_EQ(row.secagg_dropouts, 0u) << merge;
      ASSERT_TRUE(row.secagg_bytes_per_site.has_value()) << merge << " round " << r + 1;
      ASSERT_TRUE(inproc->rounds[r].secagg_bytes_per_site.has_value()) << merge;
      const uint64_t in_process = *inproc->rounds[r].secagg_bytes_per_site;
      EXPECT_GT(*row.secagg_bytes_per_site, in_process) << merge << " round " << r + 1;
      EXPECT_LT(*row.secagg_bytes_per_site, in_process + 8192) << merge << " round " << r + 1;
      masked_bytes[merge] = in_process;
      EXPECT_NEAR(row.test_loss, inproc->rounds[r].test_loss, 1e-4 * inproc->rounds[r].test_loss)
          << merge << " round " << r + 1;
    }
    // The adapted model learns under either run.
    EXPECT_LT(loopback->rounds[1].test_loss, loopback->rounds[0].test_loss) << merge;
  }
  EXPECT_LT(masked_bytes["frozen-a"], masked_bytes["naive"]) << "frozen-a masks B alone";
}

// estuary-sim --base-model DIR on a Hugging Face model directory: the same
// federation in one process and over TLS, where the sites hold the base and
// the server sends them only what differs from it.
TEST(LoraSimulation, OnAHuggingFaceBaseInprocLearnsAndLoopbackAgreesWithoutSendingTheBase) {
  testing::TempDir dir;
  const models::Llama model = testing::WriteTinyHfBase({dir / "hf-tiny"}, 21);
  Scenario s = Lora(WriteTopics(dir), "exact");
  s.federation.set_base_model((dir / "hf-tiny").string());
  s.workdir = dir / "run";
  s.server_binary = testing::BinaryPath("estuary-server");
  auto inproc = RunInproc(s, nullptr);
  ASSERT_TRUE(inproc.ok()) << inproc.status().ToString();
  ASSERT_EQ(inproc->rounds.size(), 3u);
  EXPECT_LT(inproc->rounds[2].test_loss, inproc->rounds[0].test_loss);
  s.mode = "loopback";
  auto loopback = RunLoopback(s, nullptr);
  ASSERT_TRUE(loopback.ok()) << loopback.status().ToString();
  ASSERT_EQ(loopback->rounds.size(), inproc->rounds.size());
  const uint64_t base_bytes = model.parameters().size_bytes();
  for (size_t r = 0; r < inproc->rounds.size(); ++r) {
    EXPECT_EQ(loopback->rounds[r].updates_received, 3u);
    EXPECT_EQ(loopback->rounds[r].bytes_per_update, inproc->rounds[r].bytes_per_update);
    EXPECT_NEAR(loopback->rounds[r].test_loss, inproc->rounds[r].test_loss, 1e-4 * inproc->rounds[r].test_loss)
        << "round " << r + 1;
    // Three sites, and not one copy of the base among what they were sent.
    EXPECT_GT(loopback->rounds[r].bytes_down, 0u);
    EXPECT_LT(loopback->rounds[r].bytes_down, base_bytes) << "round " << r + 1;
  }
}

// estuary-sim --base-model DIR --update-kind full: every weight trained, in
// one process and over TLS alike; in round 1 each site is sent one tensor of
// the base it holds (the smallest), afterwards the model once, never the
// base beside it.
TEST(TextSimulation, AFullFederationOnAHuggingFaceBaseLearnsAndLoopbackAgrees) {
  testing::TempDir dir;
  const models::Llama model = testing::WriteTinyHfBase({dir / "hf-tiny"}, 21);
  Scenario s = Text(WriteTopics(dir));
  s.per_round = 3;
  s.federation.set_base_model((dir / "hf-tiny").string());
  s.workdir = dir / "run";
  s.server_binary = testing::BinaryPath("estuary-server");
  auto inproc = RunInproc(s, nullptr);
  ASSERT_TRUE(inproc.ok()) << inproc.status().ToString();
  ASSERT_EQ(inproc->rounds.size(), 3u);
  EXPECT_LT(inproc->rounds[2].test_loss, inproc->rounds[0].test_loss);
  s.mode = "loopback";
  auto loopback = RunLoopback(s, nullptr);
  ASSERT_TRUE(loopback.ok()) << loopback.status().ToString();
  ASSERT_EQ(loopback->rounds.size(), inproc->rounds.size());
  const uint64_t model_bytes = model.parameters().size_bytes();
  uint64_t smallest = model_bytes;
  for (const auto& spec : model.manifest().tensors) smallest = std::min<uint64_t>(smallest, spec.numel() * 4);
  for (size_t r = 0; r < inproc->rounds.size(); ++r) {
    EXPECT_EQ(loopback->rounds[r].updates_received, 3u);
    EXPECT_EQ(loopback->rounds[r].bytes_per_update, model_bytes);
    EXPECT_NEAR(loopback->rounds[r].test_loss, inproc->rounds[r].test_loss, 1e-4 * inproc->rounds[r].test_loss)
        << "round " << r + 1;
    EXPECT_EQ(loopback->rounds[r].bytes_down, 3 * (r == 0 ? smallest : model_bytes)) << "round " << r + 1;
  }
}

TEST(LoraSimulation, BadLoraScenariosNameTheProblem) {
  testing::TempDir dir;
  const auto data = WriteTopics(dir);
  Scenario s = Lora(data, "median");
  auto r = RunInproc(s, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("median"), std::string::npos) << r.status().message();
  s = Lora(data, "exact");
  SetTargets(s, "q_proj,qkv");
  r = RunInproc(s, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("'qkv'"), std::string::npos) << r.status().message();
  s = Lora(data, "exact");
  s.task().set_model("mlp");
  r = RunInproc(s, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("needs a language model"), std::string::npos) << r.status().message();
  s = Lora(data, "exact");
  s.lora_base_dtype = "f16";
  r = RunInproc(s, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--lora-base-dtype 'f16'"), std::string::npos) << r.status().message();
}

// The lora-fortunes study end to end on the synthetic topics: a base
// pretrained on one topic, two sites fine-tuning theirs under each rule,
// against centralised LoRA; every fine-tuned model beats the base on every
// site's held-out text, and the rules' bytes are as configured.
TEST(LoraSimulation, TheLoraFortunesStudyReportsEverySiteUnderEveryRule) {
  testing::TempDir dir;
  LoraFortunesOptions o;
  o.data_dir = WriteTopics(dir);
  o.topics = "cats,numbers";  // "plays" pretrains the base
  o.seq_len = 32;
  o.batch = 4;
  o.pretrain_steps = 20;
  o.rounds = 2;
  o.local_steps = 4;
  o.rank = 4;
  o.alpha = 8;
  o.eval_windows = 8;
  o.workdir = dir / "study";
  std::vector<std::string> said;
  auto report = RunLoraFortunes(o, [&](const std::string& what) { said.push_back(what); });
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_TRUE(std::filesystem::exists(dir / "study" / "base.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(dir / "study" / "exact-adapter" / "adapter_config.json"));
  EXPECT_EQ(report->central_steps, 2u * 2 * 4);
  ASSERT_EQ(report->sites.size(), 2u);
  for (const auto& site : report->sites) {
    for (const char* rule : {"naive", "exact", "frozen-a", "central"}) {
      ASSERT_TRUE(site.ppl.contains(rule)) << site.topic << " " << rule;
      EXPECT_LT(site.ppl.at(rule), site.base_ppl) << site.topic << " " << rule;
      EXPECT_GT(site.ppl.at(rule), 1.0) << site.topic << " " << rule;
    }
  }
  ASSERT_EQ(report->runs.size(), 3u);
  EXPECT_EQ(report->runs[0].bytes_per_update, report->runs[1].bytes_per_update);  // naive and exact: A and B
  EXPECT_LT(report->runs[2].bytes_per_update, report->runs[0].bytes_per_update);  // frozen-a: B alone
  EXPECT_GT(report->runs[1].merge_bytes_down, report->runs[0].merge_bytes_down);  // exact sends residuals back
  const std::string table = RenderLoraFortunes(*report);
  EXPECT_NE(table.find("| cats ("), std::string::npos) << table;
  EXPECT_NE(table.find("centralised LoRA"), std::string::npos) << table;
  // From the saved base: no pretraining, and the same figures bit for bit.
  LoraFortunesOptions again = o;
  again.base_model = dir / "study" / "base.safetensors";
  again.workdir = dir / "again";
  again.merges = {"exact"};
  auto second = RunLoraFortunes(again, nullptr);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(second->pretrain_tokens, 0u);
  EXPECT_GT(report->pretrain_tokens, 0u);
  ASSERT_EQ(second->sites.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(second->sites[i].base_ppl, report->sites[i].base_ppl);
    EXPECT_EQ(second->sites[i].ppl.at("exact"), report->sites[i].ppl.at("exact"));
    EXPECT_EQ(second->sites[i].ppl.at("central"), report->sites[i].ppl.at("central"));
  }
  // A topic that is not there is named.
  o.topics = "cats,poetry";
  auto bad = RunLoraFortunes(o, nullptr);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'poetry'"), std::string::npos) << bad.status().message();
}

// Sites of ranks 2, 4 and 8 in an exact federation of rank 4: a site of
// another rank uploads its model as one stacked adapter of rank 4 + r_i, and
// the merged global model is the weighted mean of the sites' models.
TEST(LoraSimulation, SitesOfOtherRanksJoinAnExactFederation) {
  testing::TempDir dir;
  Scenario s = Lora(WriteTopics(dir), "exact");
  s.lora_site_ranks = "2,4,8";
  s.rounds = 1;
  std::vector<float> g1, g2;
  auto one = RunInproc(s, nullptr, &g1);
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  s.rounds = 2;
  auto two = RunInproc(s, nullptr, &g2);
  ASSERT_TRUE(two.ok()) << two.status().ToString();
  EXPECT_EQ(one->rounds[0].global_checksum, two->rounds[0].global_checksum);

  std::optional<models::LoraConfig> lora = aggregation::LoraConfigOf(s.task());
  auto config = models::LlamaPreset(s.task().model());
  ASSERT_TRUE(config.ok());
  auto layout = models::MakeLoraGlobalLayout(*config, *lora);
  ASSERT_TRUE(layout.ok());
  auto initial = models::LoraInitialModel(s.task().model(), *lora, s.task().seed(), {});
  ASSERT_TRUE(initial.ok());
  ASSERT_EQ(g1.size(), initial->values.size());
  auto sources = models::LoadFortunes(s.data_dir, {.test_fraction = 0.1, .seed = s.task().seed(), .min_tokens = s.task().seq_len() + 1});
  ASSERT_TRUE(sources.ok());
  const v1::TaskConfig task = SiteTask(s);  // what the simulator sent its sites
  ASSERT_TRUE(task.lora().mixed_ranks());

  // Round 2 by hand from the global of round 1.
  const size_t base_size = layout->base.total_elements;
  const std::span<const float> g1_adapter = std::span<const float>(g1).subspan(base_size);
  std::vector<double> mean(base_size, 0.0);
  double total = 0;
  const int ranks[] = {2, 4, 8};
  for (size_t i = 0; i < sources->size(); ++i) {
    const auto& source = (*sources)[i];
    auto update = TextSite(source.train, ranks[i])->Train(g1, initial->manifest, task, 2, source.name);
    ASSERT_TRUE(update.ok()) << update.status().ToString();
    const int64_t uploaded_rank = update->manifest.tensors[0].shape[0];
    EXPECT_EQ(uploaded_rank, ranks[i] == 4 ? 4 : 4 + ranks[i]) << source.name;
    // The site's model from its upload ...
    std::vector<float> model(g1.begin(), g1.begin() + base_size);
    ASSERT_TRUE(models::AddLoraToBase(layout->base, model, update->manifest, update->payload, lora->alpha).ok());
    if (ranks[i] != 4) {
      // ... equals the global adapted model plus its own rank-r_i adapter,
      // read back out of the stack (rows 4.. of A, columns 4.. of B undone).
      Manifest own;
      std::vector<float> own_values;
      const double unscale = (double(lora->alpha) / double(4 + ranks[i])) / (double(lora->alpha) / ranks[i]);
      for (const auto& spec : update->manifest.tensors) {
        TensorSpec o{spec.name, spec.shape, DType::kF32, own.total_elements};
        const float* v = update->payload.data() + spec.offset;
        if (models::IsLoraA(spec.name)) {
          o.shape = {ranks[i], spec.shape[1]};
          own_values.insert(own_values.end(), v + 4 * spec.shape[1], v + spec.numel());
        } else {
          o.shape = {spec.shape[0], ranks[i]};
          for (int64_t r = 0; r < spec.shape[0]; ++r) {
            for (int j = 4; j < 4 + ranks[i]; ++j) own_values.push_back(float(unscale * v[r * (4 + ranks[i]) + j]));
          }
        }
        own.total_elements += o.numel();
        own.tensors.push_back(o);
      }
      std::vector<float> direct(g1.begin(), g1.begin() + base_size);
      ASSERT_TRUE(models::AddLoraToBase(layout->base, direct, layout->adapter, g1_adapter, lora->alpha).ok());
      ASSERT_TRUE(models::AddLoraToBase(layout->base, direct, own, own_values, lora->alpha).ok());
      double err = 0, norm = 0;
      for (size_t j = 0; j < base_size; ++j) {
        err += std::pow(double(direct[j]) - double(model[j]), 2);
        norm += std::pow(double(direct[j]) - double(g1[j]), 2);
      }
      EXPECT_LT(std::sqrt(err / norm), 1e-5) << source.name;
    }
    const double w = double(update->num_examples);
    for (size_t j = 0; j < base_size; ++j) mean[j] += w * double(model[j]);
    total += w;
  }
  std::vector<float> merged(g2.begin(), g2.begin() + base_size);
  ASSERT_TRUE(models::AddLoraToBase(layout->base, merged, layout->adapter, std::span<const float>(g2).subspan(base_size),
                                    lora->alpha)
                  .ok());
  double err = 0, norm = 0;
  for (size_t j = 0; j < base_size; ++j) {
    const double want = mean[j] / total;
    err += std::pow(double(merged[j]) - want, 2);
    norm += std::pow(want - double(g1[j]), 2);
  }
  EXPECT_GT(norm, 0);
  EXPECT_LT(std::sqrt(err / norm), 1e-5);

  // Over TLS the server takes the stacked uploads too (--lora-mixed-ranks).
  Scenario loop = s;
  loop.mode = "loopback";
  loop.workdir = dir / "run";
  loop.server_binary = testing::BinaryPath("estuary-server");
  auto loopback = RunLoopback(loop, nullptr);
  ASSERT_TRUE(loopback.ok()) << loopback.status().ToString();
  ASSERT_EQ(loopback->rounds.size(), 2u);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(loopback->rounds[r].updates_received, 3u);
    EXPECT_NEAR(loopback->rounds[r].test_loss, two->rounds[r].test_loss, 1e-4 * two->rounds[r].test_loss);
  }

  // Mixed ranks are exact's alone.
  s.task().mutable_lora()->set_merge("naive");
  auto refused = RunInproc(s, nullptr);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("needs --lora-merge exact"), std::string::npos)
      << refused.status().message();
}

}  // namespace
}  // namespace estuary::simulations
