// The LLaMA decoder against PyTorch: each op's forward and backward, the whole
// model's logits, loss and every parameter gradient, Hugging Face checkpoints
// both ways, and the errors bad input gets. The references are written by
// torch_llama.py, which ctest runs as a fixture; the error metric everywhere is
// max|a - b| / max|b| over a tensor.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <new>
#include <nlohmann/json.hpp>

#include "models/checkpoint.h"
#include "models/llama.h"
#include "models/optimizer.h"
#include "models/transformer_ops.h"
#include "tests/e2e/harness.h"
#include "tests/models/llama_fixture.h"

// Counts operator new, to show that a training step allocates nothing. Not
// inlined, so the compiler does not pair a malloc it cannot see with the free.
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

constexpr double kOpTolerance = 1e-5;
constexpr double kModelTolerance = 1e-4;

// ------------------------------------------------------------------- ops

TEST(LlamaOps, EmbeddingGathersAndScatterAdds) {
  auto f = Fixture("op_embedding");
  Values table = Get(f, "table"), dout = Get(f, "dout");
  Ids tokens = GetIds(f, "tokens");
  const int n = int(tokens.size()), dim = 6;
  Values out(n * dim, 99.0f);
  EmbeddingForward(tokens.data(), n, table.data(), dim, out.data());
  EXPECT_LE(RelativeError(out.data(), Get(f, "out")), kOpTolerance);
  // Backward adds: start from 0.5 everywhere and take it off again.
  Values dtable(table.size(), 0.5f);
  EmbeddingBackward(tokens.data(), n, dout.data(), dim, dtable.data());
  for (float& v : dtable) v -= 0.5f;
  EXPECT_LE(RelativeError(dtable.data(), Get(f, "dtable")), kOpTolerance);
}

TEST(LlamaOps, RmsNorm) {
  auto f = Fixture("op_rmsnorm");
  Values x = Get(f, "x"), w = Get(f, "weight"), dy = Get(f, "dy");
  const int dim = 16, n = int(x.size()) / dim;
  Values y(x.size()), rstd(n), dx(x.size(), 0.25f), dw(dim, 99.0f);
  RmsNormForward(x.data(), w.data(), n, dim, f.at("eps").get<float>(), y.data(), rstd.data());
  EXPECT_LE(RelativeError(y.data(), Get(f, "y")), kOpTolerance);
  RmsNormBackward(x.data(), w.data(), rstd.data(), dy.data(), n, dim, dx.data(), dw.data());
  for (float& v : dx) v -= 0.25f;  // dx is added to what was there
  EXPECT_LE(RelativeError(dx.data(), Get(f, "dx")), kOpTolerance);
  EXPECT_LE(RelativeError(dw.data(), Get(f, "dweight")), kOpTolerance);
}

TEST(LlamaOps, RopeInsideWiderRows) {
  auto f = Fixture("op_rope");
  const int batch = f["batch"], seq = f["seq"], heads = f["heads"], head_dim = f["head_dim"];
  const int width = heads * head_dim, stride = width + 5;  // as q inside a fused qkv row
  Values cos(seq * head_dim / 2), sin(cos.size());
  RopeTables(seq, head_dim, f["theta"].get<double>(), cos.data(), sin.data());
  auto run = [&](const Values& in, bool forward) {
    Values rows(size_t(batch) * seq * stride, -7.0f), out;
    for (int r = 0; r < batch * seq; ++r) std::copy_n(in.begin() + r * width, width, rows.begin() + r * stride);
    if (forward) {
      RopeForward(rows.data(), batch, seq, heads, head_dim, stride, cos.data(), sin.data());
    } else {
      RopeBackward(rows.data(), batch, seq, heads, head_dim, stride, cos.data(), sin.data());
    }
    for (int r = 0; r < batch * seq; ++r) {
      out.insert(out.end(), rows.begin() + r * stride, rows.begin() + r * stride + width);
      for (int c = width; c < stride; ++c) EXPECT_EQ(rows[r * stride + c], -7.0f) << "wrote outside the heads";
    }
    return out;
  };
  EXPECT_LE(RelativeError(run(Get(f, "x"), true).data(), Get(f, "y")), kOpTolerance);
  EXPECT_LE(RelativeError(run(Get(f, "dy"), false).data(), Get(f, "dx")), kOpTolerance);
}

