#include "aggregation/lora_merge.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "aggregation/weighted_mean.h"

// LAPACK's Fortran entry points, which OpenBLAS exports; there is no LAPACKE
// header on the build machines. Column-major; the trailing size_t is the
// hidden length gfortran passes for a character argument.
extern "C" {
void dgeqrf_(const int* m, const int* n, double* a, const int* lda, double* tau, double* work, const int* lwork,
             int* info);
void dorgqr_(const int* m, const int* n, const int* k, double* a, const int* lda, const double* tau, double* work,
             const int* lwork, int* info);
void dgesdd_(const char* jobz, const int* m, const int* n, double* a, const int* lda, double* s, double* u,
             const int* ldu, double* vt, const int* ldvt, double* work, const int* lwork, int* iwork, int* info,
             size_t jobz_len);
}

namespace estuary::aggregation {
namespace {

constexpr std::string_view kWhere = "aggregation/lora_merge";

std::vector<double> NormalisedWeights(std::span<const double> weights) {
  double total = 0;
  for (double w : weights) total += w;
  std::vector<double> out(weights.size());
  for (size_t i = 0; i < weights.size(); ++i) out[i] = weights[i] / total;
  return out;
}

// The checks on one adapter alone: sizes agree with rank, in, out; values finite.
Status CheckAdapter(size_t client, std::string_view module, const LoraAdapter& adapter) {
  if (adapter.rank == 0 || adapter.in == 0 || adapter.out == 0) {
    return InvalidArgument("{}: client {}: module {}: rank {}, in {}, out {}: all must be > 0", kWhere, client, module,
                           adapter.rank, adapter.in, adapter.out);
  }
  if (!std::isfinite(adapter.alpha) || adapter.alpha <= 0) {
    return InvalidArgument("{}: client {}: module {}: alpha must be finite and > 0, got {}", kWhere, client, module,
                           adapter.alpha);
  }
  if (adapter.a.size() != adapter.rank * adapter.in) {
    return InvalidArgument("{}: client {}: module {}: a has {} values, rank {} x in {} needs {}", kWhere, client,
                           module, adapter.a.size(), adapter.rank, adapter.in, adapter.rank * adapter.in);
  }
  if (adapter.b.size() != adapter.out * adapter.rank) {
    return InvalidArgument("{}: client {}: module {}: b has {} values, out {} x rank {} needs {}", kWhere, client,
                           module, adapter.b.size(), adapter.out, adapter.rank, adapter.out * adapter.rank);
  }
  if (size_t bad = FirstNonFinite(adapter.a); bad != adapter.a.size()) {
    return InvalidArgument("{}: client {}: module {}: a[{}] is {}", kWhere, client, module, bad, adapter.a[bad]);
  }
  if (size_t bad = FirstNonFinite(adapter.b); bad != adapter.b.size()) {
    return InvalidArgument("{}: client {}: module {}: b[{}] is {}", kWhere, client, module, bad, adapter.b[bad]);
  }
  return Status::Ok();
}

bool NeedsEqualRank(LoraMergeRule rule) { return rule != LoraMergeRule::kExact; }

// Client `client`'s adapter against client 0's: the fields every rule needs
// equal (in, out) and those the rule needs equal (rank, alpha).
Status CheckAgainstFirst(size_t client, std::string_view module, const LoraAdapter& first, const LoraAdapter& adapter,
                         LoraMergeRule rule) {
  if (adapter.in != first.in || adapter.out != first.out) {
    return InvalidArgument("{}: client {}: module {}: shape (in {}, out {}) differs from client 0's (in {}, out {})",
                           kWhere, client, module, adapter.in, adapter.out, first.in, first.out);
  }
  if (NeedsEqualRank(rule) && adapter.rank != first.rank) {
    return InvalidArgument("{}: client {}: module {}: rank {} differs from client 0's {}; {} needs equal ranks",
                           kWhere, client, module, adapter.rank, first.rank, LoraMergeRuleName(rule));
  }
  if (NeedsEqualRank(rule) && adapter.alpha != first.alpha) {
    return InvalidArgument("{}: client {}: module {}: alpha {} differs from client 0's {}; {} needs equal alphas",
                           kWhere, client, module, adapter.alpha, first.alpha, LoraMergeRuleName(rule));
  }
  return Status::Ok();
}

// Σ w_i B_i and Σ w_i A_i (or A_0 when `shared_a`) in double, rounded once.
LoraAdapter AverageFactors(std::span<const LoraAdapter> clients, const std::vector<double>& w, bool shared_a) {
  const LoraAdapter& first = clients[0];
  LoraAdapter merged{.rank = first.rank, .in = first.in, .out = first.out, .alpha = first.alpha};
  std::vector<double> a(first.a.size(), 0.0), b(first.b.size(), 0.0);
  for (size_t i = 0; i < clients.size(); ++i) {
    for (size_t k = 0; k < b.size(); ++k) b[k] += w[i] * clients[i].b[k];
    if (!shared_a) {
      for (size_t k = 0; k < a.size(); ++k) a[k] += w[i] * clients[i].a[k];
    }
  }
  merged.b.assign(b.begin(), b.end());
  merged.a = shared_a ? first.a : std::vector<float>(a.begin(), a.end());
  return merged;
}

// Householder QR of the column-major m x n matrix `x`, in place: returns R
// (min(m, n) x n, column-major, zeros below the diagonal) and leaves Q's
// first min(m, n) columns in `x`.
Result<std::vector<double>> QrInPlace(std::vector<double>& x, int m, int n, std::string_view what) {
  const int k = std::min(m, n);
  std::vector<double> tau(k);
  int info = 0, lwork = -1;
  double query = 0;
  dgeqrf_(&m, &n, x.data(), &m, tau.data(), &query, &lwork, &info);
  lwork = std::max(1, int(query));
  std::vector<double> work(lwork);
  dgeqrf_(&m, &n, x.data(), &m, tau.data(), work.data(), &lwork, &info);
  if (info != 0) return Internal("{}: dgeqrf on the {} stack ({} x {}) failed, info {}", kWhere, what, m, n, info);
  std::vector<double> r(size_t(k) * n, 0.0);
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i <= std::min(j, k - 1); ++i) r[size_t(j) * k + i] = x[size_t(j) * m + i];
  }
  lwork = -1;
  dorgqr_(&m, &k, &k, x.data(), &m, tau.data(), &query, &lwork, &info);
  lwork = std::max(1, int(query));
  work.assign(lwork, 0.0);
  dorgqr_(&m, &k, &k, x.data(), &m, tau.data(), work.data(), &lwork, &info);
  if (info != 0) return Internal("{}: dorgqr on the {} stack ({} x {}) failed, info {}", kWhere, what, m, k, info);
  return r;
}

