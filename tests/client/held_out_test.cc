// A built-in site's held-out split and its evaluation (client/held_out.h):
// the split is seeded and disjoint from what trains; the score is the one a
// cross-entropy computed here, from the model's logits, gives.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "client/held_out.h"
#include "models/federated_model.h"
#include "models/language_model.h"

namespace estuary::client {
namespace {

std::shared_ptr<const models::Dataset> Images(int n, uint32_t seed) {
  auto data = std::make_shared<models::Dataset>();
  data->feature_size = 784;
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> pixel(0, 1);
  data->features.resize(size_t(n) * 784);
  for (auto& v : data->features) v = pixel(gen);
  for (int i = 0; i < n; ++i) data->labels.push_back(int32_t(gen() % 10));
  return data;
}

// Which rows of `all` a held-out set holds (the rows are random: each is unique).
std::set<uint32_t> RowsOf(const models::Dataset& held, const models::Dataset& all) {
  std::set<uint32_t> rows;
  for (uint64_t i = 0; i < held.size(); ++i) {
    for (uint32_t j = 0; j < all.size(); ++j) {
      if (std::equal(held.row(i), held.row(i) + 784, all.row(j))) {
        EXPECT_EQ(held.labels[i], all.labels[j]);
        rows.insert(j);
      }
    }
  }
  return rows;
}

TEST(HeldOut, ImagesAreASeededSubsetDisjointFromTraining) {
  const auto images = Images(200, 3);
  std::vector<uint32_t> part;
  for (uint32_t i = 0; i < 200; i += 2) part.push_back(i);  // a site holding the even rows
  SiteData data{.images = images, .indices = part};
  auto held = SplitHeldOut(&data, 0.25, 42);
  ASSERT_TRUE(held.ok()) << held.status().ToString();
  ASSERT_TRUE(held->images);
  EXPECT_EQ(held->examples(), 25u);
  EXPECT_EQ(data.indices.size(), 75u);
  const std::set<uint32_t> held_rows = RowsOf(*held->images, *images);
  EXPECT_EQ(held_rows.size(), 25u);
  std::set<uint32_t> all(part.begin(), part.end()), seen = held_rows;
  for (uint32_t i : data.indices) {
    EXPECT_EQ(held_rows.count(i), 0u) << "row " << i << " both trains and is held out";
    seen.insert(i);
  }
  EXPECT_EQ(seen, all);
  EXPECT_TRUE(std::is_sorted(data.indices.begin(), data.indices.end()));

  SiteData again{.images = images, .indices = part}, other{.images = images, .indices = part};
  auto same = SplitHeldOut(&again, 0.25, 42), different = SplitHeldOut(&other, 0.25, 43);
  ASSERT_TRUE(same.ok() && different.ok());
  EXPECT_EQ(again.indices, data.indices);
  EXPECT_NE(other.indices, data.indices);
}

TEST(HeldOut, TextIsOneBlockAndTheRestTrains) {
  auto tokens = std::make_shared<std::vector<int32_t>>();
  for (int i = 0; i < 1000; ++i) tokens->push_back(i);
  SiteData data{.text = tokens};
  auto held = SplitHeldOut(&data, 0.1, 7);
  ASSERT_TRUE(held.ok() && held->text);
  ASSERT_EQ(held->text->size(), 100u);
  for (size_t i = 1; i < held->text->size(); ++i) EXPECT_EQ((*held->text)[i], (*held->text)[0] + int32_t(i));
  EXPECT_EQ(data.text->size(), 900u);
  std::vector<int32_t> joined = *data.text;
  joined.insert(joined.end(), held->text->begin(), held->text->end());
  std::sort(joined.begin(), joined.end());
  EXPECT_EQ(joined, *tokens);
}

TEST(HeldOut, BadFractionsAreOneLineAndNothingIsTaken) {
  SiteData data{.images = Images(10, 1)};
  for (double bad : {-0.1, 1.0, std::nan("")}) {
    auto held = SplitHeldOut(&data, bad, 1);
    ASSERT_FALSE(held.ok());
    EXPECT_NE(held.status().message().find("--eval-split"), std::string::npos) << held.status().message();
  }
  EXPECT_TRUE(data.indices.empty());
  auto none = SplitHeldOut(&data, 0, 1);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->examples(), 0u);
}

// A trainer that only counts: Evaluate must not train.
class CountingTrainer : public Trainer {
 public:
  uint64_t num_examples() const override { return 1; }
  Result<Update> Train(std::span<const float>, const Manifest&, const v1::TaskConfig&, uint64_t,
                       std::string_view) override {
    ++trained;
    return FailedPrecondition("not here");
  }
  int trained = 0;
};

TEST(HeldOut, TheSiteScoresTheGlobalModelAsCrossEntropyOverItsLogits) {
  const auto images = Images(60, 9);
  SiteData data{.images = images};
  auto held = SplitHeldOut(&data, 0.5, 5);
  ASSERT_TRUE(held.ok());
  auto initial = models::InitialModel("mlp", 17);
  ASSERT_TRUE(initial.ok());
  CountingTrainer inner;
  EvaluatingTrainer site(inner, *held);
  v1::TaskConfig task;
  task.set_model("mlp");
  auto e = site.Evaluate(initial->values, initial->manifest, task, 3, "site-a");
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_EQ(inner.trained, 0);
  ASSERT_TRUE(e->supported);
  EXPECT_EQ(e->examples, 30u);

  // The oracle: softmax cross-entropy and argmax, in double, from the logits.
  auto model = models::MakeModel("mlp");
  ASSERT_TRUE(model.ok());
  std::copy(initial->values.begin(), initial->values.end(), (*model)->parameters().begin());
  const models::Dataset& rows = *held->images;
  std::vector<float> logits(rows.size() * 10);
  (*model)->Forward(rows.features.data(), int(rows.size()), logits.data());
  double loss = 0, correct = 0;
  for (uint64_t i = 0; i < rows.size(); ++i) {
    const float* l = &logits[i * 10];
    const double top = *std::max_element(l, l + 10);
    double sum = 0;
    for (int c = 0; c < 10; ++c) sum += std::exp(double(l[c]) - top);
    loss += std::log(sum) + top - l[rows.labels[i]];
    correct += (std::max_element(l, l + 10) - l) == rows.labels[i];
  }
  EXPECT_NEAR(e->loss, loss / double(rows.size()), 1e-5);
  ASSERT_TRUE(e->accuracy.has_value());
  EXPECT_DOUBLE_EQ(*e->accuracy, correct / double(rows.size()));

  // What it cannot score by itself, or without held-out examples: not supported.
  v1::TaskConfig lora = task;
  lora.set_update_kind(v1::UPDATE_LORA);
  auto refused = site.Evaluate(initial->values, initial->manifest, lora, 3, "site-a");
  ASSERT_TRUE(refused.ok());
  EXPECT_FALSE(refused->supported);
  EvaluatingTrainer empty(inner, HeldOutData{});
  auto none = empty.Evaluate(initial->values, initial->manifest, task, 3, "site-a");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->supported);
  // A global model of the wrong size fails, in one line.
  std::vector<float> short_model(initial->values.begin(), initial->values.end() - 1);
  auto failed = site.Evaluate(short_model, initial->manifest, task, 3, "site-a");
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find("parameters"), std::string::npos);
}

}  // namespace
}  // namespace estuary::client