// The vectorisable exp of the softmaxes and SiLU against libm's, in double:
// within 2 ulp (2^-22 relative) from e^-87 to e^88 (every 1/64 and its
// neighbours' bits), 0 below the normal range, and NaN through.
TEST(LlamaOps, VectorExpIsExpWithin2Ulp) {
  double worst = 0;
  for (int i = -87 * 64; i <= 88 * 64; ++i) {
    for (float x : {float(i) / 64, std::nextafter(float(i) / 64, -100.0f), std::nextafter(float(i) / 64, 100.0f)}) {
      const double exact = std::exp(double(x));
      if (exact < 0x1.0p-126 || x > 88) continue;  // subnormal: 0; above 88: e^88
      worst = std::max(worst, std::abs(double(VectorExp(x)) - exact) / exact);
    }
  }
  EXPECT_LE(worst, 0x1.0p-22);
  EXPECT_EQ(VectorExp(0.0f), 1.0f);
  EXPECT_EQ(VectorExp(-88.0f), 0.0f);
  EXPECT_EQ(VectorExp(-1e30f), 0.0f);
  EXPECT_EQ(VectorExp(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_EQ(VectorExp(1e30f), VectorExp(88.0f));
  EXPECT_TRUE(std::isnan(VectorExp(std::numeric_limits<float>::quiet_NaN())));
}

TEST(LlamaOps, SwiGlu) {
  auto f = Fixture("op_swiglu");
  Values gate_up = Get(f, "gate_up"), dout = Get(f, "dout");
  const int hidden = f["hidden"], n = int(gate_up.size()) / (2 * hidden);
  Values out(n * hidden), dgate_up(gate_up.size(), 99.0f);
  SwiGluForward(gate_up.data(), n, hidden, out.data());
  SwiGluBackward(gate_up.data(), dout.data(), n, hidden, dgate_up.data());
  EXPECT_LE(RelativeError(out.data(), Get(f, "out")), kOpTolerance);
  EXPECT_LE(RelativeError(dgate_up.data(), Get(f, "dgate_up")), kOpTolerance);
}

TEST(LlamaOps, CrossEntropyOutOfPlaceAndInPlace) {
  auto f = Fixture("op_cross_entropy");
  Values logits = Get(f, "logits"), dlogits(logits.size(), 99.0f);
  Ids targets = GetIds(f, "targets");
  const int vocab = f["vocab"], n = int(targets.size());
  const float loss = CrossEntropyForwardBackward(logits.data(), targets.data(), n, vocab, dlogits.data());
  EXPECT_LE(RelativeError(&loss, Get(f, "loss")), kOpTolerance);
  EXPECT_LE(RelativeError(dlogits.data(), Get(f, "dlogits")), kOpTolerance);
  const float in_place = CrossEntropyForwardBackward(logits.data(), targets.data(), n, vocab, logits.data());
  EXPECT_EQ(in_place, loss);
  EXPECT_EQ(logits, dlogits);
}

// Rows whose target is -100 score nothing: the mean is over the others, and
// the ignored rows' dlogits are zero (F.cross_entropy, ignore_index=-100).
TEST(LlamaOps, CrossEntropyIgnoresTargetsOfMinus100) {
  auto f = Fixture("op_cross_entropy_ignored");
  Values logits = Get(f, "logits"), dlogits(logits.size(), 99.0f);
  Ids targets = GetIds(f, "targets");
  const int vocab = f["vocab"], n = int(targets.size());
  ASSERT_EQ(targets[0], kIgnoredTarget);
  const float loss = CrossEntropyForwardBackward(logits.data(), targets.data(), n, vocab, dlogits.data());
  EXPECT_LE(RelativeError(&loss, Get(f, "loss")), kOpTolerance);
  EXPECT_LE(RelativeError(dlogits.data(), Get(f, "dlogits")), kOpTolerance);
  EXPECT_TRUE(std::all_of(dlogits.begin(), dlogits.begin() + vocab, [](float d) { return d == 0.0f; }));
}

// torch gives NaN for a batch with nothing to score; we give 0 and zero
// gradients, so such a batch (a prompt longer than the context) cannot poison
// the weights.
TEST(LlamaOps, CrossEntropyWithEveryTargetIgnoredIsZero) {
  Values logits(3 * 7, 1.5f), dlogits(logits.size(), 99.0f);
  logits[4] = 3.0f;
  Ids targets(3, kIgnoredTarget);
  EXPECT_EQ(CrossEntropyForwardBackward(logits.data(), targets.data(), 3, 7, dlogits.data()), 0.0f);
  EXPECT_TRUE(std::all_of(dlogits.begin(), dlogits.end(), [](float d) { return d == 0.0f; }));
}

class LlamaAttentionOp : public ::testing::TestWithParam<const char*> {};

TEST_P(LlamaAttentionOp, MatchesTorch) {
  auto f = Fixture(std::string("op_attention_") + GetParam());
  const int batch = f["batch"], seq = f["seq"], heads = f["heads"], kv_heads = f["kv_heads"],
            head_dim = f["head_dim"];
  Values qkv = Get(f, "qkv"), dout = Get(f, "dout");
  Values probs(size_t(batch) * heads * seq * seq, 99.0f), out(size_t(batch) * seq * heads * head_dim, 99.0f);
  Values dscores(seq * seq), dqkv(qkv.size(), 99.0f);  // poisoned: every element must be written
  AttentionForward(qkv.data(), batch, seq, heads, kv_heads, head_dim, probs.data(), out.data());
  AttentionBackward(qkv.data(), probs.data(), dout.data(), batch, seq, heads, kv_heads, head_dim, dscores.data(),
                    dqkv.data());
  EXPECT_LE(RelativeError(probs.data(), Get(f, "probs")), kOpTolerance);
  EXPECT_LE(RelativeError(out.data(), Get(f, "out")), kOpTolerance);
  EXPECT_LE(RelativeError(dqkv.data(), Get(f, "dqkv")), kOpTolerance);
}

INSTANTIATE_TEST_SUITE_P(Heads, LlamaAttentionOp, ::testing::Values("gqa", "mqa", "mha"));

// --------------------------------------------------------------- decoder

// The fixture's model.
Llama LoadFixtureModel(const nlohmann::json& f, int max_batch) { return LoadFixtureDecoder(f, max_batch); }

class LlamaDecoder : public ::testing::TestWithParam<const char*> {};

TEST_P(LlamaDecoder, ManifestIsHuggingFacesStateDict) {
  auto f = Fixture(std::string("decoder_") + GetParam());
  Llama model = LoadFixtureModel(f, 1);
  ExpectManifestMatches(model.manifest(), f["names"], f["shapes"], model.parameters().size(),
                        model.gradients().size());
}

TEST_P(LlamaDecoder, LogitsLossAndEveryGradientMatchTorch) {
  auto f = Fixture(std::string("decoder_") + GetParam());
  const int batch = f["batch"], seq = f["seq"];
  Llama model = LoadFixtureModel(f, batch);
  Ids tokens = GetIds(f, "tokens"), targets = GetIds(f, "targets");

  Values logits(size_t(batch) * seq * model.config().vocab_size);
  ASSERT_TRUE(model.Forward(tokens.data(), batch, seq, logits.data()).ok());
  EXPECT_LE(RelativeError(logits.data(), Get(f, "logits")), kModelTolerance);

  std::fill(model.gradients().begin(), model.gradients().end(), 99.0f);  // must all be overwritten
  auto loss = model.ForwardBackward(tokens.data(), targets.data(), batch, seq);
  ASSERT_TRUE(loss.ok()) << loss.status().ToString();
  EXPECT_LE(RelativeError(&*loss, Get(f, "loss")), kModelTolerance);
  for (const TensorSpec& t : model.manifest().tensors) {
    const double error = RelativeError(model.gradients().data() + t.offset, Get(f, t.name + ".grad"));
    EXPECT_LE(error, kModelTolerance) << t.name;
  }

  // A second step from other gradients gives the same bits: nothing stale.
  const Values first(model.gradients().begin(), model.gradients().end());
  std::fill(model.gradients().begin(), model.gradients().end(), -3.0f);
  auto again = model.ForwardBackward(tokens.data(), targets.data(), batch, seq);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *loss);
  EXPECT_TRUE(std::equal(first.begin(), first.end(), model.gradients().begin()));
}

// Smaller batches and shorter sequences reuse the arena: sequence 1 alone, and
// any prefix (attention is causal), give the rows they give in the full batch.
TEST_P(LlamaDecoder, SmallerBatchesAndPrefixesAgree) {
  auto f = Fixture(std::string("decoder_") + GetParam());
  const int batch = f["batch"], seq = f["seq"];
  Llama model = LoadFixtureModel(f, batch);
  const int V = model.config().vocab_size;
  Ids tokens = GetIds(f, "tokens");
  Values full(size_t(batch) * seq * V);
  ASSERT_TRUE(model.Forward(tokens.data(), batch, seq, full.data()).ok());
  Values one(size_t(seq) * V);
  ASSERT_TRUE(model.Forward(tokens.data() + seq, 1, seq, one.data()).ok());
  EXPECT_LE(RelativeError(one.data(), Values(full.begin() + seq * V, full.begin() + 2 * seq * V)), 1e-6);
  const int prefix = seq - 3;
  Ids short_tokens;
  for (int b = 0; b < batch; ++b) short_tokens.insert(short_tokens.end(), tokens.begin() + b * seq,
                                                      tokens.begin() + b * seq + prefix);
  Values part(size_t(batch) * prefix * V), expected;
  ASSERT_TRUE(model.Forward(short_tokens.data(), batch, prefix, part.data()).ok());
  for (int b = 0; b < batch; ++b) {
    expected.insert(expected.end(), full.begin() + b * seq * V, full.begin() + (b * seq + prefix) * V);
  }
  EXPECT_LE(RelativeError(part.data(), expected), 1e-6);
}

// The prompt's targets ignored, as an instruction example's: loss and every
// gradient against F.cross_entropy(ignore_index=-100) on the same model.
TEST_P(LlamaDecoder, IgnoredTargetsMatchTorch) {
  auto f = Fixture(std::string("decoder_") + GetParam());
  auto masked = Fixture(std::string("masked_decoder_") + GetParam());
  const int batch = f["batch"], seq = f["seq"];
  Llama model = LoadFixtureModel(f, batch);
  Ids tokens = GetIds(f, "tokens"), targets = GetIds(masked, "targets");
  ASSERT_GT(std::count(targets.begin(), targets.end(), kIgnoredTarget), 0);
  std::fill(model.gradients().begin(), model.gradients().end(), 99.0f);
  auto loss = model.ForwardBackward(tokens.data(), targets.data(), batch, seq);
  ASSERT_TRUE(loss.ok()) << loss.status().ToString();
  EXPECT_LE(RelativeError(&*loss, Get(masked, "loss")), kModelTolerance);
  for (const TensorSpec& t : model.manifest().tensors) {
    const double error = RelativeError(model.gradients().data() + t.offset, Get(masked, t.name + ".grad"));
    EXPECT_LE(error, kModelTolerance) << t.name;
  }
}

TEST_P(LlamaDecoder, EveryTargetIgnoredGivesZeroLossAndZeroGradients) {
  auto f = Fixture(std::string("decoder_") + GetParam());
  const int batch = f["batch"], seq = f["seq"];
  Llama model = LoadFixtureModel(f, batch);
  Ids tokens = GetIds(f, "tokens"), targets(tokens.size(), kIgnoredTarget);
  std::fill(model.gradients().begin(), model.gradients().end(), 99.0f);
  auto loss = model.ForwardBackward(tokens.data(), targets.data(), batch, seq);
  ASSERT_TRUE(loss.ok()) << loss.status().ToString();
  EXPECT_EQ(*loss, 0.0f);
  EXPECT_TRUE(std::all_of(model.gradients().begin(), model.gradients().end(), [](float g) { return g == 0.0f; }));
}

TEST_P(LlamaDecoder, TrainingStepsDoNotAllocate) {
  auto f = Fixture(std::string("decoder_") + GetParam());
  const int batch = f["batch"], seq = f["seq"];
  Llama model = LoadFixtureModel(f, batch);
  ExpectStepsDoNotAllocate(model, GetIds(f, "tokens"), GetIds(f, "targets"), batch, seq, g_allocations);
}

// Ten steps of AdamW (weight decay on every tensor, as torch.optim.AdamW over
// model.parameters()) on one batch: each step's loss and gradient norm, and
// the weights at the end, against torch.
TEST_P(LlamaDecoder, TenAdamWStepsMatchTorch) {
  auto f = Fixture(std::string("decoder_") + GetParam());
  auto steps = Fixture(std::string("adamw_") + GetParam());
  const int batch = f["batch"], seq = f["seq"];
  Llama model = LoadFixtureModel(f, batch);
  Ids tokens = GetIds(f, "tokens"), targets = GetIds(f, "targets");
  AdamW adamw({steps["lr"], steps["beta1"], steps["beta2"], steps["eps"], steps["weight_decay"]});
  const Values losses = Get(steps, "losses"), norms = Get(steps, "grad_norms");
  ASSERT_EQ(losses.size(), 10u);
  for (size_t step = 0; step < losses.size(); ++step) {
    auto loss = model.ForwardBackward(tokens.data(), targets.data(), batch, seq);
    ASSERT_TRUE(loss.ok()) << loss.status().ToString();
    EXPECT_LE(std::abs(*loss - losses[step]) / losses[step], kModelTolerance) << "step " << step;
    // An infinite bound clips nothing; the norm it returns is the one torch saw.
    const double norm = ClipGradNorm(model.gradients(), INFINITY);
    EXPECT_LE(std::abs(norm - norms[step]) / norms[step], kModelTolerance) << "step " << step;
    adamw.Step(model.parameters(), model.gradients());
  }
  EXPECT_LT(losses.back(), 0.6 * losses.front());  // it does learn the batch
  for (const TensorSpec& t : model.manifest().tensors) {
    EXPECT_LE(RelativeError(model.parameters().data() + t.offset, Get(steps, t.name + ".after")), kModelTolerance)
        << t.name;
  }
}

// Save, reload, continue: a run stopped after three AdamW steps (weights as a
// Hugging Face checkpoint, moments as safetensors) and resumed in a fresh
// model gives the uninterrupted run's losses bit for bit.
TEST_P(LlamaDecoder, SaveReloadContinueIsBitIdentical) {
  auto f = Fixture(std::string("decoder_") + GetParam());
  const int batch = f["batch"], seq = f["seq"];
  Ids tokens = GetIds(f, "tokens"), targets = GetIds(f, "targets");
  const AdamWOptions options{.lr = 1e-2f, .weight_decay = 0.1f};
  auto step = [&](Llama& model, AdamW& adamw) {
    auto loss = model.ForwardBackward(tokens.data(), targets.data(), batch, seq);
    EXPECT_TRUE(loss.ok());
    adamw.Step(model.parameters(), model.gradients());
    return loss.ok() ? *loss : NAN;
  };
  Llama straight = LoadFixtureModel(f, batch);
  AdamW straight_adamw(options);
  std::vector<float> expected;
  for (int i = 0; i < 6; ++i) expected.push_back(step(straight, straight_adamw));

  Llama first = LoadFixtureModel(f, batch);
  AdamW first_adamw(options);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(step(first, first_adamw), expected[i]);
  testing::TempDir dir;
  ASSERT_TRUE(SaveHfCheckpoint(dir / "model", first).ok());
  ASSERT_TRUE(SaveCheckpoint(dir / "exp_avg.safetensors", first.manifest(), first_adamw.first_moment(),
                             {{"step", std::to_string(first_adamw.step_count())}})
                  .ok());
  ASSERT_TRUE(SaveCheckpoint(dir / "exp_avg_sq.safetensors", first.manifest(), first_adamw.second_moment()).ok());

  auto resumed = LoadHfCheckpoint(dir / "model", batch);
  ASSERT_TRUE(resumed.ok()) << resumed.status().ToString();
  auto m = LoadCheckpoint(dir / "exp_avg.safetensors");
  auto v = LoadCheckpoint(dir / "exp_avg_sq.safetensors");
  ASSERT_TRUE(m.ok() && v.ok());
  AdamW resumed_adamw(options);
  ASSERT_TRUE(resumed_adamw.Restore(m->data, v->data, std::stoll(m->metadata.at("step"))).ok());
  for (int i = 3; i < 6; ++i) EXPECT_EQ(step(*resumed, resumed_adamw), expected[i]) << "step " << i;
  EXPECT_TRUE(std::equal(resumed->parameters().begin(), resumed->parameters().end(), straight.parameters().begin()));
  EXPECT_FALSE(resumed_adamw.Restore(m->data, v->data, 0).ok());
}

bool SameBits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

// Activation recompute re-runs each block's forward before its backward: the
// same ops on the same inputs, so the loss and every gradient are the plain
// path's bit for bit — full targets, the masked fixture's, a second
// micro-batch of another shape added with a grad_scale — both equal to torch,
// and three AdamW steps leave the same weights. Its steps allocate nothing.
TEST_P(LlamaDecoder, RecomputeGivesThePlainPathsLossAndGradientsBitForBit) {
  auto f = Fixture(std::string("decoder_") + GetParam());
  auto masked = Fixture(std::string("masked_decoder_") + GetParam());
  const int batch = f["batch"], seq = f["seq"];
  Llama plain = LoadFixtureModel(f, batch);
  Llama recompute = LoadFixtureDecoder(f, batch, /*recompute=*/true);
  ASSERT_TRUE(recompute.recompute());
  ASSERT_FALSE(plain.recompute());
  ASSERT_GT(plain.config().num_layers, 1);  // else there is nothing to recompute
  EXPECT_LT(recompute.activation_arena().size(), plain.activation_arena().size());
  Ids tokens = GetIds(f, "tokens"), targets = GetIds(f, "targets"), masked_targets = GetIds(masked, "targets");

  auto both = [&](const Ids& t, int b, int s, const BackwardOptions& options) {
    auto a = plain.ForwardBackward(tokens.data(), t.data(), b, s, options);
    auto r = recompute.ForwardBackward(tokens.data(), t.data(), b, s, options);
    EXPECT_TRUE(a.ok() && r.ok());
    EXPECT_EQ(a.ok() ? *a : NAN, r.ok() ? *r : 0.0f);
    EXPECT_TRUE(SameBits(plain.gradients(), recompute.gradients()));
    return r.ok() ? *r : NAN;
  };
  std::fill(recompute.gradients().begin(), recompute.gradients().end(), 99.0f);  // must all be overwritten
  const float loss = both(targets, batch, seq, {});
  EXPECT_LE(RelativeError(&loss, Get(f, "loss")), kModelTolerance);
  for (const TensorSpec& t : recompute.manifest().tensors) {
    EXPECT_LE(RelativeError(recompute.gradients().data() + t.offset, Get(f, t.name + ".grad")), kModelTolerance)
        << t.name;
  }
  const float masked_loss = both(masked_targets, batch, seq, {});
  EXPECT_LE(RelativeError(&masked_loss, Get(masked, "loss")), kModelTolerance);
  both(targets, batch > 1 ? batch - 1 : 1, seq - 2, {.accumulate = true, .grad_scale = 0.5f});

  AdamW plain_adamw({.lr = 1e-2f, .weight_decay = 0.1f}), recompute_adamw({.lr = 1e-2f, .weight_decay = 0.1f});
  for (int i = 0; i < 3; ++i) {
    both(targets, batch, seq, {});
    plain_adamw.Step(plain.parameters(), plain.gradients());
    recompute_adamw.Step(recompute.parameters(), recompute.gradients());
  }
  EXPECT_TRUE(SameBits(plain.parameters(), recompute.parameters()));
  ExpectStepsDoNotAllocate(recompute, tokens, targets, batch, seq, g_allocations);
}

// ZeRO-3 gathers a unit's parameters at BeforeUnit and releases them at
// AfterUnit: the recomputation must run inside block l's backward bracket.
// Here every unit's weights are NaN outside its brackets; a recomputation
// outside them would turn the gradients NaN.
TEST_P(LlamaDecoder, RecomputeReadsABlocksWeightsOnlyInsideItsBackwardBracket) {
  auto f = Fixture(std::string("decoder_") + GetParam());
  const int batch = f["batch"], seq = f["seq"];
  Llama plain = LoadFixtureModel(f, batch);
  Llama recompute = LoadFixtureDecoder(f, batch, /*recompute=*/true);
  Ids tokens = GetIds(f, "tokens"), targets = GetIds(f, "targets");
  struct Gather : StepHooks {
    std::span<float> params;
    std::vector<ParameterUnit> units;
    Values kept;
    void Release(int u) { std::fill(params.begin() + units[u].begin, params.begin() + units[u].end, NAN); }
    void BeforeUnit(int u, Pass) override {
      std::copy(kept.begin() + units[u].begin, kept.begin() + units[u].end, params.begin() + units[u].begin);
    }
    void AfterUnit(int u, Pass) override { Release(u); }
  } gather;
  gather.params = recompute.parameters();
  gather.units = recompute.units();
  gather.kept.assign(gather.params.begin(), gather.params.end());
  for (int u = 0; u < int(gather.units.size()); ++u) gather.Release(u);
  auto expected = plain.ForwardBackward(tokens.data(), targets.data(), batch, seq);
  auto loss = recompute.ForwardBackward(tokens.data(), targets.data(), batch, seq, {.hooks = &gather});
  ASSERT_TRUE(expected.ok() && loss.ok());
  EXPECT_EQ(*loss, *expected);
  EXPECT_TRUE(SameBits(plain.gradients(), recompute.gradients()));
}

INSTANTIATE_TEST_SUITE_P(Configs, LlamaDecoder, ::testing::Values("untied_gqa", "tied_mqa", "biased_head_dim"));

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

TEST(Llama, InitializationIsDeterministicAndHuggingFaces) {
  LlamaConfig c = SmallConfig();
  c.vocab_size = 4000;  // enough draws to pin the spread
  auto a = Llama::Create(c, 1), b = Llama::Create(c, 1);
  ASSERT_TRUE(a.ok() && b.ok());
  a->Initialize(5);
  b->Initialize(5);
  EXPECT_TRUE(std::equal(a->parameters().begin(), a->parameters().end(), b->parameters().begin()));
  b->Initialize(6);
  EXPECT_FALSE(std::equal(a->parameters().begin(), a->parameters().end(), b->parameters().begin()));
  for (const TensorSpec& t : a->manifest().tensors) {
    const float* p = a->parameters().data() + t.offset;
    if (t.shape.size() == 1) {
      for (uint64_t i = 0; i < t.numel(); ++i) ASSERT_EQ(p[i], 1.0f) << t.name;
      continue;
    }
    double sum = 0, squares = 0;
    for (uint64_t i = 0; i < t.numel(); ++i) {
      sum += p[i];
      squares += double(p[i]) * p[i];
    }
    const double mean = sum / double(t.numel()), std = std::sqrt(squares / double(t.numel()) - mean * mean);
    // Five standard errors: the sample mean's is 0.02/sqrt(n), the sample std's 0.02/sqrt(2n).
    const double n = double(t.numel());
    EXPECT_NEAR(mean, 0.0, 5 * 0.02 / std::sqrt(n)) << t.name;
    EXPECT_NEAR(std, 0.02, 5 * 0.02 / std::sqrt(2 * n)) << t.name;
  }
}

// The arena is sized for max_batch x max_seq_len, but only what the steps
// run touch is resident: a model built for a long context and trained on
// short sequences does not hold the long context's activations (a zeroed
// vector held all of them: llama-124m's 1.4 GiB for 64-token steps).
TEST(Llama, ArenaIsResidentOnlyForTheStepsRun) {
  LlamaConfig c = SmallConfig();
  c.vocab_size = 512;
  c.hidden_size = 64;
  c.max_seq_len = 512;  // the arena is ~28 MiB, mostly the attention probabilities
  auto model = Llama::Create(c, 2);
  ASSERT_TRUE(model.ok());
  model->Initialize(1);
  const std::span<const float> arena = model->activation_arena();
  auto resident = [&] { return ResidentBytes(arena).value(); };
  EXPECT_EQ(resident(), 0u);
  Ids tokens(2 * 512, 3), targets(2 * 512, 4);
  ASSERT_TRUE(model->ForwardBackward(tokens.data(), targets.data(), 1, 8).ok());
  const size_t short_steps = resident();
  EXPECT_GT(short_steps, 0u);
  EXPECT_LT(short_steps, arena.size_bytes() / 100);
  ASSERT_TRUE(model->ForwardBackward(tokens.data(), targets.data(), 2, 512).ok());
  EXPECT_GT(resident(), arena.size_bytes() * 9 / 10);
}

// With recompute the arena holds the residual streams and one block's
// activations: exactly num_layers - 1 blocks' activations fewer than the
// plain arena (each slice rounded to 16 floats, as Carve lays them out); a
// full-size step makes it resident, and then it is what it maps.
TEST(Llama, RecomputeArenaHoldsOneBlocksActivations) {
  LlamaConfig c = SmallConfig();
  c.vocab_size = 512;
  c.hidden_size = 64;
  c.num_layers = 4;
  c.max_seq_len = 128;
  const int batch = 2;
  auto plain = Llama::Create(c, batch);
  auto recompute = Llama::Create(c, batch, /*recompute=*/true);
  ASSERT_TRUE(plain.ok() && recompute.ok());
  auto r16 = [](int64_t floats) { return (floats + 15) / 16 * 16; };
  const int64_t n = int64_t(batch) * c.max_seq_len, D = c.hidden_size, I = c.intermediate_size, hd = c.head_dim();
  const int64_t H = c.num_heads, KV = c.num_kv_heads, S = c.max_seq_len;
  const int64_t block = 2 * r16(n) + 3 * r16(n * D) + r16(n * (H + 2 * KV) * hd) + r16(batch * H * S * S) +
                        r16(n * H * hd) + r16(n * 2 * I) + r16(n * I);
  EXPECT_EQ(int64_t(plain->activation_arena().size()) - int64_t(recompute->activation_arena().size()),
            (c.num_layers - 1) * block);
  plain->Initialize(1);
  recompute->Initialize(1);
  Ids tokens(size_t(n), 3), targets(size_t(n), 4);
  ASSERT_TRUE(plain->ForwardBackward(tokens.data(), targets.data(), batch, c.max_seq_len).ok());
  ASSERT_TRUE(recompute->ForwardBackward(tokens.data(), targets.data(), batch, c.max_seq_len).ok());
  const size_t plain_resident = ResidentBytes(plain->activation_arena()).value();
  const size_t recompute_resident = ResidentBytes(recompute->activation_arena()).value();
  EXPECT_GT(recompute_resident, recompute->activation_arena().size_bytes() * 9 / 10);
  EXPECT_LT(recompute_resident + size_t(c.num_layers - 2) * block * sizeof(float), plain_resident);
}

TEST(Llama, BadTokensTargetsAndSizesAreErrors) {
  auto model = Llama::Create(SmallConfig(), 2);
  ASSERT_TRUE(model.ok());
  model->Initialize(1);
  Ids tokens(12, 3), targets(12, 4);
  std::fill(model->gradients().begin(), model->gradients().end(), 7.0f);
  const Values params(model->parameters().begin(), model->parameters().end());
  auto expect_error = [&](Result<float> r, const std::vector<std::string>& words) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
    for (const auto& w : words) EXPECT_NE(r.status().message().find(w), std::string::npos) << r.status().message();
  };
  tokens[7] = 40;
  expect_error(model->ForwardBackward(tokens.data(), targets.data(), 2, 6), {"token id 40", "batch 1", "position 1"});
  tokens[7] = -1;
  expect_error(model->ForwardBackward(tokens.data(), targets.data(), 2, 6), {"token id -1"});
  tokens[7] = 3;
  targets[11] = 1000;
  expect_error(model->ForwardBackward(tokens.data(), targets.data(), 2, 6), {"target id 1000", "position 5"});
  targets[11] = kIgnoredTarget - 1;  // only -100 means "ignored"
  expect_error(model->ForwardBackward(tokens.data(), targets.data(), 2, 6), {"target id -101", "position 5"});
  targets[11] = 4;
  expect_error(model->ForwardBackward(tokens.data(), targets.data(), 3, 4), {"batch 3", "[1, 2]"});
  expect_error(model->ForwardBackward(tokens.data(), targets.data(), 1, 7), {"sequence length 7", "[1, 6]"});
  expect_error(model->ForwardBackward(tokens.data(), nullptr, 1, 6), {"target"});
  Values logits(12 * 40);
  tokens[0] = 99;
  Status forward = model->Forward(tokens.data(), 2, 6, logits.data());
  EXPECT_NE(forward.message().find("token id 99"), std::string::npos) << forward.message();
  // Nothing was touched.
  EXPECT_TRUE(std::equal(params.begin(), params.end(), model->parameters().begin()));
  EXPECT_TRUE(std::all_of(model->gradients().begin(), model->gradients().end(), [](float g) { return g == 7.0f; }));
  tokens[0] = 3;
  EXPECT_TRUE(model->ForwardBackward(tokens.data(), targets.data(), 2, 6).ok());
}

