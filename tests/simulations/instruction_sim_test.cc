// The simulator on one JSON Lines file of instruction examples
// (simulations/instruction_sites.h): sites by a field's values or by a
// seeded Dirichlet over a label field, a held-out share scored on its
// responses, and a federation of them that learns and reproduces.
#include <gtest/gtest.h>

#include <fstream>
#include <set>

#include "client/compute.h"
#include "simulations/instruction_sites.h"
#include "simulations/runner.h"
#include "tests/client/instruction_fixture.h"
#include "tests/e2e/harness.h"
#include "tests/simulations/cuda_follows.h"

namespace estuary::simulations {
namespace {

// 90 lines: "source" cycles math, trivia, "chit chat" (a space: its site's
// name has '_'); "topic" is sum or diff; every third line is Alpaca.
std::filesystem::path WriteSources(const testing::TempDir& dir) {
  const std::filesystem::path file = dir / "all.jsonl";
  std::ofstream out(file);
  const char* sources[] = {"math", "trivia", "chit chat"};
  for (int i = 0; i < 90; ++i) {
    const int a = i % 10, b = (i * 7) % 10;
    const std::string fields = fmt::format(R"("source": "{}", "topic": "{}", "n": {})", sources[i % 3],
                                           i % 2 ? "diff" : "sum", i);
    if (i % 3 == 0) {
      out << fmt::format(R"({{{}, "instruction": "Add the numbers.", "input": "{} and {}", "output": "{} plus {} is {}."}})",
                         fields, a, b, a, b, a + b);
    } else {
      out << fmt::format(R"({{{}, "messages": [{{"role": "user", "content": "What is {} and {}?"}}, )"
                         R"({{"role": "assistant", "content": "{} plus {} is {}."}}]}})",
                         fields, a, b, a, b, a + b);
    }
    out << "\n";
  }
  return file;
}

InstructionSplitOptions Options(const std::filesystem::path& file) {
  return {.data = file, .tokenizer = testing::CharBpeTokenizer(), .prompt_template = "chatml", .seq_len = 32,
          .seed = 5};
}

// The source lines of a set's examples.
std::set<uint64_t> Lines(const models::InstructionSet& set) {
  std::set<uint64_t> lines;
  for (const auto& e : set.examples) lines.insert(e.line);
  return lines;
}

TEST(InstructionSplit, OneSitePerValueOfAFieldAndAHeldOutShare) {
  testing::TempDir dir;
  InstructionSplitOptions o = Options(WriteSources(dir));
  o.partition_by = "source";
  auto split = SplitInstructionFile(o);
  ASSERT_TRUE(split.ok()) << split.status().ToString();
  EXPECT_EQ(split->names, (std::vector<std::string>{"chit_chat", "math", "trivia"}));
  ASSERT_EQ(split->sites.size(), 3u);
  size_t total = 0;
  const uint64_t first_line_of[] = {3, 1, 2};  // chit chat, math, trivia: line % 3 (lines count from 1)
  for (size_t s = 0; s < 3; ++s) {
    for (uint64_t line : Lines(split->sites[s])) EXPECT_EQ(line % 3, first_line_of[s] % 3) << split->names[s];
    total += split->sites[s].examples.size();
  }
  ASSERT_TRUE(split->held_out);
  EXPECT_GT(split->held_out->ScoredTargets(), 0);
  EXPECT_EQ(split->held_out->seq_len, 32);
  EXPECT_LT(total, 90u);  // some held out
  EXPECT_GT(total, 60u);  // about a tenth

  // The same seed gives the same split; a --sites that disagrees with the values is refused.
  auto again = SplitInstructionFile(o);
  ASSERT_TRUE(again.ok());
  for (size_t s = 0; s < 3; ++s) EXPECT_EQ(Lines(again->sites[s]), Lines(split->sites[s]));
  o.sites = 2;
  EXPECT_EQ(SplitInstructionFile(o).status().message(),
            fmt::format("sim: --sites 2 but 'source' takes 3 values in {} (one site each)", o.data.string()));
}

TEST(InstructionSplit, DirichletOverALabelFieldIsSeeded) {
  testing::TempDir dir;
  InstructionSplitOptions o = Options(WriteSources(dir));
  o.sites = 4;
  o.dirichlet_alpha = 0.5;
  o.label_field = "topic";
  auto split = SplitInstructionFile(o);
  ASSERT_TRUE(split.ok()) << split.status().ToString();
  EXPECT_EQ(split->names, (std::vector<std::string>{"client-000", "client-001", "client-002", "client-003"}));
  std::set<uint64_t> seen;
  for (const auto& site : split->sites) {
    EXPECT_FALSE(site.examples.empty());
    for (uint64_t line : Lines(site)) EXPECT_TRUE(seen.insert(line).second) << "line " << line << " twice";
  }
  auto again = SplitInstructionFile(o);
  ASSERT_TRUE(again.ok());
  o.seed = 6;
  auto other = SplitInstructionFile(o);
  ASSERT_TRUE(other.ok());
  bool differs = false;
  for (size_t s = 0; s < 4; ++s) {
    EXPECT_EQ(Lines(again->sites[s]), Lines(split->sites[s]));
    differs |= Lines(other->sites[s]) != Lines(split->sites[s]);
  }
  EXPECT_TRUE(differs);
}

TEST(InstructionSplit, BadInputNamesTheFileLineAndFlag) {
  testing::TempDir dir;
  const std::filesystem::path file = WriteSources(dir);
  {
    std::ofstream out(file, std::ios::app);
    out << R"({"instruction": "No source.", "output": "Yes."})" << "\n";
  }
  InstructionSplitOptions o = Options(file);
  o.partition_by = "source";
  EXPECT_EQ(SplitInstructionFile(o).status().message(),
            fmt::format("{}, line 91: no field 'source' (--partition-by source)", file.string()));
  o.partition_by = "n";  // numbers are values too: 91 lines but the last lacks it
  EXPECT_NE(SplitInstructionFile(o).status().message().find("line 91: no field 'n'"), std::string::npos);
  o.label_field = "topic";
  EXPECT_NE(SplitInstructionFile(o).status().message().find("one of the two"), std::string::npos);
  o.partition_by.clear();
  o.dirichlet_alpha = 0;
  EXPECT_NE(SplitInstructionFile(o).status().message().find("--dirichlet 0 needs ALPHA > 0"), std::string::npos);
  o = Options(file);
  o.partition_by = "source";
  o.prompt_template = "vicuna";
  EXPECT_EQ(SplitInstructionFile(o).status().message(), "template 'vicuna' is not one of llama3, chatml, alpaca, none");
}

// The held-out examples as lines of the file (what a server is given to
// score) render and pack to the rows the in-process evaluator scores.
TEST(InstructionSplit, TheHeldOutLinesPackToTheHeldOutRows) {
  testing::TempDir dir;
  InstructionSplitOptions o = Options(WriteSources(dir));
  o.partition_by = "source";
  auto split = SplitInstructionFile(o);
  ASSERT_TRUE(split.ok()) << split.status().ToString();
  auto examples = models::ParseInstructionJsonl(split->held_out_jsonl, "held-out");
  ASSERT_TRUE(examples.ok()) << examples.status().ToString();
  size_t shared = 0;
  for (const auto& site : split->sites) shared += site.examples.size();
  EXPECT_EQ(examples->size() + shared, 90u);
  auto tokenizer = models::Tokenizer::Load(o.tokenizer);
  ASSERT_TRUE(tokenizer.ok());
  auto set = models::EncodeInstructionSet(*examples, *tokenizer, models::PromptTemplate::kChatMl, "held-out");
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  const models::TokenRows rows = models::PackForTraining(*set, o.seq_len).rows;
  EXPECT_GT(rows.rows(), 0);
  EXPECT_EQ(rows.tokens, split->held_out->tokens);
  EXPECT_EQ(rows.targets, split->held_out->targets);
}

Scenario SitesBySource(const testing::TempDir& dir) {
  Scenario s;
  s.data_dir = WriteSources(dir);
  s.tokenizer = testing::CharBpeTokenizer();
  s.partition_by = "source";
  s.clients = 0;  // one per value
  s.per_round = 3;
  s.rounds = 3;
  s.task().set_model("llama-tiny");
  s.task().set_prompt_template("chatml");
  s.task().set_epochs(1);
  s.task().set_batch_size(4);
  s.task().set_seq_len(32);
  s.task().set_max_local_steps(5);
  s.task().set_optimizer("adamw");
  s.task().set_learning_rate(3e-3f);
  s.task().set_seed(5);
  return s;
}

TEST(InstructionSimulation, SitesByFieldLearnAndReproduce) {
  testing::TempDir dir;
  const Scenario s = SitesBySource(dir);
  auto first = RunInproc(s, nullptr);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto second = RunInproc(s, nullptr);
  ASSERT_TRUE(second.ok());
  ASSERT_EQ(first->rounds.size(), 3u);
  for (size_t r = 0; r < 3; ++r) {
    EXPECT_EQ(first->rounds[r].updates_received, 3u);
    EXPECT_EQ(first->rounds[r].global_checksum, second->rounds[r].global_checksum) << "round " << r + 1;
  }
  // The held-out response loss: from about ln 256 at init, falling round by round.
  EXPECT_LT(first->rounds[0].test_loss, 5.0);
  EXPECT_LT(first->rounds[1].test_loss, first->rounds[0].test_loss);
  EXPECT_LT(first->rounds[2].test_loss, first->rounds[1].test_loss);
}

// Over TLS the server scores the held-out examples itself (--eval-data
// FILE.jsonl --tokenizer): the loss the in-process evaluator reports.
TEST(InstructionSimulation, TheLoopbackServerScoresTheHeldOutExamplesAsInproc) {
  testing::TempDir dir;
  Scenario s = SitesBySource(dir);
  s.workdir = dir / "run";
  s.server_binary = testing::BinaryPath("estuary-server");
  auto inproc = RunInproc(s, nullptr);
  ASSERT_TRUE(inproc.ok()) << inproc.status().ToString();
  s.mode = "loopback";
  auto loopback = RunLoopback(s, nullptr);
  ASSERT_TRUE(loopback.ok()) << loopback.status().ToString();
  ASSERT_EQ(loopback->rounds.size(), 3u);
  for (size_t r = 0; r < 3; ++r) {
    EXPECT_GT(loopback->rounds[r].test_loss, 0.0) << "round " << r + 1;
    // Same sites, data and init; only the order updates are folded in differs.
    EXPECT_NEAR(loopback->rounds[r].test_loss, inproc->rounds[r].test_loss, 1e-4) << "round " << r + 1;
  }
  EXPECT_LT(loopback->rounds[2].test_loss, loopback->rounds[0].test_loss);
}

// The same federation with its sites on a GPU, whose engine skips the -100
// targets (tests/simulations/cuda_follows.h).
TEST(InstructionSimulation, CudaSitesFollowTheCpuRun) {
  if (auto usable = client::ParseCompute("cuda", "fp32"); !usable.ok()) {
    GTEST_SKIP() << usable.status().message();
  }
  testing::TempDir dir;
  ExpectCudaFollowsTheCpu(SitesBySource(dir), "instruction");
}

}  // namespace
}  // namespace estuary::simulations
