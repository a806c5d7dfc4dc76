// Distributed DP under SecAgg+ in the simulator (estuary-sim --dp distributed
// --secagg): the server's unmasked sum is the plain sum of the same noised,
// quantised inputs bit for bit, with the noise's variance the plan's; the
// plan's scale and shares keep the sum in the ring and the noise at its
// target; on MNIST every round's ε is the accountant's for the inputs summed,
// the budget stops the run, and bad combinations are refused in one line.
// Poisson sampling (--sample-rate): its draws' statistics, and the
// accountant's q and the fixed denominator under it, distributed and central.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>
#include <set>

#include "aggregation/dp_noise.h"
#include "privacy/accountant.h"
#include "secagg/discrete_gaussian.h"
#include "secagg/quantize.h"
#include "simulations/report.h"
#include "simulations/poisson_sampling.h"
#include "simulations/runner.h"
#include "simulations/secagg_round.h"
#include "tests/e2e/harness.h"

namespace estuary::simulations {
namespace {

namespace fs = std::filesystem;

fs::path MnistDir() {
  if (const char* given = std::getenv("ESTUARY_MNIST")) return given;
  return fs::path(ESTUARY_SOURCE_DIR) / "data" / "mnist";
}

#define REQUIRE_MNIST()                                                                                      \
  if (!fs::exists(MnistDir() / "train-images-idx3-ubyte")) {                                                 \
    FAIL() << "no MNIST at " << MnistDir() << " (scripts/fetch-mnist data/mnist; or set ESTUARY_MNIST)"; \
  }

// n sites' updates of dimension d, normally distributed with norms around 1.
std::vector<std::vector<float>> Updates(uint32_t n, size_t d, uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::normal_distribution<float> normal(0, 1.0f / std::sqrt(float(d)));
  std::vector<std::vector<float>> updates(n, std::vector<float>(d));
  for (auto& update : updates) {
    for (float& x : update) x = normal(generator);
  }
  return updates;
}

SecAggOptions DpOptions(double z, double survivors, double dropout) {
  SecAggOptions options;
  options.dropout = dropout;
  options.dp = {.noise_multiplier = z, .clip = 0.8, .survivors = survivors, .denominator = 10};
  return options;
}

TEST(DistributedDp, UnmaskedSumIsThePlainSumOfTheNoisedInputsBitForBit) {
  const uint32_t n = 10;
  const size_t d = 20000;
  const auto updates = Updates(n, d, 1);
  std::vector<SecAggSiteInput> inputs;
  for (const auto& update : updates) inputs.push_back({update, 100});
  const uint64_t seed = 9, round = 4;
  // A third of the sites drop at random stages; the noise is calibrated for half.
  const SecAggOptions options = DpOptions(1.0, 0.5, 0.3);
  auto result = RunSecAggRound(options, inputs, seed, round);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  ASSERT_LT(result->included.size(), n) << "no input was lost: the dropped sites' masks were never cancelled";
  ASSERT_GE(result->included.size(), 5u);
  const DistributedDpPlan& plan = result->dp;

  // The same sites' inputs, quantised and noised in the clear, summed mod 2^32.
  const secagg::QuantizationConfig quantization{.bits = 32, .clip_norm = 0.8, .scale = plan.scale};
  std::vector<uint32_t> noised(d, 0), plain(d, 0);
  for (size_t u : result->included) {
    auto q = secagg::Quantize(updates[u], 1.0, quantization, SiteRoundingKey(seed, round, uint32_t(u)));
    ASSERT_TRUE(q.ok());
    for (size_t i = 0; i < d; ++i) plain[i] += (*q)[i];
    ASSERT_TRUE(secagg::AddDiscreteGaussian(*q, plan.site_variance, 32, SiteNoiseKey(seed, round, uint32_t(u))).ok());
    for (size_t i = 0; i < d; ++i) noised[i] += (*q)[i];
  }
  EXPECT_EQ(result->sum, noised);
  EXPECT_NE(result->sum, plain) << "the server's sum carries no noise";

  // The noise in the sum: |U3| shares of variance V each, per element.
  double squares = 0;
  for (size_t i = 0; i < d; ++i) {
    const double noise = double(int32_t(noised[i] - plain[i]));
    squares += noise * noise;
  }
  const double variance = double(result->included.size()) * double(plan.site_variance);
  EXPECT_NEAR(squares / d, variance, 5 * variance * std::sqrt(2.0 / d));
  // And it is at least the target (z·Δ)², because |U3| >= m.
  EXPECT_GE(variance, plan.sensitivity * plan.sensitivity);

  // The mean is the signed sum over s · the fixed denominator.
  EXPECT_NEAR(result->mean[7], double(int32_t(noised[7])) / (plan.scale * 10), 1e-6 * std::abs(result->mean[7]) + 1e-9);
}

TEST(DistributedDp, PlanFillsTheRingAndReachesTheTargetNoise) {
  for (uint32_t n : {2u, 10u, 100u}) {
    for (double z : {0.5, 1.0, 4.0}) {
      for (double survivors : {1.0, 0.7}) {
        const uint64_t d = 199210;
        const DistributedDpOptions dp{.noise_multiplier = z, .clip = 1, .survivors = survivors, .denominator = 1};
        auto plan = PlanDistributedDp(dp, 32, n, d);
        ASSERT_TRUE(plan.ok()) << plan.status().ToString();
        const uint32_t m = uint32_t(std::ceil(survivors * n - 1e-9));
        EXPECT_EQ(plan->min_included, m);
        EXPECT_EQ(plan->sensitivity, plan->scale + std::sqrt(double(d)) + 1);
        // m shares make at least the target variance, and not one unit more than needed.
        const double target = z * z * plan->sensitivity * plan->sensitivity;
        EXPECT_GE(double(plan->site_variance) * m, target);
        EXPECT_LT(double(plan->site_variance - 1) * m, target);
        // n sites at the clip plus ten standard deviations of n shares fit in 31 bits...
        const double limit = std::ldexp(1.0, 31) - 1;
        EXPECT_LE(n * (plan->scale + 1) + 10 * std::sqrt(n * double(plan->site_variance)), limit);
        EXPECT_LE(plan->site_variance, secagg::kMaxDiscreteGaussianVariance);
        // ... and a scale 1 % finer would not (or would pass the sampler's limit).
        const double finer = plan->scale * 1.01, finer_delta = finer + std::sqrt(double(d)) + 1;
        const double finer_variance = std::ceil(z * z * finer_delta * finer_delta / m);
        EXPECT_TRUE(n * (finer + 1) + 10 * std::sqrt(n * finer_variance) > limit ||
                    finer_variance > double(secagg::kMaxDiscreteGaussianVariance))
            << "n " << n << " z " << z << " survivors " << survivors << ": scale " << plan->scale;
      }
    }
  }
  // Too narrow a ring: one line.
  const DistributedDpOptions dp{.noise_multiplier = 1, .clip = 1, .survivors = 1, .denominator = 1};
  EXPECT_EQ(PlanDistributedDp(dp, 12, 10, 199210).status().message(),
            "sim: --dp distributed: --secagg-bits 12 leaves no room for 10 sites at --dp-clip 1 and "
            "--dp-noise-multiplier 1 (scale -124 < 1)");
}

TEST(DistributedDp, FewerInputsThanTheNoiseNeedsAreNotUnmasked) {
  const auto updates = Updates(10, 1000, 2);
  std::vector<SecAggSiteInput> inputs;
  for (const auto& update : updates) inputs.push_back({update, 100});
  // Sites drop with probability 0.3 but every one must arrive: some round fails.
  bool refused = false;
  for (uint64_t round = 1; round <= 10 && !refused; ++round) {
    auto result = RunSecAggRound(DpOptions(1.0, 1.0, 0.3), inputs, 3, round);
    if (result.ok()) {
      EXPECT_EQ(result->included.size(), 10u);
      continue;
    }
    refused = true;
    EXPECT_NE(result.status().message().find("the 10 the noise is calibrated for (--dp-survivors 1): refusing to "
                                             "unmask"),
              std::string::npos)
        << result.status().message();
  }
  EXPECT_TRUE(refused);
}

// 20 sites, 10 a round, one local epoch: ε per round and the budget stop.
Scenario Mnist(uint64_t rounds) {
  Scenario s;
  s.clients = 20;
  s.per_round = 10;
  s.rounds = rounds;
  s.data_dir = MnistDir();
  s.task().set_seed(5);
  s.task().set_epochs(1);
  s.secagg = true;
  s.dp = "distributed";
  s.federation.mutable_limits()->set_max_norm_over_median(0);
  s.federation.mutable_dp()->set_noise_multiplier(1.0);
  s.federation.mutable_dp()->set_clip(1.0);
  s.federation.mutable_dp()->set_delta(1e-5);
  return s;
}

TEST(DistributedDp, EpsilonPerRoundIsTheAccountantsAndTheBudgetStops) {
  REQUIRE_MNIST();
  Scenario s = Mnist(3);
  s.dropout = 0.15;
  s.secagg_options.dp.survivors = 0.6;
  auto report = RunInproc(s, nullptr);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ASSERT_EQ(report->rounds.size(), 3u);
  // The accountant, rebuilt from what each round summed: q = 10/20, the plan of 10 sites.
  const uint64_t d = 199210;
  const DistributedDpPlan plan = *PlanDistributedDp(
      {.noise_multiplier = 1, .clip = 1, .survivors = 0.6, .denominator = 10}, 32, 10, d);
  auto accountant = *privacy::Accountant::Create(1e-5);
  std::vector<double> epsilons;
  bool lost = false;
  for (const RoundReport& row : report->rounds) {
    lost |= row.updates_received < 10;
    ASSERT_TRUE(row.epsilon.has_value());
    ASSERT_TRUE(accountant.AddRoundRdp(*DistributedDpRoundRdp(plan, row.updates_received, 0.5, accountant.orders()))
                    .ok());
    EXPECT_DOUBLE_EQ(*row.epsilon, accountant.Spent().epsilon) << "round " << row.round;
    EXPECT_EQ(row.dp_clip, 1.0);
    epsilons.push_back(*row.epsilon);
  }
  EXPECT_TRUE(lost) << "no round lost an input: the per-round charge is not exercised";
  EXPECT_LT(epsilons[0], epsilons[1]);
  EXPECT_LT(epsilons[1], epsilons[2]);
  ASSERT_TRUE(report->epsilon.has_value());
  EXPECT_EQ(*report->epsilon, epsilons.back());
  // Above central DP's ε at the noise the first round's sum actually held
  // (more than z: its shares were calibrated for 6 inputs): the subsampling
  // bound is looser than the sampled Gaussian's exact series.
  const double z_first = std::sqrt(report->rounds[0].updates_received * double(plan.site_variance)) / plan.sensitivity;
  EXPECT_GT(z_first, 1.0);
  EXPECT_GT(epsilons[0], privacy::EpsilonAfterRounds(0.5, z_first, 1, 1e-5)->epsilon);

  // The budget stop previews a round as if only the fewest inputs the server
  // may unmask (6) were summed. Without dropouts every round sums 10, so the
  // preview before round r is (r − 1) rounds of 10 and one of 6: a budget
  // between the previews of rounds 2 and 3 runs two rounds.
  auto spent = *privacy::Accountant::Create(1e-5);
  const auto at_full = *DistributedDpRoundRdp(plan, 10, 0.5, spent.orders());
  const auto at_minimum = *DistributedDpRoundRdp(plan, 6, 0.5, spent.orders());
  ASSERT_TRUE(spent.AddRoundRdp(at_full).ok());
  const double before_two = spent.EpsilonAfterRdp(at_minimum)->epsilon;
  ASSERT_TRUE(spent.AddRoundRdp(at_full).ok());
  const double before_three = spent.EpsilonAfterRdp(at_minimum)->epsilon;
  ASSERT_LT(before_two, before_three);
  Scenario budget = Mnist(5);
  budget.secagg_options.dp.survivors = 0.6;
  budget.federation.mutable_dp()->set_max_epsilon((before_two + before_three) / 2);
  auto stopped = RunInproc(budget, nullptr);
  ASSERT_TRUE(stopped.ok()) << stopped.status().ToString();
  EXPECT_EQ(stopped->rounds.size(), 2u);
  EXPECT_DOUBLE_EQ(*stopped->epsilon, spent.Spent().epsilon);
}

TEST(DistributedDp, CombinationsThatCannotWorkAreRefused) {
  auto line = [](Scenario s) { return RunInproc(s, nullptr).status().message(); };
  Scenario s = Mnist(1);
  s.secagg = false;
  EXPECT_EQ(line(s), "sim: --dp distributed adds each site's noise inside secure aggregation: it needs --secagg");
  s = Mnist(1);
  s.federation.mutable_dp()->set_noise_multiplier(0);
  EXPECT_EQ(line(s), "sim: --dp distributed needs --dp-noise-multiplier Z > 0");
  s = Mnist(1);
  s.federation.mutable_dp()->set_adaptive_clip(true);
  EXPECT_EQ(line(s).substr(0, 50), "sim: --dp distributed with --dp-adaptive-clip: the");
  s = Mnist(1);
  s.secagg_options.dp.survivors = 1.5;
  EXPECT_EQ(line(s), "sim: --dp-survivors 1.5: must be in (0, 1]");
  s = Mnist(1);
  s.dp = "local";
  EXPECT_EQ(line(s), "sim: --dp 'local': expected central or distributed");
  s = Mnist(1);
  s.dp = "central";
  EXPECT_EQ(line(s).substr(0, 48), "sim: --secagg with --dp central: DP-FedAvg clips");
  s.secagg = false;
  s.secagg_options.dp.survivors = 0.5;
  EXPECT_EQ(line(s), "sim: --dp-survivors calibrates the sites' noise shares: it needs --dp distributed");
}

TEST(DistributedDp, SecAggClipWithDistributedDpIsRefusedByTheBinary) {
  testing::TempDir dir;
  const auto result = testing::RunCommand(fmt::format(
      "{} --quiet --data {} --clients 20 --per-round 10 --rounds 1 --secagg --dp distributed "
      "--dp-noise-multiplier 1 --secagg-clip 5 --report {}",
      testing::BinaryPath("estuary-sim").string(), MnistDir().string(), (dir / "r.json").string()));
  EXPECT_NE(result.exit_code, 0);
  EXPECT_NE(result.output.find("sim: --dp distributed clips each update to --dp-clip; --secagg-clip is for --secagg "
                               "without DP"),
            std::string::npos)
      << result.output;
}

TEST(PoissonSampling, SampleRateWithPerRoundIsRefusedByTheBinary) {
  testing::TempDir dir;
  const auto result = testing::RunCommand(fmt::format(
      "{} --quiet --data {} --clients 20 --per-round 10 --sample-rate 0.5 --rounds 1 --report {}",
      testing::BinaryPath("estuary-sim").string(), MnistDir().string(), (dir / "r.json").string()));
  EXPECT_NE(result.exit_code, 0);
  EXPECT_NE(result.output.find("sim: --sample-rate and --per-round both choose a round's clients: give one"),
            std::string::npos)
      << result.output;
}

TEST(PoissonSampling, EachSiteJoinsWithProbabilityQIndependently) {
  std::vector<std::string> names;
  for (int i = 0; i < 200; ++i) names.push_back(fmt::format("site-{:03}", i));
  const double q = 0.1;
  const int rounds = 500;
  std::map<std::string, int> joined;
  double sizes = 0, size_squares = 0;
  for (int round = 1; round <= rounds; ++round) {
    const auto sample = PoissonSample(names, q, 7, round);
    ASSERT_TRUE(std::is_sorted(sample.begin(), sample.end()));
    for (const auto& name : sample) ++joined[name];
    sizes += double(sample.size());
    size_squares += double(sample.size()) * double(sample.size());
  }
  // Each site: Binomial(500, 0.1), mean 50, standard deviation 6.7; 6σ over 200 sites.
  for (const auto& name : names) EXPECT_NEAR(joined[name], rounds * q, 6 * std::sqrt(rounds * q * (1 - q))) << name;
  // A round's size: Binomial(200, 0.1), mean 20, variance 18 (fixed-size sampling has variance 0).
  const double mean = sizes / rounds, variance = size_squares / rounds - mean * mean;
  EXPECT_NEAR(mean, 200 * q, 5 * std::sqrt(200 * q * (1 - q) / rounds));
  EXPECT_NEAR(variance, 200 * q * (1 - q), 0.25 * 200 * q * (1 - q));
  // A site's draw is its own: the same from a subset of the names, and per seed and round.
  const std::vector<std::string> some(names.begin(), names.begin() + 50);
  std::vector<std::string> from_all;
  for (const auto& name : PoissonSample(names, q, 7, 3)) {
    if (name < names[50]) from_all.push_back(name);
  }
  EXPECT_EQ(PoissonSample(some, q, 7, 3), from_all);
  EXPECT_EQ(PoissonSample(names, q, 7, 3), PoissonSample(names, q, 7, 3));
  EXPECT_NE(PoissonSample(names, q, 7, 3), PoissonSample(names, q, 7, 4));
  EXPECT_NE(PoissonSample(names, q, 7, 3), PoissonSample(names, q, 8, 3));
  EXPECT_EQ(PoissonSample(names, 1, 7, 3), names);
  EXPECT_TRUE(PoissonSample(names, 0, 7, 3).empty());
  // Room planned: q·N + 6σ + 1, at most N.
  EXPECT_EQ(PoissonPlannedMaximum(1000, 0.1), 158u);
  EXPECT_EQ(PoissonPlannedMaximum(20, 0.5), 20u);
}

TEST(PoissonSampling, DistributedDpAccountsWithQAndTheExpectedDenominator) {
  REQUIRE_MNIST();
  Scenario s = Mnist(4);
  s.sample_rate = 0.5;
  s.secagg_options.dp.survivors = 0.6;
  auto report = RunInproc(s, nullptr);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ASSERT_EQ(report->rounds.size(), 4u);
  // The plan is the run's: 6 of the 10 expected, room for all 20.
  const DistributedDpPlan plan = *PlanDistributedDp({.noise_multiplier = 1, .clip = 1, .survivors = 0.6,
                                                     .denominator = 10, .expected_sites = 10, .max_sites = 20},
                                                    32, 1, 199210);
  EXPECT_EQ(plan.min_included, 6u);
  auto accountant = *privacy::Accountant::Create(1e-5);
  std::set<uint32_t> sizes;
  for (const RoundReport& row : report->rounds) {
    sizes.insert(row.clients_selected);
    ASSERT_TRUE(accountant.AddRoundRdp(*DistributedDpRoundRdp(plan, row.updates_received, 0.5, accountant.orders()))
                    .ok());
    EXPECT_DOUBLE_EQ(*row.epsilon, accountant.Spent().epsilon) << "round " << row.round;
  }
  EXPECT_GT(sizes.size(), 1u) << "every round drew the same number of sites";
  EXPECT_EQ(report->scenario["sample_rate"], 0.5);

  auto line = [](Scenario s) { return RunInproc(s, nullptr).status().message(); };
  Scenario bad = Mnist(1);
  bad.sample_rate = 1.5;
  EXPECT_EQ(line(bad), "sim: --sample-rate 1.5: must be in (0, 1]");
  // Loopback starts its own server with --sample-rate; one it attaches to samples as it was started.
  bad = Mnist(1);
  bad.sample_rate = 0.5;
  bad.mode = "loopback";
  bad.server = "127.0.0.1:7443";
  EXPECT_EQ(RunLoopback(bad, nullptr).status().message(),
            "sim: --sample-rate with --server: the simulator configures only the server it starts; one it attaches "
            "to samples as it was started (serve --sample-rate Q --total-sites N)");
  // A draw too small for secure aggregation ends the run with one line.
  bad = Mnist(20);
  bad.federation.clear_dp();
  bad.dp = "central";
  bad.sample_rate = 0.15;
  EXPECT_NE(line(bad).find("sites; a round needs 2 (choose q · sites well above it)"), std::string::npos) << line(bad);
}

// Central DP (DP-FedAvg) under Poisson sampling, one round recomputed from
// the seed. The sites train at a learning rate of 1e-30, so each update is
// about 1e-30 · its gradient: in the double sum it is below the noise's last
// bit, and in the float model below the weights' (the run without DP ends
// where it began). The round then releases exactly
// init + float(z·C·N(0, 1) / (q·N)), the normals being the seeded stream of
// the run's seed and round 1: recomputed here, it must match bit for bit,
// and dividing by the number drawn (k ≠ q·N for this seed) would not.
TEST(PoissonSampling, CentralDpDividesByTheExpectedCountAndAccountsWithQ) {
  REQUIRE_MNIST();
  Scenario s = Mnist(1);
  s.secagg = false;
  s.dp = "central";
  s.sample_rate = 0.5;  // of 20 sites: q·N = 10
  s.task().set_learning_rate(1e-30f);
  Scenario plain = s;
  plain.federation.clear_dp();
  std::vector<float> init, released;
  auto before = RunInproc(plain, nullptr, &init);
  ASSERT_TRUE(before.ok()) << before.status().ToString();
  auto report = RunInproc(s, nullptr, &released);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ASSERT_EQ(report->rounds.size(), 1u);
  ASSERT_EQ(released.size(), init.size());
  const uint32_t k = report->rounds[0].clients_selected;
  EXPECT_EQ(k, before->rounds[0].clients_selected) << "the same seed draws the same sites";
  ASSERT_NE(k, 10u) << "this seed's draw equals q·N: choose one where the two denominators differ";

  auto noise = aggregation::GaussianStream::Seeded(s.task().seed(), /*round=*/1);
  ASSERT_TRUE(noise.ok()) << noise.status().ToString();
  std::vector<double> sum(init.size(), 0.0);
  noise->AddNoise(sum, /*z·C=*/1.0 * 1.0);
  size_t equal = 0, equal_if_by_k = 0;
  for (size_t i = 0; i < init.size(); ++i) {
    equal += released[i] == float(double(init[i]) + double(float(sum[i] / 10.0)));
    equal_if_by_k += released[i] == float(double(init[i]) + double(float(sum[i] / double(k))));
  }
  EXPECT_EQ(equal, init.size()) << "the release is not init + the seeded noise over q·N";
  EXPECT_LT(equal_if_by_k, init.size() / 100) << "the release divides by the number drawn";

  // ε: the sampled Gaussian mechanism at the real q, in the row and the report.
  auto accountant = *privacy::Accountant::Create(1e-5);
  ASSERT_TRUE(accountant.AddRounds(0.5, 1.0).ok());
  ASSERT_TRUE(report->rounds[0].epsilon.has_value());
  EXPECT_DOUBLE_EQ(*report->rounds[0].epsilon, accountant.Spent().epsilon);
  ASSERT_TRUE(report->epsilon.has_value());
  EXPECT_DOUBLE_EQ(*report->epsilon, accountant.Spent().epsilon);
  EXPECT_EQ(report->scenario["sample_rate"], 0.5);
}

}  // namespace
}  // namespace estuary::simulations
