// LoRA on the LLaMA decoder against PyTorch: logits, loss and every adapter
// gradient with the base frozen (no base gradient formed), AdamW steps that
// move only the adapters, the merged export, PEFT adapter files both ways, and
// the errors bad adapter files get. The references are written by
// torch_llama.py (the models_torch_llama fixture); the error metric is
// max|a - b| / max|b| over a tensor, as in llama_test.cc.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <new>
#include <random>
#include <tuple>
#include <nlohmann/json.hpp>

#include "models/checkpoint.h"
#include "models/llama.h"
#include "models/lora.h"
#include "models/optimizer.h"
#include "models/precision.h"
#include "models/transformer_ops.h"
#include "models/flat_buffer.h"
#include "tests/e2e/harness.h"
#include "tests/models/llama_fixture.h"

// Counts operator new, to show that a training step allocates nothing.
static std::atomic<int64_t> g_allocations{0};
__attribute__((noinline)) void* operator new(size_t size) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size ? size : 1)) return p;
  throw std::bad_alloc();
}
__attribute__((noinline)) void operator delete(void* p) noexcept { std::free(p); }
__attribute__((noinline)) void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace estuary::models {
namespace {

using namespace fixture;  // the fixture readers (llama_fixture.h)
namespace fs = std::filesystem;

constexpr double kModelTolerance = 1e-4;
constexpr double kMergedTolerance = 1e-5;

LoraConfig LoraConfigFrom(const nlohmann::json& f) {
  LoraConfig c;
  c.rank = f["r"];
  c.alpha = f["lora_alpha"];
  c.target_modules = f["target_modules"].get<std::vector<std::string>>();
  c.base_model_name_or_path = "estuary/llama-fixture";
  return c;
}

Llama LoadBase(const nlohmann::json& f, int max_batch) { return LoadFixtureDecoder(f, max_batch); }

// The fixture's base weights with its adapters (values before training).
LoraLlama LoadFixtureModel(const nlohmann::json& f, int max_batch, bool recompute = false) {
  auto model = LoraLlama::Create(LoadFixtureDecoder(f, max_batch, recompute), LoraConfigFrom(f));
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  LoadTensors(f, model->manifest(), model->parameters());
  return std::move(model).value();
}

bool SameBits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

class LoraDecoder : public ::testing::TestWithParam<const char*> {};

TEST_P(LoraDecoder, ManifestIsPeftsSavedNames) {
  auto f = Fixture(std::string("lora_") + GetParam());
  LoraLlama model = LoadFixtureModel(f, 1);
  ExpectManifestMatches(model.manifest(), f["adapter_names"], f["adapter_shapes"], model.parameters().size(),
                        model.gradients().size());
}

TEST_P(LoraDecoder, LogitsLossAndEveryAdapterGradientMatchTorch) {
  auto f = Fixture(std::string("lora_") + GetParam());
  const int batch = f["batch"], seq = f["seq"];
  LoraLlama model = LoadFixtureModel(f, batch);
  Ids tokens = GetIds(f, "tokens"), targets = GetIds(f, "targets");

  Values logits(size_t(batch) * seq * model.base().config().vocab_size);
  ASSERT_TRUE(model.Forward(tokens.data(), batch, seq, logits.data()).ok());
  const double logits_error = RelativeError(logits.data(), Get(f, "logits"));
  EXPECT_LE(logits_error, kModelTolerance);

  // The base's gradient buffer is poisoned and must stay so: no base
  // gradient is formed. The adapters' must all be overwritten.
  std::fill(model.base().gradients().begin(), model.base().gradients().end(), 7.0f);
  std::fill(model.gradients().begin(), model.gradients().end(), 99.0f);
  const Values base(model.base().parameters().begin(), model.base().parameters().end());
  auto loss = model.ForwardBackward(tokens.data(), targets.data(), batch, seq);
  ASSERT_TRUE(loss.ok()) << loss.status().ToString();
  const double loss_error = RelativeError(&*loss, Get(f, "loss"));
  EXPECT_LE(loss_error, kModelTolerance);
  double worst = 0;
  for (const TensorSpec& t : model.manifest().tensors) {
    const double error = RelativeError(model.gradients().data() + t.offset, Get(f, t.name + ".grad"));
    EXPECT_LE(error, kModelTolerance) << t.name;
    worst = std::max(worst, error);
  }
  std::printf("[ measured ] %s: logits %.2e, loss %.2e, worst adapter gradient %.2e (of %zu tensors)\n", GetParam(),
              logits_error, loss_error, worst, model.manifest().tensors.size());
  EXPECT_TRUE(std::all_of(model.base().gradients().begin(), model.base().gradients().end(),
                          [](float g) { return g == 7.0f; }));
  EXPECT_TRUE(SameBits(base, model.base().parameters()));

  // Again from other gradients: the same bits, nothing stale.
  const Values first(model.gradients().begin(), model.gradients().end());
  std::fill(model.gradients().begin(), model.gradients().end(), -3.0f);
  auto again = model.ForwardBackward(tokens.data(), targets.data(), batch, seq);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *loss);
  EXPECT_TRUE(SameBits(first, model.gradients()));

  // Accumulation: two half-weighted passes add up to the one above.
  std::fill(model.gradients().begin(), model.gradients().end(), -3.0f);
  ASSERT_TRUE(model.ForwardBackward(tokens.data(), targets.data(), batch, seq, {.grad_scale = 0.5f}).ok());
  ASSERT_TRUE(model.ForwardBackward(tokens.data(), targets.data(), batch, seq,
                                    {.accumulate = true, .grad_scale = 0.5f})
                  .ok());
  EXPECT_LE(RelativeError(model.gradients().data(), first), 1e-6);
}

// The prompt's targets ignored: loss and every adapter gradient against
// F.cross_entropy(ignore_index=-100) on the same adapted model.
TEST_P(LoraDecoder, IgnoredTargetsMatchTorch) {
  auto f = Fixture(std::string("lora_") + GetParam());
  auto masked = Fixture(std::string("masked_lora_") + GetParam());
  const int batch = f["batch"], seq = f["seq"];
  LoraLlama model = LoadFixtureModel(f, batch);
  Ids tokens = GetIds(f, "tokens"), targets = GetIds(masked, "targets");
  ASSERT_GT(std::count(targets.begin(), targets.end(), kIgnoredTarget), 0);
  std::fill(model.gradients().begin(), model.gradients().end(), 99.0f);
  auto loss = model.ForwardBackward(tokens.data(), targets.data(), batch, seq);
  ASSERT_TRUE(loss.ok()) << loss.status().ToString();
  EXPECT_LE(RelativeError(&*loss, Get(masked, "loss")), kModelTolerance);
  for (const TensorSpec& t : model.manifest().tensors) {
    EXPECT_LE(RelativeError(model.gradients().data() + t.offset, Get(masked, t.name + ".grad")), kModelTolerance)
        << t.name;
  }
}

// Five AdamW steps over the adapter buffer (weight decay included): the
// losses and the adapters after them against torch, and the base weights
// bit for bit what they were.
TEST_P(LoraDecoder, AdamWMovesOnlyTheAdaptersAndMatchesTorch) {
  auto f = Fixture(std::string("lora_") + GetParam());
  const int batch = f["batch"], seq = f["seq"];
  LoraLlama model = LoadFixtureModel(f, batch);
  Ids tokens = GetIds(f, "tokens"), targets = GetIds(f, "targets");
  const Values base(model.base().parameters().begin(), model.base().parameters().end());
  AdamW adamw({f["lr"], f["beta1"], f["beta2"], f["eps"], f["weight_decay"]});
  const Values losses = Get(f, "losses");
  ASSERT_EQ(losses.size(), 5u);
  for (size_t step = 0; step < losses.size(); ++step) {
    auto loss = model.ForwardBackward(tokens.data(), targets.data(), batch, seq);
    ASSERT_TRUE(loss.ok()) << loss.status().ToString();
    EXPECT_LE(std::abs(*loss - losses[step]) / losses[step], kModelTolerance) << "step " << step;
    adamw.Step(model.parameters(), model.gradients());
  }
  EXPECT_LT(losses.back(), 0.9 * losses.front());  // the adapters alone do learn the batch
  for (const TensorSpec& t : model.manifest().tensors) {
    EXPECT_LE(RelativeError(model.parameters().data() + t.offset, Get(f, t.name + ".after")), kModelTolerance)
        << t.name;
  }
  EXPECT_TRUE(SameBits(base, model.base().parameters()));
  EXPECT_EQ(adamw.first_moment().size(), model.parameters().size());  // optimizer state: adapters only
}

TEST_P(LoraDecoder, TrainingStepsDoNotAllocate) {
  auto f = Fixture(std::string("lora_") + GetParam());
  const int batch = f["batch"], seq = f["seq"];
  LoraLlama model = LoadFixtureModel(f, batch);
  ExpectStepsDoNotAllocate(model, GetIds(f, "tokens"), GetIds(f, "targets"), batch, seq, g_allocations);
}

// W' = W + (alpha/r)·B·A: the merged plain model gives the adapted logits, in
// memory and through a Hugging Face directory.
TEST_P(LoraDecoder, MergedModelGivesTheAdaptedLogits) {
  auto f = Fixture(std::string("lora_") + GetParam());
  const int batch = f["batch"], seq = f["seq"];
  LoraLlama model = LoadFixtureModel(f, batch);
  Ids tokens = GetIds(f, "tokens");
  const size_t count = size_t(batch) * seq * model.base().config().vocab_size;
  Values adapted(count), merged_logits(count), loaded_logits(count);
  ASSERT_TRUE(model.Forward(tokens.data(), batch, seq, adapted.data()).ok());
  auto merged = model.Merged(batch);
  ASSERT_TRUE(merged.ok()) << merged.status().ToString();
  ASSERT_TRUE(merged->Forward(tokens.data(), batch, seq, merged_logits.data()).ok());
  const double error = RelativeError(merged_logits.data(), adapted);
  EXPECT_LE(error, kMergedTolerance);
  // The merge touched exactly the adapted projections.
  for (const TensorSpec& t : model.base().manifest().tensors) {
    const bool adapted_weight = [&] {
      for (const std::string& m : model.lora_config().target_modules) {
        if (t.name.ends_with("." + m + ".weight")) return true;
      }
      return false;
    }();
    const bool same = SameBits({model.base().parameters().data() + t.offset, t.numel()},
                               {merged->parameters().data() + t.offset, t.numel()});
    EXPECT_NE(same, adapted_weight) << t.name;
  }

  testing::TempDir dir;
  ASSERT_TRUE(SaveMergedHfCheckpoint(dir / "merged", model).ok());
  auto loaded = LoadHfCheckpoint(dir / "merged", batch);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ASSERT_TRUE(loaded->Forward(tokens.data(), batch, seq, loaded_logits.data()).ok());
  EXPECT_TRUE(SameBits(loaded_logits, merged_logits));
  std::printf("[ measured ] %s: merged against adapted logits %.2e\n", GetParam(), error);
}

// SaveLoraAdapter -> LoadLoraAdapter is bit exact, the files are PEFT's
// layout, and the torch reference, loading them the way PeftModel does for
// these keys, computes the adapted logits.
TEST_P(LoraDecoder, AdapterFilesRoundTripAndTorchLoadsThem) {
  auto f = Fixture(std::string("lora_") + GetParam());
  const int batch = f["batch"], seq = f["seq"];
  LoraLlama model = LoadFixtureModel(f, batch);
  testing::TempDir dir;
  ASSERT_TRUE(SaveLoraAdapter(dir / "adapter", model).ok());

  auto fresh = LoraLlama::Create(LoadBase(f, batch), model.lora_config());
  ASSERT_TRUE(fresh.ok());
  Status loaded = LoadLoraAdapter(dir / "adapter", *fresh);
  ASSERT_TRUE(loaded.ok()) << loaded.ToString();
  EXPECT_TRUE(SameBits(fresh->parameters(), model.parameters()));

  std::ifstream in(dir / "adapter" / "adapter_config.json");
  auto json = nlohmann::json::parse(in);
  EXPECT_EQ(json["peft_type"], "LORA");
  EXPECT_EQ(json["task_type"], "CAUSAL_LM");
  EXPECT_EQ(json["r"], f["r"]);
  EXPECT_EQ(json["lora_alpha"], f["lora_alpha"]);
  EXPECT_EQ(json["lora_dropout"], 0.0);
  EXPECT_EQ(json["bias"], "none");
  EXPECT_EQ(json["target_modules"], f["target_modules"]);
  EXPECT_EQ(json["base_model_name_or_path"], "estuary/llama-fixture");
  auto read = ReadLoraConfig(dir / "adapter");
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(read->rank, model.lora_config().rank);
  EXPECT_EQ(read->alpha, model.lora_config().alpha);
  EXPECT_EQ(read->target_modules, model.lora_config().target_modules);
  auto weights = LoadCheckpoint(dir / "adapter" / "adapter_model.safetensors");
  ASSERT_TRUE(weights.ok());
  EXPECT_EQ(weights->metadata.at("format"), "pt");

  ASSERT_TRUE(SaveHfCheckpoint(dir / "base", model.base()).ok());
  Ids tokens = GetIds(f, "tokens");
  nlohmann::json request = {{"tokens", nlohmann::json::array()}};
  for (int b = 0; b < batch; ++b) {
    request["tokens"].push_back(Ids(tokens.begin() + b * seq, tokens.begin() + (b + 1) * seq));
  }
  std::ofstream(dir / "tokens.json") << request.dump();
  auto run = testing::RunCommand(fixture::TorchPython() + " " + ESTUARY_SOURCE_DIR +
                                 "/tests/models/torch_llama.py --check-lora " + dir.path().string());
  ASSERT_EQ(run.exit_code, 0) << run.output;
  std::ifstream logits_in(dir / "logits.json");
  Values torch_logits = nlohmann::json::parse(logits_in)["logits"].get<Values>();
  Values logits(size_t(batch) * seq * model.base().config().vocab_size);
  ASSERT_TRUE(model.Forward(tokens.data(), batch, seq, logits.data()).ok());
  ASSERT_EQ(torch_logits.size(), logits.size());
  EXPECT_LE(RelativeError(logits.data(), torch_logits), kModelTolerance);
}

// On a base made with recompute, the adapted model re-runs each block's
// forward (adapters included) before its backward: loss and every adapter
// gradient are the plain path's bit for bit, and torch's.
TEST_P(LoraDecoder, RecomputeGivesThePlainPathsAdapterGradientsBitForBit) {
  auto f = Fixture(std::string("lora_") + GetParam());
  const int batch = f["batch"], seq = f["seq"];
  LoraLlama plain = LoadFixtureModel(f, batch), recompute = LoadFixtureModel(f, batch, /*recompute=*/true);
  ASSERT_TRUE(recompute.base().recompute());
  Ids tokens = GetIds(f, "tokens"), targets = GetIds(f, "targets");
  std::fill(recompute.gradients().begin(), recompute.gradients().end(), 99.0f);
  auto expected = plain.ForwardBackward(tokens.data(), targets.data(), batch, seq);
  auto loss = recompute.ForwardBackward(tokens.data(), targets.data(), batch, seq);
  ASSERT_TRUE(expected.ok() && loss.ok());
  EXPECT_EQ(*loss, *expected);
  EXPECT_TRUE(SameBits(plain.gradients(), recompute.gradients()));
  EXPECT_LE(RelativeError(&*loss, Get(f, "loss")), kModelTolerance);
  for (const TensorSpec& t : recompute.manifest().tensors) {
    EXPECT_LE(RelativeError(recompute.gradients().data() + t.offset, Get(f, t.name + ".grad")), kModelTolerance)
        << t.name;
  }
  ExpectStepsDoNotAllocate(recompute, tokens, targets, batch, seq, g_allocations);
}

INSTANTIATE_TEST_SUITE_P(Configs, LoraDecoder, ::testing::Values("untied_gqa", "tied_mqa", "biased_head_dim"));

// ---------------------------------------------------------------- small model

LlamaConfig SmallConfig() {
  LlamaConfig c;
  c.vocab_size = 40;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.max_seq_len = 6;
  return c;
}

LoraLlama SmallLora(LoraConfig lora = {}) {
  auto base = Llama::Create(SmallConfig(), 2);
  EXPECT_TRUE(base.ok());
  base->Initialize(3);
  auto model = LoraLlama::Create(std::move(base).value(), lora);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  return std::move(model).value();
}

// PEFT's init: B = 0 (the adapted model is the base at first) and A uniform
// in ±1/√in (kaiming_uniform_ with a = √5), reproducible from the seed.
TEST(LoraLlama, InitializationIsPeftsAndStartsAtTheBase) {
  LoraConfig config;
  config.rank = 4;
  config.target_modules = {"q_proj", "v_proj", "down_proj"};
  LoraLlama model = SmallLora(config), other = SmallLora(config);
  model.Initialize(11);
  other.Initialize(11);
  EXPECT_TRUE(SameBits(model.parameters(), other.parameters()));
  other.Initialize(12);
  EXPECT_FALSE(SameBits(model.parameters(), other.parameters()));
  for (const TensorSpec& t : model.manifest().tensors) {
    const float* p = model.parameters().data() + t.offset;
    if (t.name.ends_with("lora_B.weight")) {
      EXPECT_TRUE(std::all_of(p, p + t.numel(), [](float v) { return v == 0.0f; })) << t.name;
      continue;
    }
    const float bound = float(1.0 / std::sqrt(double(t.shape[1])));
    float lo = 0, hi = 0;
    for (uint64_t i = 0; i < t.numel(); ++i) {
      lo = std::min(lo, p[i]);
      hi = std::max(hi, p[i]);
    }
    EXPECT_GE(lo, -bound) << t.name;
    EXPECT_LE(hi, bound) << t.name;
    EXPECT_LT(lo, -0.5f * bound) << t.name;  // spread over the range, not a constant
    EXPECT_GT(hi, 0.5f * bound) << t.name;
  }
  EXPECT_EQ(model.manifest().tensors.size(), 2u * 3u * 2u);  // 2 layers, 3 modules, A and B
  EXPECT_EQ(model.manifest().tensors[2].name, "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight");
  EXPECT_EQ(model.manifest().tensors[5].shape, (std::vector<int64_t>{16, 4}));  // down_proj.lora_B [D, r]

  Ids tokens = {1, 5, 9, 2, 33, 7, 4, 4, 0, 39, 12, 6};
  Values base_logits(12 * 40), adapted(12 * 40);
  ASSERT_TRUE(model.base().Forward(tokens.data(), 2, 6, base_logits.data()).ok());
  ASSERT_TRUE(model.Forward(tokens.data(), 2, 6, adapted.data()).ok());
  EXPECT_EQ(base_logits, adapted);
}

TEST(LoraLlama, BadConfigsAndInputsAreErrors) {
  auto message = [](auto change) {
    LoraConfig c;
    change(c);
    auto base = Llama::Create(SmallConfig(), 1);
    auto model = LoraLlama::Create(std::move(base).value(), c);
    EXPECT_FALSE(model.ok());
    return model.ok() ? std::string() : model.status().message();
  };
  EXPECT_EQ(message([](LoraConfig& c) { c.rank = 0; }), "lora config: r is 0; it must be positive");
  EXPECT_EQ(message([](LoraConfig& c) { c.alpha = -1; }), "lora config: lora_alpha -1 must be positive and finite");
  EXPECT_EQ(message([](LoraConfig& c) { c.dropout = 1; }), "lora config: lora_dropout is 1; it must be in [0, 1)");
  EXPECT_EQ(message([](LoraConfig& c) { c.target_modules = {"q_proj", "lm_head"}; }),
            "lora config: target module 'lm_head' is not one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
            "down_proj");
  EXPECT_EQ(message([](LoraConfig& c) { c.target_modules = {"q_proj", "q_proj"}; }),
            "lora config: target module 'q_proj' is listed twice");
  EXPECT_EQ(message([](LoraConfig& c) { c.target_modules = {}; }), "lora config: target_modules is empty");

  LoraLlama model = SmallLora();
  model.Initialize(1);
  Ids tokens(12, 3), targets(12, 4);
  tokens[7] = 40;
  auto r = model.ForwardBackward(tokens.data(), targets.data(), 2, 6);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("token id 40"), std::string::npos) << r.status().message();
  tokens[7] = 3;
  EXPECT_TRUE(model.ForwardBackward(tokens.data(), targets.data(), 2, 6).ok());

  // For DDP: one unit per layer tiling the adapter buffer, and each layer's
  // gradients reported final as its backward ends, last layer first, 0 last.
  const auto units = model.units();
  ASSERT_EQ(units.size(), size_t(model.base().config().num_layers));
  uint64_t at = 0;
  for (size_t l = 0; l < units.size(); ++l) {
    EXPECT_EQ(units[l].name, "model.layers." + std::to_string(l));
    EXPECT_EQ(units[l].begin, at);
    at = units[l].end;
  }
  EXPECT_EQ(at, model.manifest().total_elements);
  struct Recorder : StepHooks {
    std::vector<uint64_t> offsets;
    void GradientsFinal(uint64_t offset) override { offsets.push_back(offset); }
  } hooks;
  ASSERT_TRUE(model.ForwardBackward(tokens.data(), targets.data(), 2, 6, {.hooks = &hooks}).ok());
  std::vector<uint64_t> want;
  for (size_t l = units.size(); l-- > 0;) want.push_back(units[l].begin);
  EXPECT_EQ(hooks.offsets, want);
}

