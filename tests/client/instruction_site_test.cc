// A site on instruction data (models/instruction_set.h): a JSON Lines file
// through the template and the tokenizer into packed rows with the
// response-only targets, the scored-token count that weighs the site and its
// ranks, the refusals, and a site of 2 and 3 real processes over Gloo that
// trains the update one process does on the same masked rows.
#include <gtest/gtest.h>

#include <cmath>
#include <stdlib.h>

#include <fstream>

#include "models/instruction_set.h"
#include "client/site.h"
#include "comm/gloo_communicator.h"
#include "models/language_model.h"
#include "models/llama.h"
#include "models/lora_federation.h"
#include "models/transformer_ops.h"
#include "proto/task.h"
#include "tests/client/instruction_fixture.h"
#include "tests/comm/ranks.h"

extern "C" void openblas_set_num_threads(int);

namespace estuary::client {
namespace {

using namespace std::chrono_literals;
using comm::testing::FreeTcpAddress;
using comm::testing::RunRanks;
using models::kIgnoredTarget;
using testing::CharBpeTokenizer;
using testing::WriteInstructionJsonl;

// A fresh directory, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "estuary-instructions-XXXXXX").string();
    EXPECT_NE(::mkdtemp(pattern.data()), nullptr);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

std::string WriteFile(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path) << text;
  return path.string();
}

TEST(InstructionSite, RowsScoreTheResponsesAndCountTheirTargets) {
  TempDir dir;
  WriteFile(dir / "data.jsonl",
            R"({"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello."}]})"
            "\n"
            R"({"instruction": "Say no.", "output": "No."})"
            "\n");
  auto set = models::LoadInstructionSet(dir / "data.jsonl", CharBpeTokenizer(), "chatml");
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  auto tok = models::Tokenizer::Load(CharBpeTokenizer());
  ASSERT_TRUE(tok.ok());
  EXPECT_EQ(set->examples.size(), 2u);
  EXPECT_EQ(set->template_name(), "chatml");
  EXPECT_EQ(set->vocab_size, 132);
  EXPECT_EQ(set->eos_id, tok->TokenToId("</s>"));
  EXPECT_EQ(set->pad_id, *tok->TokenToId("<pad>"));

  // What each example scores: the assistant's content and <|im_end|>, nothing else.
  std::string scored_text;
  for (const auto& e : set->examples) {
    std::vector<int32_t> scored;
    for (size_t i = 0; i < e.ids.size(); ++i) {
      if (e.scored[i]) scored.push_back(e.ids[i]);
    }
    scored_text += tok->Decode(scored, false) + "|";
  }
  EXPECT_EQ(scored_text, "Hello.<|im_end|>|No.<|im_end|>|");
  const uint64_t expected_scored = tok->Encode("Hello.", false).size() + tok->Encode("No.", false).size() + 2;
  EXPECT_EQ(set->scored_tokens, expected_scored);

  // Packed at any length, the rows score exactly those targets, each the
  // token after its input; the last row is padded with ignored targets.
  for (int seq : {4, 7, 16, 64}) {
    const models::TrainingRows packed = models::PackForTraining(*set, seq);
    ASSERT_GT(packed.rows.rows(), 0);
    EXPECT_EQ(uint64_t(packed.rows.ScoredTargets()), set->scored_tokens) << seq;
    uint64_t sum = 0;
    std::string targets_text;
    for (int64_t r = 0; r < packed.rows.rows(); ++r) {
      sum += packed.scored[size_t(r)];
      for (int i = 0; i < seq; ++i) {
        const size_t at = size_t(r) * seq + i;
        const int32_t t = packed.rows.targets[at];
        if (t == kIgnoredTarget) continue;
        targets_text += tok->Decode(std::vector<int32_t>{t}, false);
        // The target is the next input, in this row or the first of the next.
        const size_t next = at + 1;
        if (next < packed.rows.tokens.size()) {
          EXPECT_EQ(packed.rows.tokens[next], t) << seq << " at " << at;
        }
      }
    }
    EXPECT_EQ(sum, set->scored_tokens) << seq;
    EXPECT_EQ(targets_text, "Hello.<|im_end|>No.<|im_end|>") << seq;
  }
  // Rows of 4 cut the stream into many, some scoring nothing, some several:
  // the ranks of a site see uneven counts.
  const models::TrainingRows rows4 = models::PackForTraining(*set, 4);
  EXPECT_NE(*std::min_element(rows4.scored.begin(), rows4.scored.end()),
            *std::max_element(rows4.scored.begin(), rows4.scored.end()));
}

TEST(InstructionSite, BadInputIsOneLineNamingWhatAndWhere) {
  TempDir dir;
  const std::string good = R"({"instruction": "Say no.", "output": "No."})";
  const std::string file = WriteFile(dir / "train.jsonl", good + "\n" + good + "\n{\"instruction\": \"x\"}\n");
  auto one_line = [](const Status& s) { return s.message().find('\n') == std::string::npos; };

  auto missing = models::LoadInstructionSet(file, CharBpeTokenizer(), "chatml");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().message(), file + ", line 3: 'output' is missing");

