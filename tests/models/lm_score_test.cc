// estuary-lm score end to end: a small random model whose vocabulary is the
// Llama 3 tokenizer's, saved as a Hugging Face directory, scored on a JSONL
// file of the three kinds of line. Each sequence's loss must be the number
// Llama::ForwardBackward gives for it, and within 1e-6 what PyTorch gives;
// the total the mean over scored tokens.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/instruction_data.h"
#include "models/llama.h"
#include "models/lm_sequences.h"
#include "models/prompt_template.h"
#include "models/tokenizer.h"

namespace estuary::models {
namespace {

namespace fs = std::filesystem;
const fs::path kLlama3 = fs::path(ESTUARY_BINARY_DIR) / "tests/models/tokenizer/tokenizers/llama3/tokenizer.json";
const std::string kLm = std::string(ESTUARY_BINARY_DIR) + "/models/estuary-lm";

// The Python that runs the torch oracle: ESTUARY_TORCH_PYTHON from the
// environment (a machine whose torch lives elsewhere), else the one CMake found.
std::string TorchPython() {
  const char* from_env = std::getenv("ESTUARY_TORCH_PYTHON");
  return from_env && *from_env ? from_env : ESTUARY_TORCH_PYTHON;
}

struct ShellRun {
  int exit_code;
  std::string output;
};

ShellRun RunShell(const std::string& command) {
  ShellRun run{-1, ""};
  FILE* pipe = popen(command.c_str(), "r");
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;) run.output.append(buffer, n);
  const int status = pclose(pipe);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

class EstuaryLmScore : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / fmt::format("estuary-lm-score-{}", getpid());
    fs::create_directories(dir_);
    auto tokenizer = Tokenizer::Load(kLlama3);
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
    LlamaConfig c;
    c.vocab_size = tokenizer->vocab_size();
    c.hidden_size = 16;
    c.intermediate_size = 24;
    c.num_layers = 2;
    c.num_heads = 2;
    c.num_kv_heads = 1;
    c.max_seq_len = 48;
    c.tie_embeddings = true;
    auto model = Llama::Create(c, 1);
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    model->Initialize(7);
    ASSERT_TRUE(SaveHfCheckpoint(dir_ / "model", *model).ok());
    std::ofstream(dir_ / "data.jsonl")
        << R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4, of course."}]})"
        << "\n"
        << R"({"instruction": "Name a colour.", "output": "Blue, like the sea."})" << "\n"
        << R"({"text": "The quick brown fox jumps over the lazy dog."})" << "\n";
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Command(const std::string& extra) const {
    return fmt::format("{} score --model {} --tokenizer {} --data {} {} 2>&1", kLm, (dir_ / "model").string(),
                       kLlama3.string(), (dir_ / "data.jsonl").string(), extra);
  }