TEST(Llama, BadConfigsNameTheFieldAndValue) {
  auto message = [](auto change) {
    LlamaConfig c = SmallConfig();
    change(c);
    auto model = Llama::Create(c, 1);
    EXPECT_FALSE(model.ok());
    return model.ok() ? std::string() : model.status().message();
  };
  EXPECT_EQ(message([](LlamaConfig& c) { c.vocab_size = 0; }), "llama config: vocab_size is 0; it must be positive");
  EXPECT_EQ(message([](LlamaConfig& c) { c.num_heads = 3; }),
            "llama config: num_heads 3 does not divide hidden_size 16");
  EXPECT_EQ(message([](LlamaConfig& c) { c.num_kv_heads = 3; }),
            "llama config: num_kv_heads 3 does not divide num_heads 4");
  EXPECT_NE(message([](LlamaConfig& c) { c.num_heads = 16; }).find("head_dim 1"), std::string::npos);
  EXPECT_NE(message([](LlamaConfig& c) { c.rms_norm_eps = 0; }).find("rms_norm_eps 0"), std::string::npos);
  EXPECT_NE(message([](LlamaConfig& c) { c.max_seq_len = -2; }).find("max_seq_len is -2"), std::string::npos);
  EXPECT_FALSE(Llama::Create(SmallConfig(), 0).ok());
  EXPECT_TRUE(SmallConfig().Validate().ok());
}

