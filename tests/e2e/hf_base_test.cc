// End-to-end: a LoRA federation on a Hugging Face base that the server never
// sends. A tiny random Llama written by SaveHfCheckpoint is the base; the
// real estuary-server (--base-model DIR) and estuary-client sites (each
// --base-model with its own copy) over mutual TLS on 127.0.0.1. The round
// log's bytes say that each site was sent the adapter and nothing of the
// base, the held-out loss falls, and a site whose copy differs in one weight
// refuses the round in one line naming both identities, which the server
// records.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/checkpoint.h"
#include "models/federated_model.h"
#include "models/hf_base.h"
#include "models/language_model.h"
#include "models/llama.h"
#include "models/lora.h"
#include "models/lora_federation.h"
#include "tests/e2e/federation.h"
#include "tests/e2e/harness.h"
#include "tests/models/tiny_hf_base.h"

namespace estuary::testing {
namespace {

// Writes the base to `dir` and, with flip >= 0, flips the lowest bit of weight `flip` first.
models::HfBase WriteBase(const fs::path& dir, int64_t flip = -1) {
  auto model = models::Llama::Create(TinyHfConfig(), 1);
  EXPECT_TRUE(model.ok());
  model->Initialize(3);
  if (flip >= 0) {
    float& w = model->parameters()[size_t(flip)];
    w = std::bit_cast<float>(std::bit_cast<uint32_t>(w) ^ 1u);
  }
  EXPECT_TRUE(models::SaveHfCheckpoint(dir, *model).ok());
  auto base = models::LoadHfBase(dir);
  EXPECT_TRUE(base.ok()) << base.status().ToString();
  return base.ok() ? std::move(base).value() : models::HfBase{};
}

fs::path WriteText(const Federation& f) {
  const fs::path text = f.dir() / "text";
  fs::create_directories(text);
  std::ofstream out(text / "proverbs");
  for (int i = 0; i < 200; ++i) out << "a stitch in time saves nine, number " << i << "\n%\n";
  return text;
}

std::string ReadAll(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// `estuary-server export` of the last round of a naive federation on `base_dir`:
// the PEFT adapter names the base, the merged model carries the base's
// config.json and tokenizer files, its weights are torch's W + (alpha/r)·B·A,
// and our loader's logits for it are those of the base with the adapter.
void ExpectTheExportMergesOntoTheBase(Federation& f, const fs::path& base_dir) {
  const fs::path out = f.dir() / "export";
  const CommandResult exported = RunCommand(
      fmt::format("{} export --db {} --out {}", BinaryPath("estuary-server").string(), f.db().string(), out.string()));
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  const auto adapter_config = nlohmann::json::parse(ReadAll(out / "adapter" / "adapter_config.json"));
  EXPECT_EQ(adapter_config["base_model_name_or_path"], fs::absolute(base_dir).lexically_normal().string());
  for (const char* file : {"config.json", "tokenizer.json"}) {
    EXPECT_EQ(ReadAll(out / "merged" / file), ReadAll(base_dir / file)) << file;
  }
  const CommandResult oracle = RunCommand(fmt::format(
      "{} {}/tests/e2e/torch_merge_check.py {} {} {}", ESTUARY_TORCH_PYTHON, ESTUARY_SOURCE_DIR, base_dir.string(),
      (out / "adapter").string(), (out / "merged").string()));
  EXPECT_EQ(oracle.exit_code, 0) << oracle.output;
  std::printf("torch oracle of the merged model: %s", oracle.output.c_str());

  auto merged = models::LoadHfCheckpoint(out / "merged");
  ASSERT_TRUE(merged.ok()) << merged.status().ToString();
  auto base = models::LoadHfCheckpoint(base_dir);
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  auto adapted = models::LoraLlama::Create(std::move(base).value(), {.rank = 4, .alpha = 8,
                                                                      .target_modules = {"q_proj", "k_proj", "v_proj",
                                                                                         "o_proj"}});
  ASSERT_TRUE(adapted.ok()) << adapted.status().ToString();
  ASSERT_TRUE(models::LoadLoraAdapter(out / "adapter", *adapted).ok());
  std::vector<int32_t> tokens;
  for (int i = 0; i < 24; ++i) tokens.push_back(int32_t("a stitch in time saves 9"[i]));
  const size_t n = tokens.size() * 256;
  std::vector<float> want(n), got(n);
  ASSERT_TRUE(adapted->Forward(tokens.data(), 1, int(tokens.size()), want.data()).ok());
  ASSERT_TRUE(merged->Forward(tokens.data(), 1, int(tokens.size()), got.data()).ok());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < n; ++i) {
    diff += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    norm += double(want[i]) * want[i];
  }
  EXPECT_LT(std::sqrt(diff / norm), 1e-5);
  std::printf("merged logits vs base + adapter: relative difference %.3g\n", std::sqrt(diff / norm));

  // The export as Hugging Face's loaders read it: transformers + peft load the
  // adapter onto base/ and transformers loads merged/, where they import (the
  // GPU machine, which requires them); elsewhere torch_llama.py's own torch
  // model of the same keys and shapes reads the same files.
  const std::string request = nlohmann::json{{"tokens", nlohmann::json::array({tokens})}}.dump();
  for (const auto& [flag, dir] : {std::pair<std::string, fs::path>{"--check-lora", out}, {"--check-hf", out / "merged"}}) {
    std::ofstream(dir / "tokens.json") << request;
    const CommandResult run = RunCommand(fmt::format("{} {}/tests/models/torch_llama.py {} {}", ESTUARY_TORCH_PYTHON,
                                                     ESTUARY_SOURCE_DIR, flag, dir.string()));
    ASSERT_EQ(run.exit_code, 0) << flag << ": " << run.output;
    const auto torch = nlohmann::json::parse(ReadAll(dir / "logits.json"))["logits"].get<std::vector<double>>();
    ASSERT_EQ(torch.size(), n) << flag;
    double d = 0, w = 0;
    for (size_t i = 0; i < n; ++i) d += (torch[i] - want[i]) * (torch[i] - want[i]), w += torch[i] * torch[i];
    EXPECT_LT(std::sqrt(d / w), 1e-5) << flag;
    std::printf("%s: torch's logits vs ours, relative difference %.3g (%s)\n", flag.c_str(), std::sqrt(d / w),
                run.output.find("loaded with") != std::string::npos ? "transformers" : "torch_llama.py's model");
  }
}

const std::vector<std::string> kLoraFlags = {"--optimizer", "adamw", "--lr", "0.01", "--batch", "4", "--seq-len", "32",
                                             "--max-local-steps", "4", "--eval-windows", "4", "--update-kind", "lora",
                                             "--lora-rank", "4", "--lora-alpha", "8", "--seed", "9"};

TEST(HfBaseFederation, SitesHoldTheBaseTheServerSendsOnlyTheAdapterAndTheHeldOutLossFalls) {
  Federation f;
  f.Issue("site-a");
  f.Issue("site-b");
  const fs::path text = WriteText(f);
  const models::HfBase base = WriteBase(f.dir() / "server-base");
  // Not part of the identity; export copies it beside the merged model.
  std::ofstream(f.dir() / "server-base" / "tokenizer.json") << R"({"version": "1.0", "model": {"type": "BPE"}})";
  // Each site holds its own copy, in another directory.
  const models::HfBase copy = WriteBase(f.dir() / "site-copy");
  ASSERT_EQ(copy.sha256, base.sha256);
  std::vector<std::string> flags = {"--base-model", (f.dir() / "server-base").string(), "--eval-data", text.string(),
                                    "--lora-merge", "naive"};
  flags.insert(flags.end(), kLoraFlags.begin(), kLoraFlags.end());
  const uint16_t port = f.StartServer(3, 2, flags);
  ASSERT_NE(port, 0) << f.ServerLog();
  const std::vector<std::string> site = {"--base-model", (f.dir() / "site-copy").string()};
  auto a = f.StartClient("site-a", port, text, site);
  auto b = f.StartClient("site-b", port, text, site);
  EXPECT_EQ(a->Wait(), 0) << f.ClientLog("site-a");
  EXPECT_EQ(b->Wait(), 0) << f.ClientLog("site-b");
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();

  auto layout = models::MakeLoraGlobalLayout(base.config, {.rank = 4, .alpha = 8, .target_modules = {"q_proj", "k_proj",
                                                                                                     "v_proj", "o_proj"}});
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  const uint64_t base_bytes = base.weights.size() * sizeof(float), adapter = layout->adapter.byte_size();
  uint64_t a_factors = 0;  // round 1: B = 0 is what the sites hold already, so only the A factors travel
  for (const auto& spec : layout->adapter.tensors) a_factors += models::IsLoraA(spec.name) ? spec.numel() * 4 : 0;
  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(rounds->size(), 3u);
  auto stored_model = store->GetMeta("model");
  ASSERT_TRUE(stored_model.ok() && stored_model->has_value());
  EXPECT_EQ(**stored_model, "server-base@" + base.sha256.substr(0, 12));
  // Round 1 too: the sites held nothing of the federation's but the base, and were sent part of the adapter.
  for (const auto& r : *rounds) {
    const uint64_t sent = r.round == 1 ? a_factors : adapter;
    EXPECT_EQ(r.state, server::RoundState::kCommitted);
    EXPECT_EQ(r.updates_received, 2u);
    EXPECT_EQ(r.bytes_down, 2 * sent) << "round " << r.round;
    for (const auto& [name, p] : ParticipationsByName(*store, r.round)) {
      EXPECT_EQ(p.bytes_down, sent) << name << " round " << r.round;
      EXPECT_LT(p.bytes_down, base_bytes / 10) << name;
    }
  }
  EXPECT_NE(f.ClientLog("site-a").find("sha256 " + base.sha256), std::string::npos) << f.ClientLog("site-a");

  // The held-out loss of the base (B = 0: the initial adapted model is the base), then after each round.
  ASSERT_TRUE(models::RegisterHfModel(base.ModelName(), base.config).ok());
  auto evaluator = models::MakeEvaluator(base.ModelName(), text, {.seq_len = 32, .max_windows = 4, .seed = 9});
  ASSERT_TRUE(evaluator.ok()) << evaluator.status().ToString();
  auto initial = (*evaluator)->Evaluate(base.weights);
  ASSERT_TRUE(initial.ok()) << initial.status().ToString();
  std::vector<double> losses = {initial->loss};
  for (const auto& r : *rounds) {
    ASSERT_TRUE(r.test_loss.has_value());
    losses.push_back(*r.test_loss);
  }
  const std::string trace = fmt::format("{:.4f}", fmt::join(losses, " "));
  std::printf("held-out loss, base then after each round: %s\n", trace.c_str());
  SCOPED_TRACE("held-out loss, base then per round: " + trace);
  for (size_t i = 1; i < losses.size(); ++i) EXPECT_LT(losses[i], losses[i - 1]);
  ExpectTheExportMergesOntoTheBase(f, f.dir() / "server-base");
}

const std::vector<std::string> kFullFlags = {"--optimizer", "adamw", "--lr", "0.003", "--batch", "4", "--seq-len",
                                             "32", "--max-local-steps", "4", "--eval-windows", "4", "--update-kind",
                                             "full", "--seed", "9"};

// The held-out loss of the base and after each committed round, in order.
std::vector<double> HeldOutLosses(const models::HfBase& base, const fs::path& text,
                                  const std::vector<server::RoundRecord>& rounds) {
  EXPECT_TRUE(models::RegisterHfModel(base.ModelName(), base.config).ok());
  auto evaluator = models::MakeEvaluator(base.ModelName(), text, {.seq_len = 32, .max_windows = 4, .seed = 9});
  EXPECT_TRUE(evaluator.ok()) << evaluator.status().ToString();
  if (!evaluator.ok()) return {};
  auto initial = (*evaluator)->Evaluate(base.weights);
  EXPECT_TRUE(initial.ok()) << initial.status().ToString();
  std::vector<double> losses = {initial.ok() ? initial->loss : std::nan("")};
  for (const auto& r : rounds) losses.push_back(r.test_loss.value_or(std::nan("")));
  return losses;
}

// A full federation on a Hugging Face base: every site trains all of its
// weights and uploads full deltas; the server keeps the global model. In
// round 1 the global model is the base, which the sites hold, so each is
// sent one tensor (the smallest, a norm); afterwards every weight has
// changed, so each is sent the model once and nothing of the base beside it.
// The export is a Hugging Face directory with the base's config.json and
// tokenizer, which our loader reads back to the round's weights and logits.
TEST(HfBaseFederation, AFullFederationTrainsEveryWeightAndExportsAModelOurLoaderReadsBack) {
  Federation f;
  f.Issue("site-a");
  f.Issue("site-b");
  const fs::path text = WriteText(f);
  const models::HfBase base = WriteBase(f.dir() / "server-base");
  std::ofstream(f.dir() / "server-base" / "tokenizer.json") << R"({"version": "1.0", "model": {"type": "BPE"}})";
  WriteBase(f.dir() / "site-copy");
  std::vector<std::string> flags = {"--base-model", (f.dir() / "server-base").string(), "--eval-data", text.string()};
  flags.insert(flags.end(), kFullFlags.begin(), kFullFlags.end());
  const uint16_t port = f.StartServer(3, 2, flags);
  ASSERT_NE(port, 0) << f.ServerLog();
  const std::vector<std::string> site = {"--base-model", (f.dir() / "site-copy").string()};
  auto a = f.StartClient("site-a", port, text, site);
  auto b = f.StartClient("site-b", port, text, site);
  EXPECT_EQ(a->Wait(), 0) << f.ClientLog("site-a");
  EXPECT_EQ(b->Wait(), 0) << f.ClientLog("site-b");
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();

  const uint64_t model_bytes = base.manifest.byte_size();
  uint64_t smallest = model_bytes;
  for (const auto& spec : base.manifest.tensors) smallest = std::min<uint64_t>(smallest, spec.numel() * 4);
  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(rounds->size(), 3u);
  for (const auto& r : *rounds) {
    EXPECT_EQ(r.state, server::RoundState::kCommitted);
    EXPECT_EQ(r.updates_received, 2u);
    const uint64_t sent = r.round == 1 ? smallest : model_bytes;
    for (const auto& [name, p] : ParticipationsByName(*store, r.round)) {
      std::printf("round %llu %s: %llu bytes down, %llu up (model %llu)\n", (unsigned long long)r.round, name.c_str(),
                  (unsigned long long)p.bytes_down, (unsigned long long)p.bytes_up, (unsigned long long)model_bytes);
      EXPECT_EQ(p.bytes_down, sent) << name << " round " << r.round;
      // Never the base and the model: the base stays at the site.
      EXPECT_LT(p.bytes_down, 2 * model_bytes) << name;
      EXPECT_GE(p.bytes_up, model_bytes) << name << ": a full delta";
    }
  }
  EXPECT_LT((*rounds)[0].bytes_down, model_bytes / 100);

  const std::vector<double> losses = HeldOutLosses(base, text, *rounds);
  const std::string trace = fmt::format("{:.4f}", fmt::join(losses, " "));
  std::printf("held-out loss, base then after each round: %s\n", trace.c_str());
  SCOPED_TRACE("held-out loss, base then per round: " + trace);
  ASSERT_EQ(losses.size(), 4u);
  for (size_t i = 1; i < losses.size(); ++i) EXPECT_LT(losses[i], losses[i - 1]);

  // The export: model/ with the base's config.json and tokenizer, the round's weights bit for bit.
  const fs::path out = f.dir() / "export";
  const CommandResult exported = RunCommand(
      fmt::format("{} export --db {} --out {}", BinaryPath("estuary-server").string(), f.db().string(), out.string()));
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  EXPECT_NE(exported.output.find("copied config.json, tokenizer.json"), std::string::npos) << exported.output;
  for (const char* file : {"config.json", "tokenizer.json"}) {
    EXPECT_EQ(ReadAll(out / "model" / file), ReadAll(f.dir() / "server-base" / file)) << file;
  }
  auto path = store->CheckpointFor(3);
  ASSERT_TRUE(path.ok() && path->has_value());
  auto checkpoint = models::LoadCheckpoint(**path);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  auto reloaded = models::LoadHfCheckpoint(out / "model");
  ASSERT_TRUE(reloaded.ok()) << reloaded.status().ToString();
  ASSERT_EQ(reloaded->parameters().size(), checkpoint->data.size());
  EXPECT_TRUE(std::equal(checkpoint->data.begin(), checkpoint->data.end(), reloaded->parameters().begin()));
  EXPECT_FALSE(std::equal(base.weights.begin(), base.weights.end(), reloaded->parameters().begin()));
  auto direct = models::Llama::Create(base.config, 1);
  ASSERT_TRUE(direct.ok());
  std::copy(checkpoint->data.begin(), checkpoint->data.end(), direct->parameters().begin());
  std::vector<int32_t> tokens;
  for (int i = 0; i < 24; ++i) tokens.push_back(int32_t("a stitch in time saves 9"[i]));
  std::vector<float> want(tokens.size() * 256), got(want.size());
  ASSERT_TRUE(direct->Forward(tokens.data(), 1, int(tokens.size()), want.data()).ok());
  ASSERT_TRUE(reloaded->Forward(tokens.data(), 1, int(tokens.size()), got.data()).ok());
  EXPECT_EQ(got, want) << "the exported model's logits are the round's model's";
  // And its held-out loss is the one the round log recorded for round 3.
  auto evaluator =
      models::MakeEvaluator(base.ModelName(), text, {.threads = 2, .seq_len = 32, .max_windows = 4, .seed = 9});
  ASSERT_TRUE(evaluator.ok());
  auto scored = (*evaluator)->Evaluate(reloaded->parameters());
  ASSERT_TRUE(scored.ok());
  // (To the round log's rounding: evaluation sums windows over threads in whatever order they finish.)
  EXPECT_NEAR(scored->loss, losses[3], 1e-6 * losses[3]);
  std::printf("exported model's held-out loss %.9f, round 3's in the log %.9f\n", scored->loss, losses[3]);
}

struct RoundResult {
  std::string checksum;
  double loss = 0;
  bool operator==(const RoundResult&) const = default;
};

// `rounds` rounds of the federation `flags` describes, on the base
// server-base (the site holds its own copy), with one site so that the
// folding order is fixed. The server is stopped after each round in `stops`
// and started again on the same round log and checkpoints; before the last
// start, a start on another base (a copy with one bit flipped) must be
// refused in one line and leave the round log as it was.
std::vector<RoundResult> RunWithRestarts(const std::vector<std::string>& federation, uint64_t rounds,
                                         const std::vector<uint64_t>& stops) {
  Federation f;
  f.Issue("site-a");
  const fs::path text = WriteText(f);
  const models::HfBase base = WriteBase(f.dir() / "server-base");
  WriteBase(f.dir() / "site-copy");
  std::vector<std::string> flags = {"--base-model", (f.dir() / "server-base").string(), "--eval-data", text.string()};
  flags.insert(flags.end(), federation.begin(), federation.end());
  std::vector<uint64_t> stints = stops;
  stints.push_back(rounds);
  for (size_t i = 0; i < stints.size(); ++i) {
    if (i > 0 && i + 1 == stints.size()) {
      const models::HfBase other = WriteBase(f.dir() / "other-base", 12345);
      std::vector<std::string> args = f.ServeArgs(rounds, 1, flags);
      std::replace(args.begin(), args.end(), (f.dir() / "server-base").string(), (f.dir() / "other-base").string());
      std::string command = BinaryPath("estuary-server").string();
      for (const std::string& arg : args) command += " " + arg;
      const CommandResult refused = RunCommand(command);
      EXPECT_NE(refused.exit_code, 0) << refused.output;
      const std::string line = fmt::format(
          "server: {} holds a federation on base model server-base@{}, not {} (other-base@{}, sha256 {}): start it "
          "on the base it began with",
          f.db().string(), base.sha256.substr(0, 12), (f.dir() / "other-base").string(), other.sha256.substr(0, 12),
          other.sha256);
      EXPECT_NE(refused.output.find(line), std::string::npos) << refused.output;
      EXPECT_EQ(std::count(refused.output.begin(), refused.output.end(), '\n'), 1) << refused.output;
      auto rounds_now = f.OpenStore()->Rounds();
      EXPECT_TRUE(rounds_now.ok() && rounds_now->size() == stints[i - 1]) << "the refused start changed the log";
    }
    const uint16_t port = f.StartServer(stints[i], 1, flags);
    if (port == 0) return {};
    auto a = f.StartClient("site-a", port, text, {"--base-model", (f.dir() / "site-copy").string()});
    EXPECT_EQ(a->Wait(), 0) << f.ClientLog("site-a");
    EXPECT_EQ(f.WaitServer(), 0) << f.ServerLog();
    if (i > 0) {
      EXPECT_NE(f.ServerLog().find(fmt::format("resumed after round {}", stints[i - 1])), std::string::npos)
          << f.ServerLog();
    }
  }
  auto store = f.OpenStore();
  auto records = store->Rounds();
  EXPECT_TRUE(records.ok());
  std::vector<RoundResult> out;
  for (const auto& r : *records) {
    EXPECT_EQ(r.state, server::RoundState::kCommitted) << r.round;
    out.push_back({r.global_checksum, r.test_loss.value_or(std::nan(""))});
    // Every checkpoint, before and after a restart, names the same base.
    auto path = store->CheckpointFor(r.round);
    EXPECT_TRUE(path.ok() && path->has_value());
    auto checkpoint = models::LoadCheckpoint(**path);
    EXPECT_TRUE(checkpoint.ok());
    if (checkpoint.ok()) {
      EXPECT_EQ(checkpoint->metadata["hf_base_sha256"], base.sha256) << r.round;
    }
  }
  return out;
}

// A server restarted on the same round log resumes with the same base, and
// the rounds after the restart are those of a server that never stopped, bit
// for bit: a LoRA federation (exact, whose base weights change) and a full
// one (FedAdam, whose moments live in the checkpoint).
TEST(HfBaseFederation, ARestartedServerResumesOnTheSameBaseAndRefusesAnother) {
  std::vector<std::string> lora = kLoraFlags;
  lora.insert(lora.end(), {"--lora-merge", "exact"});
  std::vector<std::string> full = kFullFlags;
  full.insert(full.end(), {"--strategy", "fedadam", "--server-lr", "0.003"});
  for (const auto& [name, flags] : {std::pair{"lora", lora}, std::pair{"full", full}}) {
    SCOPED_TRACE(name);
    const std::vector<RoundResult> continuous = RunWithRestarts(flags, 3, {});
    const std::vector<RoundResult> restarted = RunWithRestarts(flags, 3, {1});
    ASSERT_EQ(continuous.size(), 3u);
    ASSERT_EQ(restarted.size(), 3u);
    for (size_t r = 0; r < 3; ++r) {
      std::printf("%s round %zu: %s, held-out loss %.6f (continuous) %s, %.6f (restarted after round 1)\n", name, r + 1,
                  continuous[r].checksum.substr(0, 12).c_str(), continuous[r].loss,
                  restarted[r].checksum.substr(0, 12).c_str(), restarted[r].loss);
      EXPECT_EQ(restarted[r], continuous[r]) << "round " << r + 1;
    }
    EXPECT_NE(continuous[2].checksum, continuous[1].checksum);
  }
}

TEST(HfBaseFederation, ASiteWhoseCopyDiffersInOneWeightRefusesTheRoundInOneLine) {
  Federation f;
  f.exit_when_done = false;
  f.Issue("site-bad");
  const fs::path text = WriteText(f);
  const models::HfBase base = WriteBase(f.dir() / "server-base");
  const models::HfBase other = WriteBase(f.dir() / "bad-copy", 12345);
  ASSERT_NE(other.sha256, base.sha256);
  std::vector<std::string> flags = {"--base-model", (f.dir() / "server-base").string(), "--eval-data", text.string(),
                                    "--lora-merge", "exact"};
  flags.insert(flags.end(), kLoraFlags.begin(), kLoraFlags.end());
  const uint16_t port = f.StartServer(1, 1, flags);
  ASSERT_NE(port, 0) << f.ServerLog();
  auto bad = f.StartClient("site-bad", port, text, {"--base-model", (f.dir() / "bad-copy").string()});
  EXPECT_EQ(bad->Wait(), 1) << f.ClientLog("site-bad");
  const std::string line = fmt::format(
      "site-bad: refused round 1: base model {} has sha256 {}, the federation's (server-base@{}) has sha256 {}: its "
      "weights differ",
      (f.dir() / "bad-copy").string(), other.sha256, base.sha256.substr(0, 12), base.sha256);
  const std::string log = f.ClientLog("site-bad");
  EXPECT_NE(log.find(line + "\n"), std::string::npos) << log;
  // The server heard it: the participation is refused with the reason, and the log says so.
  EXPECT_TRUE(f.AwaitLog("client site-bad refused round 1: " + line)) << f.ServerLog();
  f.server().Kill();
  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto participants = ParticipationsByName(*store, 1);
  EXPECT_EQ(participants["site-bad"].status, "refused");
  EXPECT_EQ(participants["site-bad"].detail, line);
  auto events = store->Events();
  ASSERT_TRUE(events.ok());
  bool recorded = false;
  for (const auto& e : *events) recorded |= e.kind == "site_refused" && e.detail == "round 1: " + line;
  EXPECT_TRUE(recorded);
}

TEST(HfBaseFederation, ASiteWithoutTheBaseIsToldWhichItNeeds) {
  Federation f;
  f.exit_when_done = false;
  f.Issue("site-none");
  const fs::path text = WriteText(f);
  const models::HfBase base = WriteBase(f.dir() / "server-base");
  std::vector<std::string> flags = {"--base-model", (f.dir() / "server-base").string(), "--eval-data", text.string()};
  flags.insert(flags.end(), kLoraFlags.begin(), kLoraFlags.end());
  const uint16_t port = f.StartServer(1, 1, flags);
  ASSERT_NE(port, 0) << f.ServerLog();
  auto none = f.StartClient("site-none", port, text);
  EXPECT_EQ(none->Wait(), 1) << f.ClientLog("site-none");
  EXPECT_NE(f.ClientLog("site-none")
                .find(fmt::format("site-none: refused round 1: the federation's base model is server-base@{} (sha256 "
                                  "{}), which this site does not hold (start it with --base-model DIR)\n",
                                  base.sha256.substr(0, 12), base.sha256)),
            std::string::npos)
      << f.ClientLog("site-none");
  EXPECT_TRUE(f.AwaitLog("client site-none refused round 1")) << f.ServerLog();
  f.server().Kill();
}

}  // namespace
}  // namespace estuary::testing