// A base kept in bf16 is the bf16-rounded base: loss, logits, every adapter
// gradient, two AdamW steps and the merged model bit for bit those of an fp32
// base holding the rounded weights; loading new weights rounds them too. Its
// fp32 buffer holds at most one unit while a step runs (checked at every
// layer's gradient report) and only partial pages at unit edges after.
TEST(LoraLlama, ABaseKeptInBf16IsTheRoundedBaseAndHoldsOneUnitAtATime) {
  for (const bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    LlamaConfig c;
    c.vocab_size = 512;
    c.hidden_size = 128;
    c.intermediate_size = 352;
    c.num_layers = 4;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.max_seq_len = 8;
    c.tie_embeddings = tied;
    LoraConfig lora;
    lora.rank = 4;
    lora.dropout = 0.1f;
    lora.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
    auto make = [&](std::span<const float> base_weights) {
      auto base = Llama::Create(c, 2);
      EXPECT_TRUE(base.ok());
      std::copy(base_weights.begin(), base_weights.end(), base->parameters().begin());
      auto model = LoraLlama::Create(std::move(base).value(), lora);
      EXPECT_TRUE(model.ok());
      std::mt19937 gen(9);
      std::uniform_real_distribution<float> value(-0.2f, 0.2f);
      for (float& p : model->parameters()) p = value(gen);  // B not zero: every factor gets a gradient
      model->SeedDropout(4);
      return std::move(model).value();
    };
    auto init = Llama::Create(c, 1);
    ASSERT_TRUE(init.ok());
    init->Initialize(5);
    Values rounded(init->parameters().size());
    std::vector<uint16_t> bits(rounded.size());
    FloatToBf16(init->parameters(), bits);
    Bf16ToFloat(bits, rounded);
    EXPECT_FALSE(SameBits(rounded, init->parameters()));  // the rounding is not a no-op

    LoraLlama kept = make(init->parameters()), reference = make(rounded);
    kept.StoreBaseInBf16();
    ASSERT_TRUE(kept.base_in_bf16());
    const std::vector<ParameterUnit> units = kept.base().units();
    const size_t edges = 2 * units.size() * 4096;  // partial pages at unit edges stay resident
    size_t largest = 0;
    for (const ParameterUnit& u : units) largest = std::max<size_t>(largest, (u.end - u.begin) * sizeof(float));
    auto resident = [&] { return ResidentBytes(kept.base().parameters()).value(); };
    EXPECT_LE(resident(), edges);

    struct Watch : StepHooks {
      std::function<size_t()> resident;
      size_t most = 0;
      void GradientsFinal(uint64_t) override { most = std::max(most, resident()); }
    } watch;
    watch.resident = resident;
    const Ids tokens = {1, 5, 9, 2, 33, 7, 4, 4, 0, 39, 12, 6, 500, 3, 17, 8};
    const Ids targets = {5, 9, 2, 33, 7, 4, 4, 0, 39, 12, 6, 500, 3, 17, 8, 1};
    AdamW kept_opt({.lr = 1e-2f, .weight_decay = 0.1f}), reference_opt({.lr = 1e-2f, .weight_decay = 0.1f});
    for (int step = 0; step < 2; ++step) {
      auto got = kept.ForwardBackward(tokens.data(), targets.data(), 2, 8, {.hooks = &watch});
      auto want = reference.ForwardBackward(tokens.data(), targets.data(), 2, 8);
      ASSERT_TRUE(got.ok() && want.ok());
      EXPECT_EQ(*got, *want) << "step " << step;
      EXPECT_TRUE(SameBits(kept.gradients(), reference.gradients())) << "step " << step;
      kept_opt.Step(kept.parameters(), kept.gradients());
      reference_opt.Step(reference.parameters(), reference.gradients());
    }
    EXPECT_GT(watch.most, 0u);
    EXPECT_LE(watch.most, largest + edges);
    EXPECT_LT(largest + edges, kept.base().parameters().size_bytes() / 2);  // so the bound means something
    EXPECT_LE(resident(), edges);
    Values got_logits(16 * 512), want_logits(16 * 512);
    ASSERT_TRUE(kept.Forward(tokens.data(), 2, 8, got_logits.data()).ok());
    ASSERT_TRUE(reference.Forward(tokens.data(), 2, 8, want_logits.data()).ok());
    EXPECT_TRUE(SameBits(got_logits, want_logits));
    auto merged = kept.Merged(), merged_reference = reference.Merged();
    ASSERT_TRUE(merged.ok() && merged_reference.ok());
    EXPECT_TRUE(SameBits(merged->parameters(), merged_reference->parameters()));

    // New weights are rounded as they load.
    init->Initialize(6);
    FloatToBf16(init->parameters(), bits);
    Bf16ToFloat(bits, rounded);
    ASSERT_TRUE(kept.LoadBase(init->parameters()).ok());
    ASSERT_TRUE(reference.LoadBase(rounded).ok());
    ASSERT_TRUE(kept.Forward(tokens.data(), 2, 8, got_logits.data()).ok());
    ASSERT_TRUE(reference.Forward(tokens.data(), 2, 8, want_logits.data()).ok());
    EXPECT_TRUE(SameBits(got_logits, want_logits));
    EXPECT_FALSE(kept.LoadBase(std::span<const float>(rounded).first(10)).ok());
  }
}