  auto unknown = models::LoadInstructionSet(file, CharBpeTokenizer(), "vicuna");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().message(), "template 'vicuna' is not one of llama3, chatml, alpaca, none");

  const std::string fine = WriteFile(dir / "fine.jsonl", good + "\n");
  auto lacks = models::LoadInstructionSet(fine, CharBpeTokenizer(), "llama3");
  ASSERT_FALSE(lacks.ok());
  EXPECT_NE(lacks.status().message().find("the llama3 template needs the token '<|begin_of_text|>'"),
            std::string::npos)
      << lacks.status().message();
  EXPECT_TRUE(one_line(lacks.status()));

  auto no_tokenizer = models::LoadInstructionSet(fine, dir / "absent/tokenizer.json", "chatml");
  ASSERT_FALSE(no_tokenizer.ok());
  EXPECT_NE(no_tokenizer.status().message().find("absent/tokenizer.json"), std::string::npos);
  EXPECT_TRUE(one_line(no_tokenizer.status()));
}

v1::TaskConfig InstructionTask(std::string prompt_template = "chatml");

// proto::CheckTask sits below models/ and keeps its own list of the
// templates: the same names as PromptTemplateNamed.
TEST(InstructionSite, TheTaskKnowsTheTemplatesTheModelsRender) {
  for (const char* name : {"llama3", "chatml", "alpaca", "none", "", "vicuna", "ChatML", "llama-3"}) {
    const bool rendered = models::PromptTemplateNamed(name).ok();
    const Status checked = proto::CheckTask(InstructionTask(name));
    EXPECT_EQ(checked.ok(), rendered) << name << ": " << checked.ToString();
  }
  v1::TaskConfig mlp = InstructionTask();
  mlp.set_model("mlp");
  EXPECT_EQ(proto::CheckTask(mlp).message(),
            "task: template = 'chatml' with model 'mlp': templates are for the language models");
  EXPECT_EQ(proto::CheckTask(InstructionTask("vicuna")).message(),
            "task: template = 'vicuna': expected one of llama3, chatml, alpaca, none");
}

v1::TaskConfig InstructionTask(std::string prompt_template) {
  v1::TaskConfig t;
  t.set_model("llama-tiny");
  t.set_epochs(1);
  t.set_batch_size(5);
  t.set_seq_len(16);
  t.set_max_local_steps(4);
  t.set_learning_rate(0.003f);
  t.set_optimizer("adamw");
  t.set_weight_decay(0.01f);
  t.set_seed(11);
  t.set_prompt_template(std::move(prompt_template));
  return t;
}

struct Global {
  std::vector<float> values;
  Manifest manifest;
};
Global LlamaTiny() {
  auto llama = models::Llama::Create(*models::LlamaPreset("llama-tiny"), 1);
  EXPECT_TRUE(llama.ok());
  llama->Initialize(3);
  return {{llama->parameters().begin(), llama->parameters().end()}, llama->manifest()};
}