// ΔW_avg = U·V with U = [√(w_i s_i) B_i] (out x K) and V = [√(w_i s_i) A_i]
// (K x in), K = Σ rank_i. With U = Q_B R_B and Vᵀ = Q_A R_A, ΔW_avg =
// Q_B (R_B R_Aᵀ) Q_Aᵀ, so the SVD of the small R_B R_Aᵀ gives ΔW_avg's: the
// cost is O((out + in) K²) rather than an SVD of the out x in matrix.
Result<MergedLoraModule> MergeExact(std::string_view module, std::span<const LoraAdapter> clients,
                                    const std::vector<double>& w, const LoraMergeOptions& options) {
  const size_t out = clients[0].out, in = clients[0].in;
  size_t stacked = 0;
  for (const LoraAdapter& c : clients) stacked += c.rank;
  const int m_b = int(out), m_a = int(in), k = int(stacked);
  if (size_t(k) != stacked || size_t(m_b) != out || size_t(m_a) != in) {
    return InvalidArgument("{}: module {}: out {}, in {}, Σ rank {}: too large for LAPACK's int", kWhere, module, out,
                           in, stacked);
  }

  // Column-major stacks: column j of U is a column of some B_i, column j of
  // Vᵀ is a row of that A_i.
  std::vector<double> u(out * stacked), vt(in * stacked);
  size_t col = 0;
  for (size_t i = 0; i < clients.size(); ++i) {
    const LoraAdapter& c = clients[i];
    const double factor = std::sqrt(w[i] * c.scale());
    for (size_t j = 0; j < c.rank; ++j, ++col) {
      for (size_t o = 0; o < out; ++o) u[col * out + o] = factor * c.b[o * c.rank + j];
      for (size_t x = 0; x < in; ++x) vt[col * in + x] = factor * c.a[j * in + x];
    }
  }
  ESTUARY_ASSIGN_OR_RETURN(std::vector<double> r_b, QrInPlace(u, m_b, k, "B"));
  ESTUARY_ASSIGN_OR_RETURN(std::vector<double> r_a, QrInPlace(vt, m_a, k, "A"));
  const int kb = std::min(m_b, k), ka = std::min(m_a, k), p = std::min(kb, ka);

  std::vector<double> core(size_t(kb) * ka);  // R_B R_Aᵀ, kb x ka
  cblas_dgemm(CblasColMajor, CblasNoTrans, CblasTrans, kb, ka, k, 1.0, r_b.data(), kb, r_a.data(), ka, 0.0,
              core.data(), kb);
  std::vector<double> sigma(p), left(size_t(kb) * p), right_t(size_t(p) * ka);
  std::vector<int> iwork(8 * size_t(p));
  int info = 0, lwork = -1;
  double query = 0;
  const char jobz = 'S';
  dgesdd_(&jobz, &kb, &ka, core.data(), &kb, sigma.data(), left.data(), &kb, right_t.data(), &p, &query, &lwork,
          iwork.data(), &info, 1);
  lwork = std::max(1, int(query));
  std::vector<double> work(lwork);
  dgesdd_(&jobz, &kb, &ka, core.data(), &kb, sigma.data(), left.data(), &kb, right_t.data(), &p, work.data(), &lwork,
          iwork.data(), &info, 1);
  if (info != 0) return Internal("{}: module {}: dgesdd on the {} x {} core failed, info {}", kWhere, module, kb, ka, info);

  // Singular vectors of ΔW_avg: Q_B·P (out x p) and Q_A·T (in x p).
  std::vector<double> left_full(out * p), right_full(in * p);
  cblas_dgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, m_b, p, kb, 1.0, u.data(), m_b, left.data(), kb, 0.0,
              left_full.data(), m_b);
  cblas_dgemm(CblasColMajor, CblasNoTrans, CblasTrans, m_a, p, ka, 1.0, vt.data(), m_a, right_t.data(), p, 0.0,
              right_full.data(), m_a);

  // Split each kept σ_j evenly between B' and A' (√σ_j each) so neither factor
  // dwarfs the other when the clients train on from them; the 1/√s undoes the
  // alpha/rank the model applies.
  const size_t rank = options.rank;
  const size_t kept = std::min(rank, size_t(p));
  MergedLoraModule merged;
  LoraAdapter& adapter = merged.adapter;
  adapter = LoraAdapter{.rank = rank, .in = in, .out = out, .alpha = options.alpha};
  adapter.a.assign(rank * in, 0.0f);
  adapter.b.assign(out * rank, 0.0f);
  const double inv_sqrt_scale = 1.0 / std::sqrt(adapter.scale());
  for (size_t j = 0; j < kept; ++j) {
    const double g = std::sqrt(sigma[j]) * inv_sqrt_scale;
    for (size_t o = 0; o < out; ++o) adapter.b[o * rank + j] = float(g * left_full[j * out + o]);
    for (size_t x = 0; x < in; ++x) adapter.a[j * in + x] = float(g * right_full[j * in + x]);
  }
  merged.singular_values = sigma;

  // Nothing to send when the dropped part is below fp32's rounding of ΔW_avg.
  double dropped2 = 0, total2 = 0;
  for (int j = 0; j < p; ++j) {
    total2 += sigma[j] * sigma[j];
    if (size_t(j) >= kept) dropped2 += sigma[j] * sigma[j];
  }
  const double eps = std::numeric_limits<float>::epsilon();
  if (dropped2 <= eps * eps * total2) return merged;

  // The residual from the clients' own factors rather than from the rotated
  // stacks, so base' + s·B'·A' reproduces Σ w_i s_i B_i A_i to fp32 rounding
  // whatever the QR and SVD lost; kept as those factors, which for a wide
  // weight are far smaller than the [out, in] residual they make.
  models::LowRankMatrix& residual = merged.residual;
  residual = {.rows = out, .cols = in, .rank = stacked + rank};
  residual.u.resize(out * residual.rank);
  residual.v.reserve(residual.rank * in);
  size_t at = 0;
  auto append = [&](const LoraAdapter& f, double scale) {
    for (size_t o = 0; o < out; ++o) {
      for (size_t j = 0; j < f.rank; ++j) residual.u[o * residual.rank + at + j] = float(scale * f.b[o * f.rank + j]);
    }
    residual.v.insert(residual.v.end(), f.a.begin(), f.a.end());
    at += f.rank;
  };
  for (size_t i = 0; i < clients.size(); ++i) append(clients[i], w[i] * clients[i].scale());
  append(adapter, -adapter.scale());
  return merged;
}

}  // namespace

