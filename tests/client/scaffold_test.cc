// SCAFFOLD's site half (client/scaffold.h) with the server's
// (aggregation/scaffold.h): one round on two sites of McMahan's 2NN against
// torch_scaffold.py, the paper's Algorithm 1 (option II) in torch; and the
// site's control variate file.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <vector>

#include "aggregation/federation.h"
#include "aggregation/scaffold.h"
#include "aggregation/strategy.h"
#include "client/scaffold.h"
#include "client/site.h"
#include "models/model.h"
#include "tests/e2e/harness.h"

namespace estuary::client {
namespace {

namespace fs = std::filesystem;

std::vector<float> Normal(size_t n, float stddev, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

void Append(std::ofstream& out, std::span<const float> values) {
  out.write(reinterpret_cast<const char*>(values.data()), std::streamsize(values.size() * sizeof(float)));
}

std::vector<float> ReadFloats(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
  std::vector<float> v(bytes.size() / sizeof(float));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(float));
  return v;
}

double MaxDifference(std::span<const float> a, std::span<const float> b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) worst = std::max(worst, std::abs(double(a[i]) - b[i]));
  return worst;
}

TEST(Scaffold, OneRoundOnTwoSitesIsThePapersInTorch) {
  testing::TempDir dir;
  auto model = models::MakeModel("mlp");
  ASSERT_TRUE(model.ok());
  const Manifest manifest = (*model)->manifest();
  const size_t p = manifest.total_elements;

  // Two sites of 12 and 7 examples; a batch of 12 is each site's whole set,
  // so every local step is full-batch and K = epochs = 3.
  const std::vector<uint64_t> counts = {12, 7};
  auto data = std::make_shared<models::Dataset>();
  data->feature_size = 784;
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> pixel(0.0f, 1.0f);
  for (uint64_t i = 0; i < 19; ++i) {
    for (int j = 0; j < 784; ++j) data->features.push_back(pixel(rng));
    data->labels.push_back(int32_t(rng() % 10));
  }
  v1::TaskConfig task = aggregation::DefaultFederation().task();
  task.set_model("mlp");
  task.set_epochs(3);
  task.set_batch_size(12);
  task.set_learning_rate(0.1f);
  task.set_seed(5);

  const std::vector<float> x0 = Normal(p, 0.05f, 1);
  const std::vector<float> c0 = Normal(p, 0.01f, 2);
  const std::vector<float> c_a = Normal(p, 0.01f, 3);
  // Site a keeps c_i in a file (as a client's state directory does), site b in memory, from zero.
  {
    std::ofstream out(dir / "site-a.control", std::ios::binary);
    Append(out, c_a);
  }
  auto control_a = SiteControl::Open(dir / "site-a.control");
  ASSERT_TRUE(control_a.ok()) << control_a.status().ToString();
  std::vector<SiteControl> controls;
  controls.push_back(std::move(control_a).value());
  controls.emplace_back();

  auto strategy = aggregation::MakeStrategy({.name = "scaffold", .server_lr = 1.0, .total_sites = 5});
  ASSERT_TRUE(strategy.ok()) << strategy.status().ToString();
  auto& scaffold = dynamic_cast<aggregation::Scaffold&>(**strategy);
  ASSERT_TRUE(scaffold.LoadState({{"c", c0}}).ok());
  ASSERT_TRUE(scaffold.Begin(1, x0).ok());
  uint64_t first = 0;
  for (size_t s = 0; s < counts.size(); ++s) {
    std::vector<uint32_t> indices(counts[s]);
    for (uint64_t i = 0; i < counts[s]; ++i) indices[i] = uint32_t(first + i);
    first += counts[s];
    auto site = MakeLocalSite({.images = data, .indices = indices}, {});
    ASSERT_TRUE(site.ok()) << site.status().ToString();
    auto update = controls[s].Train(**site, x0, manifest, task, 1, fmt::format("site-{}", s), c0);
    ASSERT_TRUE(update.ok()) << update.status().ToString();
    EXPECT_EQ(update->local_steps, 3u);
    ASSERT_TRUE(scaffold.FoldControl(fmt::format("site-{}", s), update->payload, update->control_delta,
                                     double(update->num_examples))
                    .ok());
  }
  std::vector<float> x1(p);
  ASSERT_TRUE(scaffold.Finish(x1).ok());
  auto c1 = scaffold.Control(p);
  ASSERT_TRUE(c1.ok());

  {
    std::ofstream out(dir / "inputs", std::ios::binary);
    Append(out, x0);
    Append(out, c0);
    first = 0;
    for (size_t s = 0; s < counts.size(); ++s) {
      Append(out, s == 0 ? std::span<const float>(c_a) : std::span<const float>(std::vector<float>(p, 0.0f)));
      Append(out, std::span<const float>(data->features).subspan(first * 784, counts[s] * 784));
      std::vector<float> labels;
      for (uint64_t i = first; i < first + counts[s]; ++i) labels.push_back(float(data->labels[i]));
      Append(out, labels);
      first += counts[s];
    }
    std::ofstream(dir / "shape") << fmt::format("{} 5 3 0.1 12 7\n", p);
  }
  const testing::CommandResult oracle = testing::RunCommand(
      fmt::format("{} {}/tests/client/torch_scaffold.py {}", ESTUARY_TORCH_PYTHON, ESTUARY_SOURCE_DIR, dir.path().string()));
  ASSERT_EQ(oracle.exit_code, 0) << oracle.output;

  const std::vector<float> torch_x1 = ReadFloats(dir / "x_next"), torch_c1 = ReadFloats(dir / "c_next");
  std::printf("against torch: x %.3g, c %.3g (x moved %.3g, c %.3g)\n", MaxDifference(x1, torch_x1),
              MaxDifference(*c1, torch_c1), MaxDifference(x1, x0), MaxDifference(*c1, c0));
  EXPECT_LT(MaxDifference(x1, torch_x1), 1e-5);
  EXPECT_LT(MaxDifference(*c1, torch_c1), 1e-5);
  // The site's c_i⁺: site a's as its file now holds it (reopened), site b's in memory.
  auto reopened = SiteControl::Open(dir / "site-a.control");
  ASSERT_TRUE(reopened.ok());
  EXPECT_LT(MaxDifference(reopened->value(), ReadFloats(dir / "site_0")), 1e-5);
  EXPECT_LT(MaxDifference(controls[1].value(), ReadFloats(dir / "site_1")), 1e-5);
  // The correction moved the model: by lr·K·|c - c_i| ~ 4e-3 per parameter
  // at site a, far beyond the tolerance, so ignoring it would fail above.
  EXPECT_GT(MaxDifference(c0, c_a), 0.03);
  EXPECT_GT(MaxDifference(*c1, c0), 1e-3);
}

TEST(SiteControl, RefusesAFileThatIsNoControlVariateInOneLine) {
  testing::TempDir dir;
  std::ofstream(dir / "bad.control", std::ios::binary) << "1234567";
  auto bad = SiteControl::Open(dir / "bad.control");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("bad.control"), std::string::npos) << bad.status().message();
  EXPECT_EQ(bad.status().message().find('\n'), std::string::npos);
  auto missing = SiteControl::Open(dir / "none.control");  // a site's first round: zero
  ASSERT_TRUE(missing.ok());
  EXPECT_TRUE(missing->value().empty());
}

}  // namespace
}  // namespace estuary::client
