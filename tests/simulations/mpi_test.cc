// estuary-sim under mpirun (docs/PERFORMANCE.md, "Beyond one machine"): the
// real binary on the real MNIST files, as 2 and 4 processes of Open MPI's
// mpirun, against the same run in one process. Every round's global model
// (its SHA-256), the losses and the final accuracy are the single-process
// run's bit for bit; every rank sent updates (counted by rank 0 as they
// arrived); the bytes between ranks are what the design says; what MPI
// cannot run is refused in one line.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <numeric>

#include "simulations/report.h"
#include "tests/e2e/harness.h"
#include "tests/simulations/text_topics.h"

namespace estuary::simulations {
namespace {

namespace fs = std::filesystem;

fs::path MnistDir() {
  if (const char* given = std::getenv("ESTUARY_MNIST")) return given;
  return fs::path(ESTUARY_SOURCE_DIR) / "data" / "mnist";
}

// mpirun's environment for this test only: this machine may run tests as
// root, and has fewer cores than ranks (--oversubscribe). Under
// AddressSanitizer (scripts/sanitize), Open MPI's own allocations, made by
// components it has unloaded by exit, would read as leaks that no
// suppression can name; the single-process run below keeps leak checking.
std::string Mpirun(int ranks) {
  std::string asan = std::getenv("ASAN_OPTIONS") ? std::getenv("ASAN_OPTIONS") : "";
  return fmt::format("env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ASAN_OPTIONS={}detect_leaks=0 "
                     "{} -np {} --oversubscribe",
                     asan.empty() ? "" : asan + ":", ESTUARY_MPIEXEC, ranks);
}

// 20 IID sites of the 2NN, 7 a round (uneven shares: 4 + 3, 2 + 2 + 2 + 1), 3 rounds of one epoch.
std::string SimCommand(const fs::path& report) {
  return fmt::format("{} --quiet --data {} --clients 20 --per-round 7 --rounds 3 --epochs 1 --threads 1 --seed 5 "
                     "--report {}",
                     testing::BinaryPath("estuary-sim").string(), MnistDir().string(), report.string());
}

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(MpiSimulation, TwoAndFourRanksGiveTheOneProcessRunBitForBit) {
  if (!fs::exists(MnistDir() / "train-images-idx3-ubyte")) {
    FAIL() << "no MNIST at " << MnistDir() << " (scripts/fetch-mnist data/mnist; or set ESTUARY_MNIST)";
  }
  testing::TempDir dir;
  const auto alone = testing::RunCommand(SimCommand(dir / "alone.json"));
  ASSERT_EQ(alone.exit_code, 0) << alone.output;
  auto one = ReadReport(dir / "alone.json");
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  ASSERT_EQ(one->rounds.size(), 3u);
  EXPECT_FALSE(one->mpi_ranks.has_value());
  EXPECT_FALSE(one->rounds[0].mpi_bytes.has_value());

  for (int ranks : {2, 4}) {
    SCOPED_TRACE(fmt::format("{} ranks", ranks));
    const fs::path path = dir / fmt::format("ranks{}.json", ranks);
    const auto run = testing::RunCommand(Mpirun(ranks) + " " + SimCommand(path));
    ASSERT_EQ(run.exit_code, 0) << run.output;
    EXPECT_EQ(Count(run.output, "final test accuracy"), 1u) << "rank 0 alone reports\n" << run.output;
    auto many = ReadReport(path);
    ASSERT_TRUE(many.ok()) << many.status().ToString();
    ASSERT_EQ(many->rounds.size(), one->rounds.size());
    for (size_t r = 0; r < one->rounds.size(); ++r) {
      const RoundReport &a = one->rounds[r], &b = many->rounds[r];
      EXPECT_EQ(b.global_checksum, a.global_checksum) << "round " << a.round;
      EXPECT_EQ(b.test_accuracy, a.test_accuracy) << "round " << a.round;
      EXPECT_EQ(b.test_loss, a.test_loss) << "round " << a.round;
      EXPECT_EQ(b.train_loss, a.train_loss) << "round " << a.round;
      EXPECT_EQ(b.updates_received, 7u);
      // The design's bytes: the order and the model to N - 1 ranks, and the updates of the sites off rank 0
      // (7 - ceil(7 / N)), each a header beside its payload.
      ASSERT_TRUE(b.mpi_bytes.has_value());
      const uint64_t model = b.bytes_per_update;
      const uint64_t off_rank0 = 7 - (7 + ranks - 1) / ranks;
      const uint64_t least = uint64_t(ranks - 1) * model + off_rank0 * model;
      EXPECT_GE(*b.mpi_bytes, least) << "round " << a.round;
      EXPECT_LE(*b.mpi_bytes, least + uint64_t(ranks - 1) * 128 + off_rank0 * 4096) << "round " << a.round;
    }
    EXPECT_EQ(many->final_accuracy, one->final_accuracy);
    // It ran as N processes: every rank's updates reached rank 0, 7 sites a round shared i mod N.
    ASSERT_EQ(many->mpi_ranks, uint64_t(ranks));
    ASSERT_EQ(many->updates_by_rank.size(), size_t(ranks));
    for (int r = 0; r < ranks; ++r) {
      const uint64_t share = 3 * ((7 - r + ranks - 1) / ranks);
      EXPECT_EQ(many->updates_by_rank[size_t(r)], share) << "rank " << r;
    }
    EXPECT_EQ(std::accumulate(many->updates_by_rank.begin(), many->updates_by_rank.end(), uint64_t{0}), 21u);
    EXPECT_NE(run.output.find(fmt::format("mpirun: {} ranks", ranks)), std::string::npos) << run.output;
  }
}

// What rank 0 folds is whatever one process folds: a population made as it is
// sampled with attackers under the median, Poisson sampling with stragglers
// under FedNova, central DP (its noise seeded on rank 0), and LoRA adapters
// of mixed ranks on a decoder — on 3 ranks of 2 threads each against one process of 1 thread.
TEST(MpiSimulation, PopulationsAttacksStragglersDpAndMixedRankLoraAlsoFoldBitForBit) {
  if (!fs::exists(MnistDir() / "train-images-idx3-ubyte")) {
    FAIL() << "no MNIST at " << MnistDir() << " (scripts/fetch-mnist data/mnist; or set ESTUARY_MNIST)";
  }
  testing::TempDir dir;
  const fs::path topics = WriteTopics(dir);
  const std::string mnist = "--data " + MnistDir().string();
  const std::string cases[] = {
      mnist + " --clients 1000 --examples-per-client 50 --per-round 8 --attack sign-flip --attackers 0.2 "
              "--strategy median",
      mnist + " --clients 40 --sample-rate 0.25 --stragglers 0.3 --strategy fednova",
      mnist + " --clients 30 --per-round 9 --dp-noise-multiplier 1 --dp-clip 1",
      "--data " + topics.string() + " --model llama-tiny --partition topic --clients 3 --per-round 3 --batch 4 "
          "--lr 0.003 --optimizer adamw --seq-len 32 --max-local-steps 3 --eval-windows 16 --update-kind lora "
          "--lora-rank 4 --lora-merge exact --lora-site-ranks 2,4"};
  for (const std::string& flags : cases) {
    SCOPED_TRACE(flags);
    auto run = [&](const std::string& prefix, int threads, const std::string& name) {
      const fs::path path = dir / (name + ".json");
      const auto result =
          testing::RunCommand(fmt::format("{}{} --quiet --rounds 3 --epochs 1 --seed 3 --threads {} {} --report {}", prefix,
                                          testing::BinaryPath("estuary-sim").string(), threads, flags, path.string()));
      EXPECT_EQ(result.exit_code, 0) << result.output;
      return ReadReport(path);
    };
    auto one = run("", 1, "one");
    auto many = run(Mpirun(3) + " ", 2, "many");
    ASSERT_TRUE(one.ok()) << one.status().ToString();
    ASSERT_TRUE(many.ok()) << many.status().ToString();
    ASSERT_EQ(many->rounds.size(), one->rounds.size());
    for (size_t r = 0; r < one->rounds.size(); ++r) {
      EXPECT_EQ(many->rounds[r].global_checksum, one->rounds[r].global_checksum) << "round " << r + 1;
      EXPECT_EQ(many->rounds[r].epsilon, one->rounds[r].epsilon) << "round " << r + 1;
      EXPECT_EQ(many->rounds[r].attackers, one->rounds[r].attackers) << "round " << r + 1;
      EXPECT_EQ(many->rounds[r].sim_time, one->rounds[r].sim_time) << "round " << r + 1;
    }
    EXPECT_EQ(many->final_accuracy, one->final_accuracy);
    ASSERT_EQ(many->updates_by_rank.size(), 3u);
    for (uint64_t updates : many->updates_by_rank) EXPECT_GT(updates, 0u);
  }
}

// What the ranks cannot run is refused before anything runs, in one line from rank 0.
TEST(MpiSimulation, WhatMpiCannotRunIsRefusedInOneLine) {
  testing::TempDir dir;
  const std::string sim = testing::BinaryPath("estuary-sim").string();
  for (const auto& [flags, line] : {std::pair{"--mode loopback", "--mode loopback is not supported under mpirun"},
                                    std::pair{"--secagg", "--secagg is not supported under mpirun"},
                                    std::pair{"--async", "--async is not supported under mpirun"},
                                    std::pair{"--strategy scaffold", "--strategy scaffold is not supported under mpirun"}}) {
    const auto run = testing::RunCommand(fmt::format("{} {} --quiet --data {} --workdir {} --report {} {}", Mpirun(2),
                                                     sim, MnistDir().string(), (dir / "work").string(),
                                                     (dir / "r.json").string(), flags));
    EXPECT_NE(run.exit_code, 0) << flags;
    EXPECT_EQ(Count(run.output, line), 1u) << flags << "\n" << run.output;
    EXPECT_FALSE(fs::exists(dir / "r.json")) << flags;
  }
}

}  // namespace
}  // namespace estuary::simulations