std::vector<float> LoraDelta(const LoraAdapter& adapter) {
  std::vector<float> delta(adapter.out * adapter.in, 0.0f);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(adapter.out), int(adapter.in), int(adapter.rank),
              float(adapter.scale()), adapter.b.data(), int(adapter.rank), adapter.a.data(), int(adapter.in), 0.0f,
              delta.data(), int(adapter.in));
  return delta;
}

Result<LoraMergeRule> ParseLoraMergeRule(std::string_view name) {
  if (name == "naive") return LoraMergeRule::kNaive;
  if (name == "exact") return LoraMergeRule::kExact;
  if (name == "frozen-a") return LoraMergeRule::kFrozenA;
  return InvalidArgument("{}: unknown merge rule '{}' (naive | exact | frozen-a)", kWhere, name);
}

std::string_view LoraMergeRuleName(LoraMergeRule rule) {
  switch (rule) {
    case LoraMergeRule::kNaive: return "naive";
    case LoraMergeRule::kExact: return "exact";
    case LoraMergeRule::kFrozenA: return "frozen-a";
  }
  return "unknown";
}

Result<MergedLoraModule> MergeLoraModule(std::string_view module, std::span<const LoraAdapter> clients,
                                         std::span<const double> weights, const LoraMergeOptions& options) {
  if (clients.empty()) return InvalidArgument("{}: module {}: no clients to merge", kWhere, module);
  if (weights.size() != clients.size()) {
    return InvalidArgument("{}: module {}: {} weights for {} clients", kWhere, module, weights.size(), clients.size());
  }
  for (size_t i = 0; i < clients.size(); ++i) {
    if (!std::isfinite(weights[i]) || weights[i] <= 0) {
      return InvalidArgument("{}: client {}: weight must be finite and > 0, got {}", kWhere, i, weights[i]);
    }
    ESTUARY_RETURN_IF_ERROR(CheckAdapter(i, module, clients[i]));
    ESTUARY_RETURN_IF_ERROR(CheckAgainstFirst(i, module, clients[0], clients[i], options.rule));
  }
  const std::vector<double> w = NormalisedWeights(weights);
  switch (options.rule) {
    case LoraMergeRule::kNaive:
      return MergedLoraModule{.adapter = AverageFactors(clients, w, /*shared_a=*/false)};
    case LoraMergeRule::kFrozenA:
      for (size_t i = 1; i < clients.size(); ++i) {
        // Bits, not values: -0.0 == 0.0 but the clients were not given the same A.
        if (std::memcmp(clients[i].a.data(), clients[0].a.data(), clients[0].a.size() * sizeof(float)) != 0) {
          size_t at = 0;
          while (std::memcmp(&clients[i].a[at], &clients[0].a[at], sizeof(float)) == 0) ++at;
          return InvalidArgument("{}: client {}: module {}: a differs from client 0's at [{}] ({} vs {}); frozen-a "
                                 "needs one shared A",
                                 kWhere, i, module, at, clients[i].a[at], clients[0].a[at]);
        }
      }
      return MergedLoraModule{.adapter = AverageFactors(clients, w, /*shared_a=*/true)};
    case LoraMergeRule::kExact:
      if (options.rank == 0 || !std::isfinite(options.alpha) || options.alpha <= 0) {
        return InvalidArgument("{}: exact needs a target rank > 0 and alpha finite and > 0, got rank {}, alpha {}",
                               kWhere, options.rank, options.alpha);
      }
      return MergeExact(module, clients, w, options);
  }
  return InvalidArgument("{}: unknown merge rule {}", kWhere, int(options.rule));
}