// Dropout cannot be checked against torch (torch draws its masks from its own
// generator), so the torch comparisons above run with p = 0. With p = 0.3:
// inference ignores dropout; a step's masks follow from the seed (the same
// seed gives the same step bit for bit, the next step other masks); and a
// step's gradient is the derivative of that step's loss, by central
// differences with the masks held (reseeding), along the whole gradient and
// along each tensor's part of it.
// Recompute with every module adapted, dropout (its masks redrawn in the
// recomputation) and a base in fp32 or bf16 (its blocks unpacked for the
// recomputation): three steps of loss, adapter gradients (the second
// micro-batch added at another shape) and AdamW bit for bit the plain path's.
TEST(LoraLlama, RecomputeWithDropoutAndABf16BaseIsThePlainPathBitForBit) {
  LlamaConfig c = SmallConfig();
  c.num_layers = 3;
  LoraConfig lora;
  lora.rank = 4;
  lora.dropout = 0.25f;
  lora.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16 base" : "f32 base");
    auto make = [&](bool recompute) {
      auto base = Llama::Create(c, 2, recompute);
      EXPECT_TRUE(base.ok());
      base->Initialize(5);
      auto model = LoraLlama::Create(std::move(base).value(), lora);
      EXPECT_TRUE(model.ok());
      std::mt19937 gen(9);
      std::uniform_real_distribution<float> value(-0.2f, 0.2f);
      for (float& p : model->parameters()) p = value(gen);  // B not zero: every factor gets a gradient
      model->SeedDropout(4);
      if (bf16) model->StoreBaseInBf16();
      return std::move(model).value();
    };
    LoraLlama plain = make(false), recompute = make(true);
    Ids tokens = {1, 5, 9, 2, 33, 7, 4, 4, 0, 39, 12, 6}, targets = {5, 9, 2, 33, 7, 1, 4, 0, 39, 12, 6, 3};
    AdamW plain_adamw({.lr = 1e-2f}), recompute_adamw({.lr = 1e-2f});
    for (int step = 0; step < 3; ++step) {
      const BackwardOptions added{.accumulate = true, .grad_scale = 0.5f};
      for (const auto& [rows, seq, options] : {std::tuple{2, 6, BackwardOptions{}}, std::tuple{1, 4, added}}) {
        auto a = plain.ForwardBackward(tokens.data(), targets.data(), rows, seq, options);
        auto r = recompute.ForwardBackward(tokens.data(), targets.data(), rows, seq, options);
        ASSERT_TRUE(a.ok() && r.ok());
        EXPECT_EQ(*a, *r) << "step " << step;
        EXPECT_TRUE(SameBits(plain.gradients(), recompute.gradients())) << "step " << step;
      }
      plain_adamw.Step(plain.parameters(), plain.gradients());
      recompute_adamw.Step(recompute.parameters(), recompute.gradients());
    }
    EXPECT_TRUE(SameBits(plain.parameters(), recompute.parameters()));
  }
}

