// A site's copy of a federation's Hugging Face base against the task
// (client/held_base.h): one line naming both identities whichever differs,
// and the model a patch on the base starts from.
#include "client/held_base.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "models/llama.h"

namespace estuary::client {
namespace {

models::LlamaConfig Tiny() {
  models::LlamaConfig c;
  c.vocab_size = 256, c.hidden_size = 32, c.intermediate_size = 64, c.num_layers = 1, c.num_heads = 4;
  c.num_kv_heads = 2, c.max_seq_len = 32;
  return c;
}

models::HfBase BaseOf(const models::LlamaConfig& c, float fill) {
  models::HfBase base;
  base.dir = "/copies/tiny";
  base.config = c;
  base.shape = models::CanonicalShape(c);
  base.manifest = models::LayoutOf(c).manifest;
  base.weights.assign(base.manifest.total_elements, fill);
  base.sha256 = models::HfBaseIdentity(c, base.weights);
  return base;
}

v1::TaskConfig TaskOn(const models::HfBase& base) {
  v1::TaskConfig task;
  task.set_model("tiny@" + base.sha256.substr(0, 12));
  task.mutable_hf_base()->set_sha256(base.sha256);
  task.mutable_hf_base()->set_shape(base.shape);
  return task;
}

TEST(HeldBase, TheSameCopyTrainsAndADifferentOneIsOneLineNamingBothHashes) {
  const models::HfBase theirs = BaseOf(Tiny(), 0.5f);
  const v1::TaskConfig task = TaskOn(theirs);
  EXPECT_EQ(RefusalOfBase(&theirs, task, 3, "site-a"), "");
  EXPECT_EQ(RefusalOfBase(nullptr, v1::TaskConfig(), 3, "site-a"), "") << "no base named: nothing to check";

  const models::HfBase other_weights = BaseOf(Tiny(), 0.25f);
  EXPECT_EQ(RefusalOfBase(&other_weights, task, 3, "site-a"),
            "site-a: refused round 3: base model /copies/tiny has sha256 " + other_weights.sha256 +
                ", the federation's (" + task.model() + ") has sha256 " + theirs.sha256 + ": its weights differ");
  models::LlamaConfig wider = Tiny();
  wider.intermediate_size = 128;
  const models::HfBase other_shape = BaseOf(wider, 0.5f);
  EXPECT_EQ(RefusalOfBase(&other_shape, task, 3, "site-a"),
            "site-a: refused round 3: base model /copies/tiny has sha256 " + other_shape.sha256 +
                ", the federation's (" + task.model() + ") has sha256 " + theirs.sha256 +
                ": its config differs (intermediate_size: 128 vs 64, this site's vs the federation's)");
  EXPECT_EQ(RefusalOfBase(nullptr, task, 3, "site-a"),
            "site-a: refused round 3: the federation's base model is " + task.model() + " (sha256 " + theirs.sha256 +
                "), which this site does not hold (start it with --base-model DIR)");
}

TEST(HeldBase, APatchOnTheBaseStartsFromItsWeightsAndAZeroAdapter) {
  const models::HfBase base = BaseOf(Tiny(), 0.5f);
  Manifest global = base.manifest;
  global.Append("adapter", {4, 8});
  auto model = ModelOnBase(base, global);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  ASSERT_EQ(model->size(), global.total_elements);
  EXPECT_TRUE(std::all_of(model->begin(), model->begin() + base.weights.size(), [](float v) { return v == 0.5f; }));
  EXPECT_TRUE(std::all_of(model->begin() + base.weights.size(), model->end(), [](float v) { return v == 0; }));
  models::LlamaConfig wider = Tiny();
  wider.intermediate_size = 128;
  const Manifest other = models::LayoutOf(wider).manifest;
  auto refused = ModelOnBase(base, other);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().message(),
            "the model's manifest does not begin with base model /copies/tiny's tensor model.layers.0.mlp.gate_proj.weight");
}

// Full training on a held base: five fp32 copies of the weights, AdamW's
// two moments (or SGD's momentum), and the activations of one batch; a site
// whose memory is short refuses the round in one line with the arithmetic.
TEST(HeldBase, FullTrainingThatDoesNotFitIsRefusedInOneLineWithItsArithmetic) {
  const models::HfBase base = BaseOf(Tiny(), 0.5f);
  v1::TaskConfig task = TaskOn(base);
  task.set_update_kind(v1::UPDATE_FULL);
  task.set_optimizer("adamw");
  task.set_batch_size(4);
  task.set_seq_len(16);
  const double parameters = double(base.manifest.total_elements);
  const FullTrainingMemory m = FullTrainingMemoryOf(base.config, task);
  EXPECT_EQ(m.parameters, parameters);
  EXPECT_EQ(m.copies, 7);
  models::LlamaConfig at16 = base.config;
  at16.max_seq_len = 16;
  EXPECT_EQ(m.activations, at16.ActivationsPerSequence() * 4 * 4);
  EXPECT_GT(m.activations, 0);
  const double need = parameters * 4 * 7 + m.activations;
  ASSERT_EQ(m.bytes(), need);
  // The arena a Llama maps for those steps is of that order (the formula leaves out backward's scratch).
  auto llama = models::Llama::Create(at16, 4);
  ASSERT_TRUE(llama.ok());
  EXPECT_GT(m.activations, 0.5 * double(llama->activation_arena().size_bytes()));

  EXPECT_EQ(RefusalOfMemory(base.config, task, 2, "site-a", uint64_t(need)), "");
  EXPECT_EQ(RefusalOfMemory(base.config, task, 2, "site-a", uint64_t(need) - 1),
            fmt::format("site-a: refused round 2: training {} in full needs {} parameters x 4 bytes x 7 (the held "
                        "base, the global model, weights, gradients, the update, AdamW's two moments) + {:.0f} bytes "
                        "of activations for 4 x 16 tokens = {:.0f} bytes ({:.2f} GiB), more than the {} bytes ({:.2f} "
                        "GiB) of its limit",
                        task.model(), base.manifest.total_elements, m.activations, need, need / (1 << 30),
                        uint64_t(need) - 1, (need - 1) / (1 << 30)));
  // Plain SGD keeps no state; momentum one copy.
  task.set_optimizer("sgd");
  EXPECT_EQ(FullTrainingMemoryOf(base.config, task).copies, 5);
  task.set_momentum(0.9);
  EXPECT_EQ(FullTrainingMemoryOf(base.config, task).copies, 6);
  EXPECT_EQ(RefusalOfMemory(base.config, task, 2, "site-a", uint64_t(need) - 1), "") << "SGD fits where AdamW did not";
  // A LoRA round, or a task on no base, is not this check's.
  task.set_update_kind(v1::UPDATE_LORA);
  EXPECT_EQ(RefusalOfMemory(base.config, task, 2, "site-a", 1), "");
  // This tiny base fits this machine, so RefusalOfBase lets the full round train.
  task.set_update_kind(v1::UPDATE_FULL);
  EXPECT_EQ(RefusalOfBase(&base, task, 2, "site-a"), "");
}

}  // namespace
}  // namespace estuary::client