uint64_t LoraUpdate::bytes() const {
  uint64_t total = 0;
  for (const auto& [name, adapter] : modules) total += adapter.bytes();
  return total;
}

Status CheckLoraUpdates(std::span<const LoraUpdate> clients, LoraMergeRule rule) {
  if (clients.empty()) return InvalidArgument("{}: no clients to merge", kWhere);
  const auto& first = clients[0].modules;
  if (first.empty()) return InvalidArgument("{}: client 0: no modules", kWhere);
  for (size_t i = 0; i < clients.size(); ++i) {
    const auto& modules = clients[i].modules;
    for (const auto& [name, reference] : first) {
      auto it = modules.find(name);
      if (it == modules.end()) {
        return InvalidArgument("{}: client {}: module {}: missing (client 0 has it)", kWhere, i, name);
      }
      ESTUARY_RETURN_IF_ERROR(CheckAdapter(i, name, it->second));
      ESTUARY_RETURN_IF_ERROR(CheckAgainstFirst(i, name, reference, it->second, rule));
    }
    for (const auto& [name, adapter] : modules) {
      if (!first.contains(name)) {
        return InvalidArgument("{}: client {}: module {}: unexpected (client 0 has no such module)", kWhere, i, name);
      }
    }
  }
  return Status::Ok();
}

Result<LoraMergeResult> MergeLoraUpdates(std::span<const LoraUpdate> clients, std::span<const double> weights,
                                         const LoraMergeOptions& options) {
  ESTUARY_RETURN_IF_ERROR(CheckLoraUpdates(clients, options.rule));
  LoraMergeResult result;
  std::vector<LoraAdapter> column(clients.size());
  for (const auto& [name, reference] : clients[0].modules) {
    // A copy per module keeps MergeLoraModule's span-of-adapters contract; the
    // factors are small next to the out x in products merging does.
    for (size_t i = 0; i < clients.size(); ++i) column[i] = clients[i].modules.at(name);
    ESTUARY_ASSIGN_OR_RETURN(MergedLoraModule merged, MergeLoraModule(name, column, weights, options));
    // Under frozen-a the shared A never changes: only B goes back.
    const LoraAdapter& a = merged.adapter;
    result.adapter_bytes += options.rule == LoraMergeRule::kFrozenA ? uint64_t(4) * a.rank * a.out : a.bytes();
    result.residual_bytes += merged.residual_bytes();
    result.modules.emplace(name, std::move(merged));
  }
  return result;
}

}  // namespace estuary::aggregation