TEST(LoraLlama, DropoutIsSeededAndItsGradientIsTheStepsLossDerivative) {
  LoraConfig config;
  config.rank = 4;
  config.alpha = 8;
  config.dropout = 0.3f;
  config.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  LoraLlama model = SmallLora(config);
  LoraConfig plain_config = config;
  plain_config.dropout = 0;
  LoraLlama plain = SmallLora(plain_config);
  std::mt19937 rng(4);
  std::uniform_real_distribution<float> uniform(-0.25f, 0.25f);
  for (float& p : model.parameters()) p = uniform(rng);  // B too: the adapters matter
  std::copy(model.parameters().begin(), model.parameters().end(), plain.parameters().begin());
  Ids tokens = {1, 5, 9, 2, 33, 7, 4, 4, 0, 39, 12, 6}, targets = {5, 9, 2, 33, 7, 1, 4, 0, 39, 12, 6, 3};

  Values logits(12 * 40), plain_logits(12 * 40);
  ASSERT_TRUE(model.Forward(tokens.data(), 2, 6, logits.data()).ok());
  ASSERT_TRUE(plain.Forward(tokens.data(), 2, 6, plain_logits.data()).ok());
  EXPECT_EQ(logits, plain_logits);

  auto step = [&](uint64_t seed) {
    model.SeedDropout(seed);
    auto loss = model.ForwardBackward(tokens.data(), targets.data(), 2, 6);
    EXPECT_TRUE(loss.ok());
    return loss.ok() ? double(*loss) : NAN;
  };
  const double loss = step(7);
  const Values grad(model.gradients().begin(), model.gradients().end());
  EXPECT_EQ(step(7), loss);
  EXPECT_TRUE(SameBits(grad, model.gradients()));
  auto next = model.ForwardBackward(tokens.data(), targets.data(), 2, 6);  // step 1 of seed 7: other masks
  ASSERT_TRUE(next.ok());
  EXPECT_NE(*next, loss);
  auto undropped = plain.ForwardBackward(tokens.data(), targets.data(), 2, 6);
  ASSERT_TRUE(undropped.ok());
  EXPECT_NE(*undropped, loss);

  // Central differences along d (unit length) against grad·d = |grad restricted|.
  const Values theta(model.parameters().begin(), model.parameters().end());
  auto slope_error = [&](uint64_t begin, uint64_t end) {
    double norm = 0;
    for (uint64_t i = begin; i < end; ++i) norm += double(grad[i]) * grad[i];
    norm = std::sqrt(norm);
    const double eps = 3e-3;
    auto loss_at = [&](double t) {
      for (uint64_t i = 0; i < theta.size(); ++i) {
        model.parameters()[i] = i >= begin && i < end ? float(theta[i] + t * grad[i] / norm) : theta[i];
      }
      return step(7);
    };
    const double slope = (loss_at(eps) - loss_at(-eps)) / (2 * eps);
    std::copy(theta.begin(), theta.end(), model.parameters().begin());
    return std::abs(slope - norm) / norm;
  };
  const double whole = slope_error(0, theta.size());
  EXPECT_LE(whole, 1e-2);
  double worst = 0;
  for (const TensorSpec& t : model.manifest().tensors) {
    const double error = slope_error(t.offset, t.offset + t.numel());
    EXPECT_LE(error, 3e-2) << t.name;
    worst = std::max(worst, error);
  }
  std::printf("[ measured ] dropout 0.3: directional derivative vs gradient, whole %.2e, worst tensor %.2e\n",
              whole, worst);
}

