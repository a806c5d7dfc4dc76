// The privacy accountant (privacy/accountant.h): its closed forms against an
// independent numerical integration of the Rényi divergence, its (ε, δ)
// against figures published by TF Privacy, Opacus and Abadi et al., and the
// shape every accountant must have (monotone in T, q, z and δ).
#include "privacy/accountant.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <vector>

namespace estuary::privacy {
namespace {

// ---- The oracle: D_α(P‖Q) = log ∫ P^α Q^{1−α} dx / (α − 1), integrated.
//
// With μ₀ = N(0, z²), μ₁ = N(1, z²) and the mixture μ = (1−q)μ₀ + qμ₁, the
// sampled Gaussian mechanism's RDP is the larger of D_α(μ‖μ₀) and D_α(μ₀‖μ)
// (Mironov, Talwar and Zhang 2019, Sec. 3). Each integrand is written from
// the densities themselves, in log space, and integrated by the trapezoid rule
// over [−40z, α + 40z], which holds all the mass of both (the mixture's α-th
// power is a combination of Gaussians centred at 0…α). For a smooth integrand
// that decays like a Gaussian, the trapezoid rule converges geometrically in
// 1/h (its error falls like e^{−2πd/h}, d the half-width of the strip where the
// integrand is analytic: here d = πz², where the mixture's two terms cancel),
// so steps of z/16 are exact to rounding; the oracle checks itself against
// steps of z/8 all the same.

double LogNormal(double x, double mean, double z) {
  const double d = (x - mean) / z;
  return -0.5 * d * d - std::log(z) - 0.5 * std::log(2 * M_PI);
}

double Trapezoid(const std::function<double(double)>& f, double lo, double hi, double h) {
  const int64_t n = static_cast<int64_t>(std::ceil((hi - lo) / h));
  const double step = (hi - lo) / static_cast<double>(n);
  double sum = 0.5 * (f(lo) + f(hi));
  for (int64_t i = 1; i < n; ++i) sum += f(lo + static_cast<double>(i) * step);
  return sum * step;
}

// ∫ f at steps h and 2h; fails the test if they disagree beyond 1e-10 of ∫|f|.
double Integrate(const std::function<double(double)>& f, double lo, double hi, double h) {
  const double fine = Trapezoid(f, lo, hi, h), coarse = Trapezoid(f, lo, hi, 2 * h);
  const double magnitude = Trapezoid([&](double x) { return std::fabs(f(x)); }, lo, hi, h);
  EXPECT_NEAR(fine, coarse, 1e-10 * magnitude) << "the oracle's integral has not converged";
  return fine;
}

// D_α(P‖Q) with P = μ when mixture_first, else P = μ₀ (and Q the other).
double OracleRdp(double q, double z, double alpha, bool mixture_first) {
  auto log_mixture = [=](double x) {
    const double a = std::log1p(-q) + LogNormal(x, 0, z), b = std::log(q) + LogNormal(x, 1, z);
    const double hi = std::max(a, b);
    return hi + std::log1p(std::exp(std::min(a, b) - hi));
  };
  // The integrand P^α Q^{1−α} = μ₀ · (μ/μ₀)^p, p = α or 1 − α.
  const double p = mixture_first ? alpha : 1 - alpha;
  auto log_integrand = [=](double x) { return LogNormal(x, 0, z) + p * (log_mixture(x) - LogNormal(x, 0, z)); };
  const double lo = -40 * z, hi = alpha + 40 * z, h = z / 16;
  // Scaled by its largest value on the grid, so no order overflows.
  double peak = -std::numeric_limits<double>::infinity();
  for (double x = lo; x <= hi; x += h) peak = std::max(peak, log_integrand(x));
  const double scaled = Integrate([&](double x) { return std::exp(log_integrand(x) - peak); }, lo, hi, h);
  double log_a = peak + std::log(scaled);
  if (log_a < 1) {
    // Near 1, integrate what A exceeds 1 by (∫μ₀ = 1), so no digit is lost to the 1.
    const double excess = Integrate(
        [&](double x) {
          const double log_mu0 = LogNormal(x, 0, z), power = p * (log_mixture(x) - log_mu0);
          // Far out in a tail μ₀ underflows while the power overflows: there the
          // difference of the two exponentials is the finite form.
          if (power > 1) return std::exp(log_mu0 + power) - std::exp(log_mu0);
          return std::exp(log_mu0) * std::expm1(power);
        },
        lo, hi, h);
    log_a = std::log1p(excess);
  }
  return log_a / (alpha - 1);
}

TEST(SampledGaussianRdp, AgreesWithTheIntegratedDivergenceAtIntegerAndFractionalOrders) {
  int checked = 0;
  double worst = 0;
  for (double q : {0.001, 0.01, 0.1, 0.5, 0.9}) {
    for (double z : {0.7, 1.1, 2.0, 5.0}) {
      for (double alpha : {1.25, 1.5, 2.0, 2.5, 3.0, 4.75, 8.0, 10.5, 16.0, 32.0}) {
        auto closed = SampledGaussianRdp(q, z, alpha);
        ASSERT_TRUE(closed.ok()) << closed.status().ToString();
        const double forward = OracleRdp(q, z, alpha, true), backward = OracleRdp(q, z, alpha, false);
        // The paper's A_α is the forward divergence; it must be the larger one.
        EXPECT_GE(forward, backward * (1 - 1e-9)) << "q " << q << " z " << z << " alpha " << alpha;
        const double oracle = std::max(forward, backward);
        EXPECT_NEAR(*closed, oracle, 1e-6 * oracle) << "q " << q << " z " << z << " alpha " << alpha;
        worst = std::max(worst, std::fabs(*closed - oracle) / oracle);
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 200);
  std::printf("largest relative difference, closed form against the integral: %.3g\n", worst);
}

TEST(SampledGaussianRdp, OrderTwoHasAnExactForm) {
  // A_2 = (1−q)² + 2q(1−q) + q² e^{1/z²} = 1 + q² (e^{1/z²} − 1): the small-q
  // case where a sum formed as ≈ 1 + tiny would lose every digit.
  for (double q : {1e-6, 1e-3, 0.3}) {
    for (double z : {0.8, 1.0, 4.0}) {
      const double exact = std::log1p(q * q * std::expm1(1 / (z * z)));
      EXPECT_NEAR(*SampledGaussianRdp(q, z, 2), exact, 1e-12 * exact) << q << " " << z;
    }
  }
}

TEST(SampledGaussianRdp, TheFractionalSeriesMeetsTheIntegerSumAtIntegers) {
  for (double q : {0.004, 0.2}) {
    for (double alpha : {2.0, 5.0, 12.0}) {
      const double at = *SampledGaussianRdp(q, 1.1, alpha);
      const double above = *SampledGaussianRdp(q, 1.1, alpha + 1e-7), below = *SampledGaussianRdp(q, 1.1, alpha - 1e-7);
      EXPECT_NEAR(above, at, 1e-5 * at) << q << " " << alpha;
      EXPECT_NEAR(below, at, 1e-5 * at) << q << " " << alpha;
      EXPECT_LT(below, above);
    }
  }
}

TEST(SampledGaussianRdp, NoSamplingIsFreeAndFullSamplingIsTheGaussianMechanism) {
  for (double alpha : {1.5, 2.0, 7.25, 256.0}) {
    EXPECT_EQ(*SampledGaussianRdp(0, 1.3, alpha), 0);
    EXPECT_DOUBLE_EQ(*SampledGaussianRdp(1, 1.3, alpha), alpha / (2 * 1.3 * 1.3));
    // Just below q = 1 the series tends to the same value.
    EXPECT_NEAR(*SampledGaussianRdp(1 - 1e-9, 1.3, alpha), alpha / (2 * 1.3 * 1.3), 1e-6 * alpha);
  }
}

TEST(SampledGaussianRdp, LargeOrdersStayFinite) {
  for (double alpha : {128.0, 256.0, 512.0, 300.5}) {
    const double rdp = *SampledGaussianRdp(0.01, 0.5, alpha);
    EXPECT_TRUE(std::isfinite(rdp)) << alpha;
    EXPECT_LE(rdp, alpha / (2 * 0.25)) << alpha;  // never more than unsampled
  }
}

// ---- Published figures, each within 1 %, with the conversion and the grid
// of orders the publication used.

// TF Privacy's MNIST tutorial (tensorflow/privacy, tutorials/README.md and
// mnist_dpsgd_tutorial.py): q = 256/60000, 60000 // 256 = 234 steps an epoch,
// δ = 1e-5, orders 1.1, 1.2, …, 10.9 and 12, …, 63, and its get_privacy_spent
// of the time, the classic conversion.
std::vector<double> TfTutorialOrders() {
  std::vector<double> orders;
  for (int x = 1; x < 100; ++x) orders.push_back(1 + x / 10.0);
  for (int a = 12; a < 64; ++a) orders.push_back(a);
  return orders;
}

TEST(PublishedFigures, TfPrivacyMnistTutorial) {
  const double q = 256.0 / 60000;
  struct Row {
    double z;
    int epochs;
    double epsilon;
  };
  // The README's "expected output" (z = 1.12: ε 1.00 after epoch 1, 1.04 after
  // epoch 2, 2.92 after 60) and its table (z = 0.6, 30 epochs: 9.74; z = 1.2,
  // 10 epochs: 1.20).
  for (const Row& row : {Row{1.12, 1, 1.00}, Row{1.12, 2, 1.04}, Row{1.12, 60, 2.92}, Row{0.6, 30, 9.74},
                         Row{1.2, 10, 1.20}}) {
    auto got = EpsilonAfterRounds(q, row.z, row.epochs * 234, 1e-5, Conversion::kClassic, TfTutorialOrders());
    ASSERT_TRUE(got.ok());
    EXPECT_NEAR(got->epsilon, row.epsilon, 0.01 * row.epsilon) << "z " << row.z << ", " << row.epochs << " epochs";
  }
}

TEST(PublishedFigures, OpacusComputeDpSgdPrivacy) {
  // opacus.ai/api/compute_dp_sgd_privacy.html: sample rate 1 %, z = 1.0,
  // 3 epochs = 300 steps, δ = 1e-5, alphas 2 5 10 20 100: "epsilon = 2.39 …
  // The optimal alpha is 5.0". Opacus converts with the tight conversion.
  const std::vector<double> alphas = {2, 5, 10, 20, 100};
  auto got = EpsilonAfterRounds(0.01, 1.0, 300, 1e-5, Conversion::kTight, alphas);
  ASSERT_TRUE(got.ok());
  EXPECT_NEAR(got->epsilon, 2.39, 0.01 * 2.39);
  EXPECT_EQ(got->order, 5);
  // The classic conversion would have said 3.02: the figure is not the classic one.
  EXPECT_GT(EpsilonAfterRounds(0.01, 1.0, 300, 1e-5, Conversion::kClassic, alphas)->epsilon, 2.39 * 1.2);
}

TEST(PublishedFigures, AbadiEtAlMomentsAccountant) {
  // Abadi et al. 2016, "Deep Learning with Differential Privacy", Sec. 3.1:
  // q = 0.01, σ = 4, δ = 1e-5, T = 10000 gives ε ≈ 1.26 with the moments
  // accountant, which bounds the log-moment at integer λ = α − 1 ≤ 32 and
  // converts as the classic conversion does.
  std::vector<double> orders;
  for (int a = 2; a <= 33; ++a) orders.push_back(a);
  auto got = EpsilonAfterRounds(0.01, 4, 10000, 1e-5, Conversion::kClassic, orders);
  ASSERT_TRUE(got.ok());
  EXPECT_NEAR(got->epsilon, 1.26, 0.01 * 1.26);
}

TEST(PublishedFigures, AbadiEtAlFigureTwoAtFourHundredEpochs) {
  // Abadi et al. 2016, Sec. 5 (Fig. 2's text): the same q = 0.01, σ = 4,
  // δ = 1e-5 over E = 400 epochs, T = E / q = 40000 steps, gives ε ≈ 2.55
  // with the moments accountant (the figure tensorflow/privacy issue #85
  // reproduces with TF Privacy's RDP accountant and its order grid, classic
  // conversion). Ours with that grid: 2.5737, 0.93 % above — within 1 %, and
  // no closer: the paper bounded the log-moments its own way.
  auto got = EpsilonAfterRounds(0.01, 4, 40000, 1e-5, Conversion::kClassic, TfTutorialOrders());
  ASSERT_TRUE(got.ok());
  EXPECT_NEAR(got->epsilon, 2.55, 0.01 * 2.55);
  // And ε grows like √T here: four times the steps, about twice the ε (1.26 at T = 10000).
  auto quarter = EpsilonAfterRounds(0.01, 4, 10000, 1e-5, Conversion::kClassic, TfTutorialOrders());
  ASSERT_TRUE(quarter.ok());
  EXPECT_NEAR(got->epsilon / quarter->epsilon, 2.0, 0.1);
}

// ---- Shape.

TEST(Epsilon, GrowsWithRoundsAndSamplingAndFallsWithNoiseAndDelta) {
  for (Conversion conversion : {Conversion::kTight, Conversion::kClassic}) {
    auto eps = [&](double q, double z, int64_t t, double delta) {
      return EpsilonAfterRounds(q, z, t, delta, conversion)->epsilon;
    };
    double last = 0;
    for (int64_t t : {1, 10, 100, 1000, 10000}) {
      const double e = eps(0.01, 1.1, t, 1e-5);
      EXPECT_GT(e, last) << t;
      last = e;
    }
    last = 0;
    for (double q : {0.001, 0.01, 0.05, 0.2, 1.0}) {
      const double e = eps(q, 1.1, 100, 1e-5);
      EXPECT_GT(e, last) << q;
      last = e;
    }
    last = std::numeric_limits<double>::infinity();
    for (double z : {0.6, 0.8, 1.1, 2.0, 5.0}) {
      const double e = eps(0.01, z, 100, 1e-5);
      EXPECT_LT(e, last) << z;
      last = e;
    }
    last = std::numeric_limits<double>::infinity();
    for (double delta : {1e-9, 1e-7, 1e-5, 1e-3, 0.1}) {
      const double e = eps(0.01, 1.1, 100, delta);
      EXPECT_LT(e, last) << delta;
      last = e;
    }
  }
}

TEST(Epsilon, TheTightConversionIsNeverLooserThanTheClassic) {
  for (double q : {0.001, 0.05, 1.0}) {
    for (int64_t t : {1, 100, 10000}) {
      const double tight = EpsilonAfterRounds(q, 1.0, t, 1e-6, Conversion::kTight)->epsilon;
      const double classic = EpsilonAfterRounds(q, 1.0, t, 1e-6, Conversion::kClassic)->epsilon;
      EXPECT_LE(tight, classic) << q << " " << t;
    }
  }
}

TEST(Epsilon, TheReportedOrderIsTheOneThatGaveIt) {
  const auto& orders = DefaultOrders();
  auto rdp = SampledGaussianRdp(0.01, 1.1, orders);
  ASSERT_TRUE(rdp.ok());
  std::vector<double> composed;
  for (double r : *rdp) composed.push_back(1000 * r);
  auto got = EpsilonFromRdp(orders, composed, 1e-5);
  ASSERT_TRUE(got.ok());
  for (size_t i = 0; i < orders.size(); ++i) {
    const double at = composed[i] + std::log((orders[i] - 1) / orders[i]) -
                      (std::log(1e-5) + std::log(orders[i])) / (orders[i] - 1);
    EXPECT_GE(at, got->epsilon - 1e-12) << orders[i];
    if (orders[i] == got->order) {
      EXPECT_DOUBLE_EQ(at, got->epsilon);
    }
  }
  EXPECT_GT(got->order, 1.1);
  EXPECT_LT(got->order, 512);
}

TEST(MaxRounds, IsTheLastRoundWithinTheBudget) {
  for (double budget : {0.5, 1.0, 3.0, 8.0}) {
    for (double q : {0.005, 0.05}) {
      auto t = MaxRounds(q, 1.0, 1e-5, budget);
      ASSERT_TRUE(t.ok());
      EXPECT_LE(EpsilonAfterRounds(q, 1.0, *t, 1e-5)->epsilon, budget) << budget << " " << q;
      EXPECT_GT(EpsilonAfterRounds(q, 1.0, *t + 1, 1e-5)->epsilon, budget) << budget << " " << q;
    }
  }
  // A budget below one round's ε allows none; q = 0 allows any number.
  EXPECT_EQ(*MaxRounds(1.0, 0.5, 1e-5, 0.1), 0);
  EXPECT_EQ(*MaxRounds(0, 1.0, 1e-5, 0.1), kUnboundedRounds);
}

TEST(Accountant, ComposesRoundsOfDifferentRatesAndPreviewsTheNext) {
  auto accountant = Accountant::Create(1e-5);
  ASSERT_TRUE(accountant.ok());
  EXPECT_EQ(accountant->Spent().epsilon, 0);
  ASSERT_TRUE(accountant->AddRounds(0.01, 1.1, 100).ok());
  ASSERT_TRUE(accountant->AddRounds(0.02, 1.5, 50).ok());
  EXPECT_EQ(accountant->rounds(), 150);
  // RDP adds: the account is the sum of the two runs' RDP at every order.
  const auto& orders = accountant->orders();
  auto a = SampledGaussianRdp(0.01, 1.1, orders), b = SampledGaussianRdp(0.02, 1.5, orders);
  for (size_t i = 0; i < orders.size(); ++i) {
    EXPECT_NEAR(accountant->rdp()[i], 100 * (*a)[i] + 50 * (*b)[i], 1e-12 * accountant->rdp()[i]);
  }
  // The preview records nothing, and is what adding the round then spends.
  const Epsilon before = accountant->Spent();
  auto next = accountant->EpsilonAfter(0.01, 1.1);
  ASSERT_TRUE(next.ok());
  EXPECT_GT(next->epsilon, before.epsilon);
  EXPECT_EQ(accountant->Spent().epsilon, before.epsilon);
  ASSERT_TRUE(accountant->AddRounds(0.01, 1.1).ok());
  EXPECT_DOUBLE_EQ(accountant->Spent().epsilon, next->epsilon);
  // The rounds left within a budget end exactly where the preview crosses it.
  const double budget = 2.0;
  auto left = accountant->RoundsWithin(0.01, 1.1, budget);
  ASSERT_TRUE(left.ok());
  EXPECT_LE(accountant->EpsilonAfter(0.01, 1.1, *left)->epsilon, budget);
  EXPECT_GT(accountant->EpsilonAfter(0.01, 1.1, *left + 1)->epsilon, budget);
}

TEST(Accountant, AnAccountPastItsBudgetAllowsNoMoreRounds) {
  auto accountant = Accountant::Create(1e-5);
  ASSERT_TRUE(accountant->AddRounds(0.5, 0.8, 100).ok());
  const double spent = accountant->Spent().epsilon;
  EXPECT_EQ(*accountant->RoundsWithin(0.5, 0.8, spent / 2), 0);
}

TEST(Inputs, BadValuesGetOneClearLine) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  auto message = [](const Status& status) { return status.ToString(); };
  EXPECT_EQ(message(SampledGaussianRdp(1.5, 1, 2).status()),
            "invalid argument: privacy: sampling rate q = 1.5: must be in [0, 1]");
  EXPECT_EQ(message(SampledGaussianRdp(-0.1, 1, 2).status()),
            "invalid argument: privacy: sampling rate q = -0.1: must be in [0, 1]");
  EXPECT_EQ(message(SampledGaussianRdp(nan, 1, 2).status()),
            "invalid argument: privacy: sampling rate q = nan: must be in [0, 1]");
  EXPECT_EQ(message(SampledGaussianRdp(0.1, 0, 2).status()),
            "invalid argument: privacy: noise multiplier z = 0: must be finite and > 0");
  EXPECT_EQ(message(SampledGaussianRdp(0.1, nan, 2).status()),
            "invalid argument: privacy: noise multiplier z = nan: must be finite and > 0");
  EXPECT_EQ(message(SampledGaussianRdp(0.1, 1, 1).status()),
            "invalid argument: privacy: order 1: must be finite and > 1");
  EXPECT_EQ(message(SampledGaussianRdp(0.1, 1, nan).status()),
            "invalid argument: privacy: order nan: must be finite and > 1");
  EXPECT_EQ(message(EpsilonAfterRounds(0.1, 1, 10, 0).status()),
            "invalid argument: privacy: delta = 0: must be in (0, 1)");
  EXPECT_EQ(message(EpsilonAfterRounds(0.1, 1, 10, 1).status()),
            "invalid argument: privacy: delta = 1: must be in (0, 1)");
  EXPECT_EQ(message(EpsilonAfterRounds(0.1, 1, 10, nan).status()),
            "invalid argument: privacy: delta = nan: must be in (0, 1)");
  EXPECT_EQ(message(EpsilonAfterRounds(0.1, 1, -1, 1e-5).status()),
            "invalid argument: privacy: rounds = -1: must be >= 0");
  EXPECT_EQ(message(MaxRounds(0.1, 1, 1e-5, nan).status()),
            "invalid argument: privacy: epsilon budget nan: must be finite and >= 0");
  EXPECT_EQ(message(Accountant::Create(2).status()), "invalid argument: privacy: delta = 2: must be in (0, 1)");
  EXPECT_EQ(message(Accountant::Create(1e-5, Conversion::kTight, {}).status()),
            "invalid argument: privacy: no orders to minimise over");
  const std::vector<double> orders = {2, 3};
  const std::vector<double> rdp = {0.1};
  EXPECT_EQ(message(EpsilonFromRdp(orders, rdp, 1e-5).status()), "invalid argument: privacy: 1 RDP values for 2 orders");
  auto accountant = Accountant::Create(1e-5);
  EXPECT_FALSE(accountant->AddRounds(0.1, -1).ok());
  EXPECT_EQ(accountant->rounds(), 0);  // a refused round is not counted
}

}  // namespace
}  // namespace estuary::privacy