// ----------------------------------------------------------- checkpoints

class LlamaCheckpoint : public ::testing::TestWithParam<bool> {};

TEST_P(LlamaCheckpoint, SaveLoadRoundTripIsBitExact) {
  testing::TempDir dir;
  LlamaConfig c = SmallConfig();
  c.tie_embeddings = GetParam();
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 123456.5;
  auto model = Llama::Create(c, 1);
  ASSERT_TRUE(model.ok());
  model->Initialize(9);
  ASSERT_TRUE(SaveHfCheckpoint(dir / "m", *model).ok());
  auto loaded = LoadHfCheckpoint(dir / "m", 3);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->max_batch(), 3);
  EXPECT_TRUE(loaded->manifest() == model->manifest());
  EXPECT_EQ(std::memcmp(loaded->parameters().data(), model->parameters().data(), model->parameters().size_bytes()),
            0);
  const LlamaConfig& l = loaded->config();
  EXPECT_EQ(l.vocab_size, c.vocab_size);
  EXPECT_EQ(l.hidden_size, c.hidden_size);
  EXPECT_EQ(l.intermediate_size, c.intermediate_size);
  EXPECT_EQ(l.num_layers, c.num_layers);
  EXPECT_EQ(l.num_heads, c.num_heads);
  EXPECT_EQ(l.num_kv_heads, c.num_kv_heads);
  EXPECT_EQ(l.max_seq_len, c.max_seq_len);
  EXPECT_EQ(l.rms_norm_eps, c.rms_norm_eps);
  EXPECT_EQ(l.rope_theta, c.rope_theta);
  EXPECT_EQ(l.tie_embeddings, c.tie_embeddings);
  EXPECT_EQ(model->manifest().Find("lm_head.weight") == nullptr, c.tie_embeddings);

  std::ifstream in(dir / "m" / "config.json");
  auto json = nlohmann::json::parse(in);
  EXPECT_EQ(json["architectures"], nlohmann::json::array({"LlamaForCausalLM"}));
  EXPECT_EQ(json["model_type"], "llama");
  EXPECT_EQ(json["num_hidden_layers"], 2);
  EXPECT_EQ(json["num_key_value_heads"], 2);
  EXPECT_EQ(json["max_position_embeddings"], 6);
  EXPECT_EQ(json["tie_word_embeddings"], c.tie_embeddings);
  EXPECT_EQ(json["hidden_act"], "silu");
  EXPECT_EQ(json["torch_dtype"], "float32");
  EXPECT_EQ(json["attention_bias"], false);
  auto weights = LoadCheckpoint(dir / "m" / "model.safetensors");
  ASSERT_TRUE(weights.ok());
  EXPECT_EQ(weights->metadata.at("format"), "pt");  // from_pretrained insists
}