// Writes dir/adapter_model.safetensors from the model's tensors, edited.
void WriteAdapterTensors(const fs::path& dir, const LoraLlama& model,
                         const std::function<void(std::vector<TensorSpec>&)>& edit) {
  std::vector<TensorSpec> specs = model.manifest().tensors;
  edit(specs);
  Manifest manifest;
  Values data;
  for (TensorSpec& t : specs) {
    t.offset = manifest.total_elements;
    manifest.total_elements += t.numel();
    data.resize(manifest.total_elements, 0.25f);
    manifest.tensors.push_back(t);
  }
  ASSERT_TRUE(SaveCheckpoint(dir / "adapter_model.safetensors", manifest, data, {{"format", "pt"}}).ok());
}

void EditConfig(const fs::path& dir, const std::string& key, const nlohmann::json& value) {
  nlohmann::json json;
  std::ifstream(dir / "adapter_config.json") >> json;
  json[key] = value;
  std::ofstream(dir / "adapter_config.json") << json.dump();
}

TEST(LoraFiles, BadAdapterFilesGetOneLineNamingFileAndTensor) {
  LoraConfig config;
  config.rank = 4;
  config.alpha = 8;
  LoraLlama model = SmallLora(config);
  model.Initialize(5);
  testing::TempDir dir;
  ASSERT_TRUE(SaveLoraAdapter(dir.path(), model).ok());
  const Values before(model.parameters().begin(), model.parameters().end());
  const std::string file = (dir / "adapter_model.safetensors").string();
  const std::string config_file = (dir / "adapter_config.json").string();
  auto load_error = [&]() {
    Status s = LoadLoraAdapter(dir.path(), model);
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(s.message().find('\n'), std::string::npos) << s.message();
    return s.message();
  };
  const std::string q1 = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight";

  WriteAdapterTensors(dir.path(), model, [&](std::vector<TensorSpec>& specs) {
    for (TensorSpec& t : specs) {
      if (t.name == q1) t.shape = {5, 16};
    }
  });
  EXPECT_EQ(load_error(), file + ": tensor '" + q1 +
                              "' has shape [5, 16], but adapter_config.json and the base imply [4, 16]");
  WriteAdapterTensors(dir.path(), model, [&](std::vector<TensorSpec>& specs) {
    std::erase_if(specs, [&](const TensorSpec& t) { return t.name == q1; });
  });
  EXPECT_EQ(load_error(), file + ": tensor '" + q1 + "' is missing");
  WriteAdapterTensors(dir.path(), model, [&](std::vector<TensorSpec>& specs) {
    specs.push_back({"base_model.model.lm_head.lora_A.weight", {4, 16}});
  });
  EXPECT_EQ(load_error(),
            file + ": unexpected tensor 'base_model.model.lm_head.lora_A.weight' (not an adapter of this model)");
  ASSERT_TRUE(SaveLoraAdapter(dir.path(), model).ok());

  EditConfig(dir.path(), "r", 8);
  EXPECT_EQ(load_error(), config_file + ": 'r' is 8, but the model's adapters have rank 4");
  EditConfig(dir.path(), "r", 4);
  EditConfig(dir.path(), "lora_alpha", 16);
  EXPECT_EQ(load_error(), config_file + ": 'lora_alpha' is 16, but the model's is 8");
  EditConfig(dir.path(), "lora_alpha", 8);
  EditConfig(dir.path(), "target_modules", nlohmann::json::array({"q_proj", "v_proj"}));
  EXPECT_EQ(load_error(), config_file + ": 'target_modules' is [q_proj, v_proj], but the model adapts [q_proj, "
                                        "k_proj, v_proj, o_proj] (k_proj differs)");
  EditConfig(dir.path(), "target_modules", "all-linear");
  EXPECT_EQ(load_error(),
            config_file + ": 'target_modules' is \"all-linear\"; only a list of module names is supported");
  EditConfig(dir.path(), "target_modules", nlohmann::json::array({"q_proj", "k_proj", "v_proj", "o_proj"}));
  EditConfig(dir.path(), "use_dora", true);
  EXPECT_EQ(load_error(), config_file + ": 'use_dora' is true; only false is supported");
  EditConfig(dir.path(), "use_dora", false);
  EditConfig(dir.path(), "lora_dropout", 1.5);
  EXPECT_EQ(load_error(), config_file + ": lora config: lora_dropout is 1.5; it must be in [0, 1)");
  EditConfig(dir.path(), "lora_dropout", 0.05);  // dropout does not change the weights: loads
  EXPECT_TRUE(SameBits(before, model.parameters()));  // nothing loaded by a failed load
  EXPECT_TRUE(LoadLoraAdapter(dir.path(), model).ok());
  EditConfig(dir.path(), "lora_dropout", 0.0);

  fs::remove(dir / "adapter_config.json");
  EXPECT_NE(load_error().find("adapter_config.json: cannot open"), std::string::npos);
}

}  // namespace
}  // namespace estuary::models