TEST(InstructionSite, RefusesATaskOfAnotherTemplateOrPlainText) {
  TempDir dir;
  WriteInstructionJsonl(dir / "data.jsonl", 12);
  auto set = models::LoadInstructionSet(dir / "data.jsonl", CharBpeTokenizer(), "chatml");
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  auto shared = std::make_shared<const models::InstructionSet>(std::move(set).value());
  const Global global = LlamaTiny();
  auto solo = comm::MakeSoloCommunicator(Device::kCpu);

  auto cpu = MakeInstructionRankTrainer(*solo, shared, {});
  EXPECT_EQ(cpu->num_examples(), shared->scored_tokens);
  Status ok = cpu->Check(*TaskFromProto(InstructionTask()), global.manifest, global.values.size());
  EXPECT_TRUE(ok.ok()) << ok.ToString();
  Status other = cpu->Check(*TaskFromProto(InstructionTask("alpaca")), global.manifest, global.values.size());
  EXPECT_EQ(other.message(), fmt::format("task: the federation's template is 'alpaca', this site renders {} with "
                                         "'chatml' (--template)",
                                         shared->file));
  Status none = cpu->Check(*TaskFromProto(InstructionTask("")), global.manifest, global.values.size());
  EXPECT_NE(none.message().find("template is 'none'"), std::string::npos) << none.message();

  // A plain-text site asked for a template.
  auto text = MakeTextRankTrainer(*solo, std::make_shared<const std::vector<int32_t>>(200, 'a'), {});
  Status plain = text->Check(*TaskFromProto(InstructionTask()), global.manifest, global.values.size());
  EXPECT_NE(plain.message().find("this site holds plain text, not instruction data"), std::string::npos)
      << plain.message();

  // A GPU rank takes masked data too: its engine skips -100 targets.
  RankModels gpu;
  gpu.device = "cuda:0 bf16";
  auto on_gpu = MakeInstructionRankTrainer(*solo, shared, {}, gpu);
  Status accepted = on_gpu->Check(*TaskFromProto(InstructionTask()), global.manifest, global.values.size());
  EXPECT_TRUE(accepted.ok()) << accepted.ToString();
}