INSTANTIATE_TEST_SUITE_P(Tied, LlamaCheckpoint, ::testing::Bool());

// torch_llama.py wrote the fixture's weights as save_pretrained does (tensors
// in name order, the tied lm_head left out, a few more config.json keys).
TEST(LlamaHfCheckpoint, LoadsAHuggingFaceDirectory) {
  for (const char* name : {"untied_gqa", "tied_mqa", "biased_head_dim"}) {
    auto f = Fixture(std::string("decoder_") + name);
    const int batch = f["batch"], seq = f["seq"];
    auto model = LoadHfCheckpoint(kReference / (std::string("hf_") + name), batch);
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    Ids tokens = GetIds(f, "tokens");
    Values logits(size_t(batch) * seq * model->config().vocab_size);
    ASSERT_TRUE(model->Forward(tokens.data(), batch, seq, logits.data()).ok());
    EXPECT_LE(RelativeError(logits.data(), Get(f, "logits")), kModelTolerance) << name;
    // HfLoadOptions::recompute makes the recomputing decoder: torch's loss.
    auto recompute =
        LoadHfCheckpoint(kReference / (std::string("hf_") + name), {.max_batch = batch, .recompute = true});
    ASSERT_TRUE(recompute.ok()) << recompute.status().ToString();
    EXPECT_TRUE(recompute->recompute());
    EXPECT_FALSE(model->recompute());
    auto loss = recompute->ForwardBackward(tokens.data(), GetIds(f, "targets").data(), batch, seq);
    ASSERT_TRUE(loss.ok());
    EXPECT_LE(RelativeError(&*loss, Get(f, "loss")), kModelTolerance) << name;
  }
}