  fs::path dir_;
};

TEST_F(EstuaryLmScore, EachSequencesLossIsForwardBackwardsAndTheTotalTheirTokenWeightedMean) {
  ShellRun run = RunShell(Command("--template llama3 --seq-len 40"));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto report = nlohmann::json::parse(run.output);
  ASSERT_EQ(report["sequences"].size(), 3u) << run.output;

  // The same rows, by the library, and the model as the tool read it.
  auto model = LoadHfCheckpoint(dir_ / "model", 1);
  ASSERT_TRUE(model.ok());
  auto tokenizer = Tokenizer::Load(kLlama3);
  auto examples = LoadInstructionJsonl(dir_ / "data.jsonl");
  auto encoder = ExampleEncoder::Create(*tokenizer, PromptTemplate::kLlama3, "llama3");
  auto encoded = encoder->EncodeAll(*examples, "data.jsonl");
  ASSERT_TRUE(encoded.ok()) << encoded.status().ToString();
  const TokenRows rows = OneExamplePerSequence(*encoded, 40, 0);
  double weighted = 0;
  int64_t scored = 0;
  for (int r = 0; r < 3; ++r) {
    const auto& sequence = report["sequences"][r];
    EXPECT_EQ(sequence["line"], r + 1);
    EXPECT_EQ(sequence["tokens"], rows.lengths[r] + 1);
    auto loss = model->ForwardBackward(rows.tokens.data() + r * 40, rows.targets.data() + r * 40, 1, rows.lengths[r]);
    ASSERT_TRUE(loss.ok()) << loss.status().ToString();
    EXPECT_EQ(sequence["loss"].get<float>(), *loss) << r;
    EXPECT_DOUBLE_EQ(sequence["perplexity"].get<double>(), std::exp(double(*loss)));
    // A random model over 128256 tokens is near uniform: log(128256) = 11.76.
    EXPECT_NEAR(*loss, std::log(128256.0), 0.5);
    weighted += double(*loss) * sequence["scored"].get<double>();
    scored += sequence["scored"].get<int64_t>();
  }
  // "4, of course.<|eot_id|>": 6 tokens scored, the rest of the chat not.
  EXPECT_EQ(report["sequences"][0]["scored"], 6);
  EXPECT_EQ(report["total"]["scored"], scored);
  EXPECT_EQ(report["total"]["truncated"], 0);
  EXPECT_DOUBLE_EQ(report["total"]["loss"].get<double>(), weighted / double(scored));

  // PyTorch on the same rows and the directory the tool read (fp64, F.cross_entropy with ignore_index=-100).
  nlohmann::json rows_json = {{"tokens", nlohmann::json::array()}, {"targets", nlohmann::json::array()}};
  for (int r = 0; r < 3; ++r) {
    const auto at = rows.tokens.begin() + r * 40, targets_at = rows.targets.begin() + r * 40;
    rows_json["tokens"].push_back(std::vector<int32_t>(at, at + rows.lengths[r]));
    rows_json["targets"].push_back(std::vector<int32_t>(targets_at, targets_at + rows.lengths[r]));
  }
  std::ofstream(dir_ / "model/rows.json") << rows_json.dump();
  ShellRun torch = RunShell(fmt::format("{} {}/tests/models/torch_llama.py --check-loss {} 2>&1", TorchPython(),
                                        ESTUARY_SOURCE_DIR, (dir_ / "model").string()));
  ASSERT_EQ(torch.exit_code, 0) << torch.output;
  std::ifstream in(dir_ / "model/losses.json");
  const auto losses = nlohmann::json::parse(in)["losses"];
  double worst = 0;
  for (int r = 0; r < 3; ++r) {
    const double ours = report["sequences"][r]["loss"].get<double>(), theirs = losses[r].get<double>();
    EXPECT_LE(std::abs(ours - theirs) / theirs, 1e-6) << "row " << r << ": " << ours << " vs torch " << theirs;
    worst = std::max(worst, std::abs(ours - theirs) / theirs);
  }
  std::printf("[ measured ] estuary-lm score against torch: worst relative loss error %.1e over 3 sequences\n",
              worst);
}

TEST_F(EstuaryLmScore, ACutResponseScoresNothingAndIsCounted) {
  // 8 + 1 tokens hold the chat's header and system turn, none of its answer.
  ShellRun run = RunShell(Command("--template llama3 --seq-len 8"));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto report = nlohmann::json::parse(run.output);
  EXPECT_EQ(report["sequences"][0]["scored"], 0);
  EXPECT_TRUE(report["sequences"][0]["loss"].is_null());
  EXPECT_EQ(report["total"]["truncated"], 3);
}

TEST_F(EstuaryLmScore, BadInputIsOneLine) {
  ShellRun run = RunShell(Command(""));  // a chat line without a template
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_EQ(run.output, fmt::format("estuary-lm: {}, line 1: a chat example needs a template (llama3, chatml, alpaca)\n",
                                    (dir_ / "data.jsonl").string()));
  std::ofstream(dir_ / "data.jsonl", std::ios::app) << R"({"messages": [{"role": "bot", "content": "x"}]})" << "\n";
  run = RunShell(Command("--template llama3"));
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_EQ(run.output, fmt::format("estuary-lm: {}, line 4: messages[0].role: 'bot' is not one of system, user, "
                                    "assistant\n",
                                    (dir_ / "data.jsonl").string()));
  run = RunShell(Command("--template vicuna"));
  EXPECT_EQ(run.output, "estuary-lm: template 'vicuna' is not one of llama3, chatml, alpaca, none\n");
  run = RunShell(Command("--template llama3 --seq-len 49"));
  EXPECT_EQ(run.output, "estuary-lm: --seq-len 49 is longer than the model's context (48, max_position_embeddings)\n");
}

}  // namespace
}  // namespace estuary::models