// ||a - b|| / ||b||, in double.
double RelError(std::span<const float> a, std::span<const float> b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

struct RankCase {
  int ranks = 2;
  parallel::ZeroStage stage = parallel::ZeroStage::kDdp;
  bool sgd = false;
  bool lora = false;  // rank-4 adapters on q and v, dropout 0.1
};

// Rank 0 trains two rounds through SiteTrainer and compares each update and
// train loss with one process's on the same file; the others follow.
Status RunInstructionSite(const RankCase& c, const std::string& address, const std::filesystem::path& data, int rank) {
  openblas_set_num_threads(1);
  ESTUARY_ASSIGN_OR_RETURN(auto comm, comm::ConnectGloo({.address = address, .rank = rank, .size = c.ranks,
                                                         .timeout = 60s},
                                                        {.host = "127.0.0.1"}));
  ESTUARY_ASSIGN_OR_RETURN(models::InstructionSet loaded, models::LoadInstructionSet(data, CharBpeTokenizer(), "chatml"));
  auto set = std::make_shared<const models::InstructionSet>(std::move(loaded));
  parallel::DataParallelOptions options{.stage = c.stage, .bucket_bytes = 64 << 10, .first_bucket_bytes = 4 << 10};
  auto rank_trainer = MakeInstructionRankTrainer(*comm, set, options);
  if (rank != 0) return RunFollower(*comm, *rank_trainer);

  v1::TaskConfig task = InstructionTask();
  if (c.sgd) {
    task.set_optimizer("sgd");
    task.set_learning_rate(0.5f);
    task.set_momentum(0.5f);
  }
  Global global = LlamaTiny();
  if (c.lora) {
    task.set_update_kind(v1::UPDATE_LORA);
    task.set_learning_rate(0.01f);
    v1::LoraTask& lora = *task.mutable_lora();
    lora.set_rank(4);
    lora.set_alpha(8);
    lora.set_dropout(0.1f);
    for (const char* module : {"q_proj", "v_proj"}) lora.add_target_modules(module);
    lora.set_merge("exact");
    ESTUARY_ASSIGN_OR_RETURN(auto initial,
                             models::LoraInitialModel("llama-tiny", TaskFromProto(task)->lora.config, 3, ""));
    global = {std::move(initial.values), std::move(initial.manifest)};
  }
  ESTUARY_ASSIGN_OR_RETURN(auto single, MakeLocalSite({.instructions = set}, {}));
  SiteTrainer site(*comm, std::move(rank_trainer), c.stage, Compute{});
  for (uint64_t round = 1; round <= 2; ++round) {
    ESTUARY_ASSIGN_OR_RETURN(Update got, site.Train(global.values, global.manifest, task, round, "site-x"));
    ESTUARY_ASSIGN_OR_RETURN(Update want, single->Train(global.values, global.manifest, task, round, "site-x"));
    // As the plain-text sites (tests/client/site_test.cc): AdamW's deltas agree to 1e-4, SGD's to 1e-5.
    const double tolerance = c.sgd ? 1e-5 : 1e-4;
    const double error = RelError(got.payload, want.payload);
    if (!(error <= tolerance)) return Internal("round {}: update differs from one process by {}", round, error);
    if (!(std::abs(got.train_loss - want.train_loss) <= 1e-5 * want.train_loss)) {
      return Internal("round {}: train loss {} != one process's {}", round, got.train_loss, want.train_loss);
    }
    if (got.num_examples != set->scored_tokens || want.num_examples != set->scored_tokens) {
      return Internal("weights {} and {}, not the {} scored tokens", got.num_examples, want.num_examples,
                      set->scored_tokens);
    }
    if (!c.lora) {  // a lora round's payload is the adapter; the next round starts where the first did
      for (size_t i = 0; i < global.values.size(); ++i) global.values[i] += want.payload[i];
    }
  }
  return site.Finish(Status::Ok());
}

class InstructionSiteMatchesOneProcess : public ::testing::TestWithParam<RankCase> {};

TEST_P(InstructionSiteMatchesOneProcess, OverTwoRounds) {
  const RankCase c = GetParam();
  TempDir dir;
  WriteInstructionJsonl(dir / "data.jsonl", 40);
  // The batches split rows of different scored counts among the ranks: a
  // weight by rows instead of scored targets would not give one process's update.
  auto set = models::LoadInstructionSet(dir / "data.jsonl", CharBpeTokenizer(), "chatml");
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  const models::TrainingRows rows = models::PackForTraining(*set, 16);
  ASSERT_NE(*std::min_element(rows.scored.begin(), rows.scored.end()),
            *std::max_element(rows.scored.begin(), rows.scored.end()));
  const std::string address = FreeTcpAddress();
  for (const auto& o :
       RunRanks(c.ranks, [&](int rank) { return RunInstructionSite(c, address, dir / "data.jsonl", rank); }, 120s)) {
    EXPECT_TRUE(o.ok()) << o.Describe();
  }
}

INSTANTIATE_TEST_SUITE_P(Site, InstructionSiteMatchesOneProcess,
                         ::testing::Values(RankCase{2, parallel::ZeroStage::kDdp, true},
                                           RankCase{2, parallel::ZeroStage::kDdp, false},
                                           RankCase{3, parallel::ZeroStage::kZero1, false},
                                           RankCase{2, parallel::ZeroStage::kDdp, false, true}),
                         [](const auto& info) {
                           return fmt::format("{}ranks_zero{}_{}{}", info.param.ranks, int(info.param.stage),
                                              info.param.sgd ? "sgd" : "adamw", info.param.lora ? "_lora" : "");
                         });

}  // namespace
}  // namespace estuary::client
