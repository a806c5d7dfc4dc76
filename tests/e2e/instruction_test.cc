// End-to-end: sites fine-tune on their own instruction data. The real
// estuary-server and two estuary-client sites over mutual TLS on 127.0.0.1
// (one of them two ranks), each with its own JSON Lines file, template and tokenizer
// (models/instruction_set.h); the held-out loss on response tokens, scored
// here from the server's checkpoints, goes down. And what bad data gets: one
// line, a non-zero exit.
#include <gtest/gtest.h>

#include "models/instruction_set.h"
#include "models/checkpoint.h"
#include "models/federated_model.h"
#include "models/language_model.h"
#include "models/llama.h"
#include "tests/client/instruction_fixture.h"
#include "tests/e2e/federation.h"
#include "tests/e2e/harness.h"

namespace estuary::testing {
namespace {

constexpr int kSeqLen = 32;

// The mean loss over the scored targets of `rows` (every row in one batch),
// of `weights` in llama-tiny.
double ResponseLoss(std::span<const float> weights, const models::TrainingRows& rows) {
  auto model = models::Llama::Create(*models::LlamaPreset("llama-tiny"), int(rows.rows.rows()));
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  if (!model.ok() || weights.size() != model->parameters().size()) return -1;
  std::copy(weights.begin(), weights.end(), model->parameters().begin());
  auto loss = model->ForwardBackward(rows.rows.tokens.data(), rows.rows.targets.data(), int(rows.rows.rows()), kSeqLen);
  EXPECT_TRUE(loss.ok()) << loss.status().ToString();
  return loss.ok() ? double(*loss) : -1;
}

TEST(Instructions, TwoSitesFineTuneOnTheirOwnFilesAndTheHeldOutResponseLossFalls) {
  Federation f;
  f.Issue("site-a");
  f.Issue("site-b");
  WriteInstructionJsonl(f.dir() / "a.jsonl", 60, 0);
  WriteInstructionJsonl(f.dir() / "b.jsonl", 45, 60);
  WriteInstructionJsonl(f.dir() / "held-out.jsonl", 24, 500);
  const uint16_t port =
      f.StartServer(3, 2, {"--model", "llama-tiny", "--template", "chatml", "--seq-len", std::to_string(kSeqLen),
                           "--batch", "4", "--optimizer", "adamw", "--lr", "0.003", "--max-local-steps", "6",
                           "--seed", "5", "--eval-data", ""});
  ASSERT_NE(port, 0) << f.ServerLog();
  const std::vector<std::string> site_flags = {"--template", "chatml", "--tokenizer", CharBpeTokenizer().string()};
  auto a = f.StartClient("site-a", port, f.dir() / "a.jsonl", site_flags);
  // Site b is a site of two ranks: each rank loads the file, and rank 1 follows rank 0's rounds.
  std::vector<std::string> two_ranks = site_flags;
  two_ranks.insert(two_ranks.end(), {"--ranks", "2", "--backend", "gloo"});
  auto b = f.StartClient("site-b", port, f.dir() / "b.jsonl", two_ranks);
  EXPECT_EQ(a->Wait(), 0) << f.ClientLog("site-a");
  EXPECT_EQ(b->Wait(), 0) << f.ClientLog("site-b");
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  EXPECT_NE(f.ClientLog("site-b").find("2 ranks (gloo, ddp)"), std::string::npos) << f.ClientLog("site-b");

  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(rounds->size(), 3u);
  // Each site weighs its scored tokens.
  auto set_a = models::LoadInstructionSet(f.dir() / "a.jsonl", CharBpeTokenizer(), "chatml");
  auto set_b = models::LoadInstructionSet(f.dir() / "b.jsonl", CharBpeTokenizer(), "chatml");
  auto held_out = models::LoadInstructionSet(f.dir() / "held-out.jsonl", CharBpeTokenizer(), "chatml");
  ASSERT_TRUE(set_a.ok() && set_b.ok() && held_out.ok());
  auto participants = ParticipationsByName(*store, 1);
  EXPECT_EQ(participants["site-a"].examples, set_a->scored_tokens);
  EXPECT_EQ(participants["site-b"].examples, set_b->scored_tokens);

  const models::TrainingRows rows = models::PackForTraining(*held_out, kSeqLen);
  auto initial = models::InitialModel("llama-tiny", 5);
  ASSERT_TRUE(initial.ok()) << initial.status().ToString();
  std::vector<double> losses = {ResponseLoss(initial->values, rows)};
  for (const auto& r : *rounds) {
    EXPECT_EQ(r.state, server::RoundState::kCommitted);
    EXPECT_EQ(r.updates_received, 2u);
    auto path = store->CheckpointFor(r.round);
    ASSERT_TRUE(path.ok() && path->has_value());
    auto checkpoint = models::LoadCheckpoint(**path);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
    losses.push_back(ResponseLoss(checkpoint->data, rows));
  }
  std::string trace;
  for (double l : losses) trace += fmt::format("{:.4f} ", l);
  std::printf("held-out response loss, initial then after each round: %s\n", trace.c_str());
  SCOPED_TRACE("held-out response loss, initial then per round: " + trace);
  EXPECT_GT(losses[0], 4.0);  // an untrained model: near ln 256
  for (size_t i = 1; i < losses.size(); ++i) EXPECT_LT(losses[i], losses[i - 1]);
  EXPECT_LT(losses.back(), losses[0] - 1.0);
}

// What estuary-client prints and returns for bad data: one line, exit 1,
// before it dials the server (there is none here).
TEST(Instructions, BadDataIsOneLineAndANonZeroExit) {
  Federation f;
  f.Issue("site");
  WriteInstructionJsonl(f.dir() / "good.jsonl", 5);
  {
    std::ofstream out(f.dir() / "bad.jsonl");
    out << R"({"instruction": "Add.", "output": "2"})" << "\n"
        << R"({"messages": [{"role": "bot", "content": "hi"}]})" << "\n";
  }
  const auto files = f.Files("site");
  auto run = [&](const fs::path& data, const std::vector<std::string>& extra) {
    std::string command = fmt::format("{} --server 127.0.0.1:1 --cert {} --key {} --ca {} --data {}",
                                      BinaryPath("estuary-client").string(), files.cert.string(),
                                      files.key.string(), files.ca.string(), data.string());
    for (const auto& e : extra) command += " " + e;
    return RunCommand(command);
  };
  const std::string tokenizer = CharBpeTokenizer().string();
  const struct {
    fs::path data;
    std::vector<std::string> flags;
    std::string line;
  } cases[] = {
      {f.dir() / "bad.jsonl", {"--template", "chatml", "--tokenizer", tokenizer},
       "estuary-client: " + (f.dir() / "bad.jsonl").string() +
           ", line 2: messages[0].role: 'bot' is not one of system, user, assistant\n"},
      {f.dir() / "good.jsonl", {"--template", "vicuna", "--tokenizer", tokenizer},
       "estuary-client: template 'vicuna' is not one of llama3, chatml, alpaca, none\n"},
      {f.dir() / "good.jsonl", {"--tokenizer", tokenizer},
       "estuary-client: --data " + (f.dir() / "good.jsonl").string() +
           ": instruction data needs --template (llama3, chatml, alpaca, none) and --tokenizer (the model's "
           "tokenizer.json)\n"},
  };
  for (const auto& c : cases) {
    const CommandResult result = run(c.data, c.flags);
    EXPECT_EQ(result.exit_code, 1) << result.output;
    EXPECT_EQ(result.output, c.line);
  }
}

// The server checks the template it sends: an unknown one, or one for a
// model that is not a language model, is one line and the server does not start.
TEST(Instructions, TheServerRefusesATemplateItCannotSend) {
  Federation f;
  const std::string common = fmt::format("{} serve --listen 127.0.0.1:0 --cert {} --key {} --ca {} --db {}",
                                         BinaryPath("estuary-server").string(), f.Files("server").cert.string(),
                                         f.Files("server").key.string(), f.Files("server").ca.string(),
                                         (f.dir() / "x.db").string());
  const std::pair<std::string, std::string> cases[] = {
      {"--model llama-tiny --template vicuna", "template = 'vicuna': expected one of llama3, chatml, alpaca, none"},
      {"--model mlp --template chatml", "template = 'chatml' with model 'mlp': templates are for the language models"},
  };
  for (const auto& [flags, expected] : cases) {
    const CommandResult result = RunCommand(common + " " + flags);
    EXPECT_NE(result.exit_code, 0) << flags;
    EXPECT_NE(result.output.find(expected), std::string::npos) << result.output;
    EXPECT_EQ(std::count(result.output.begin(), result.output.end(), '\n'), 1) << result.output;
  }
}

}  // namespace
}  // namespace estuary::testing