// The other way: what SaveHfCheckpoint writes, the torch reference loads the
// way from_pretrained does (config.json keys, strict names and shapes,
// format "pt") and computes the same logits.
TEST(LlamaHfCheckpoint, TorchLoadsWhatWeSave) {
  for (const char* name : {"untied_gqa", "tied_mqa", "biased_head_dim"}) {
    auto f = Fixture(std::string("decoder_") + name);
    const int batch = f["batch"], seq = f["seq"];
    Llama model = LoadFixtureModel(f, batch);
    testing::TempDir dir;
    ASSERT_TRUE(SaveHfCheckpoint(dir.path(), model).ok());
    Ids tokens = GetIds(f, "tokens");
    nlohmann::json request = {{"tokens", nlohmann::json::array()}};
    for (int b = 0; b < batch; ++b) request["tokens"].push_back(Ids(tokens.begin() + b * seq, tokens.begin() + (b + 1) * seq));
    std::ofstream(dir / "tokens.json") << request.dump();
    auto run = testing::RunCommand(fixture::TorchPython() + " " + ESTUARY_SOURCE_DIR +
                                   "/tests/models/torch_llama.py --check-hf " + dir.path().string());
    ASSERT_EQ(run.exit_code, 0) << run.output;
    std::ifstream in(dir / "logits.json");
    Values torch_logits = nlohmann::json::parse(in)["logits"].get<Values>();
    Values logits(size_t(batch) * seq * model.config().vocab_size);
    ASSERT_TRUE(model.Forward(tokens.data(), batch, seq, logits.data()).ok());
    ASSERT_EQ(torch_logits.size(), logits.size());
    EXPECT_LE(RelativeError(logits.data(), torch_logits), kModelTolerance) << name;
  }
}

// Rewrites one key of dir/config.json.
void EditConfig(const fs::path& dir, const std::string& key, const nlohmann::json& value) {
  nlohmann::json json;
  std::ifstream(dir / "config.json") >> json;
  json[key] = value;
  std::ofstream(dir / "config.json") << json.dump();
}

TEST(LlamaHfCheckpoint, MismatchesNameTheFileAndTensor) {
  testing::TempDir dir;
  auto model = Llama::Create(SmallConfig(), 1);
  ASSERT_TRUE(model.ok());
  model->Initialize(2);
  ASSERT_TRUE(SaveHfCheckpoint(dir.path(), *model).ok());
  const std::string file = (dir / "model.safetensors").string();
  auto load_error = [&]() {
    auto r = LoadHfCheckpoint(dir.path());
    EXPECT_FALSE(r.ok());
    return r.ok() ? std::string() : r.status().message();
  };

  EditConfig(dir.path(), "intermediate_size", 32);
  EXPECT_EQ(load_error(), file + ": tensor 'model.layers.0.mlp.gate_proj.weight' has shape [24, 16], but "
                                 "config.json implies [32, 16]");
  EditConfig(dir.path(), "intermediate_size", 24);
  EditConfig(dir.path(), "num_hidden_layers", 3);
  EXPECT_EQ(load_error(), file + ": tensor 'model.layers.2.self_attn.q_proj.weight' is missing");
  EditConfig(dir.path(), "num_hidden_layers", 2);
  EditConfig(dir.path(), "tie_word_embeddings", true);
  EXPECT_EQ(load_error(),
            file + ": unexpected tensor 'lm_head.weight' (not part of this config's LlamaForCausalLM, whose "
                   "embeddings are tied)");
  EditConfig(dir.path(), "tie_word_embeddings", false);
  EditConfig(dir.path(), "hidden_act", "gelu");
  EXPECT_EQ(load_error(), (dir / "config.json").string() + ": 'hidden_act' is \"gelu\"; only \"silu\" is supported");
  EditConfig(dir.path(), "hidden_act", "silu");
  EditConfig(dir.path(), "num_key_value_heads", 3);
  EXPECT_EQ(load_error(), (dir / "config.json").string() + ": llama config: num_kv_heads 3 does not divide num_heads 4");
  EditConfig(dir.path(), "num_key_value_heads", 2);
  ASSERT_TRUE(LoadHfCheckpoint(dir.path()).ok());
  // transformers 5's form of the RoPE settings.
  EditConfig(dir.path(), "rope_parameters", {{"rope_type", "default"}, {"rope_theta", 500000.0}});
  auto with_rope = LoadHfCheckpoint(dir.path());
  ASSERT_TRUE(with_rope.ok()) << with_rope.status().ToString();
  EXPECT_EQ(with_rope->config().rope_theta, 500000.0);
  EditConfig(dir.path(), "rope_parameters", {{"rope_type", "yarn"}, {"rope_theta", 10000.0}});
  EXPECT_EQ(load_error(), (dir / "config.json").string() +
                              ": 'rope_parameters' is {\"rope_theta\":10000.0,\"rope_type\":\"yarn\"}; only rope_type "
                              "\"default\", \"linear\" and \"llama3\" are supported");
  EditConfig(dir.path(), "rope_parameters", nullptr);

  // An integer tensor: same header length, so only the dtype differs.
  std::string bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const size_t at = bytes.find("\"F32\"");
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 5, "\"I32\"");
  std::ofstream(file, std::ios::binary) << bytes;
  const std::string error = load_error();
  EXPECT_NE(error.find(file), std::string::npos) << error;
  EXPECT_NE(error.find("'model.embed_tokens.weight' needs dtype F32, BF16 or F16"), std::string::npos) << error;

  fs::remove(dir / "config.json");
  EXPECT_NE(load_error().find("config.json: cannot open"), std::string::npos);
}

}  // namespace
}  // namespace estuary::models
