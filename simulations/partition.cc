#include "simulations/partition.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>

namespace estuary::simulations {
namespace {

// Dirichlet draws are repeated at most this often before giving up. At
// alpha = 0.1 with 100 clients over 8,000 examples a draw leaves some client
// empty most of the time, so a handful of tries is normal; hundreds is not.
constexpr int kMaxDirichletAttempts = 1000;
constexpr int kMaxShardsPerClient = 1'000'000;

using ClientIndices = std::vector<std::vector<uint32_t>>;

// Parses all of `text` as a double; nullopt on any leftover or malformed input.
std::optional<double> ParseDouble(std::string_view text) {
  double value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

std::optional<int> ParseInt(std::string_view text) {
  int value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

// The half-open range [begin, end) of piece `i` when `total` items are cut into
// `pieces` consecutive pieces whose sizes differ by at most one.
std::pair<uint64_t, uint64_t> PieceBounds(uint64_t total, uint64_t pieces, uint64_t i) {
  return {i * total / pieces, (i + 1) * total / pieces};
}

std::vector<uint32_t> Iota(size_t n) {
  std::vector<uint32_t> indices(n);
  std::iota(indices.begin(), indices.end(), 0u);
  return indices;
}

ClientIndices PartitionIid(size_t n, int num_clients, DeterministicRandom& rng) {
  std::vector<uint32_t> order = Iota(n);
  rng.Shuffle(order);
  ClientIndices clients(num_clients);
  for (int c = 0; c < num_clients; ++c) {
    auto [begin, end] = PieceBounds(n, num_clients, c);
    clients[c].assign(order.begin() + begin, order.begin() + end);
  }
  return clients;
}

Result<ClientIndices> PartitionShards(const std::vector<int32_t>& labels, int num_clients,
                                      int shards_per_client, DeterministicRandom& rng) {
  const uint64_t n = labels.size();
  const uint64_t num_shards = uint64_t(num_clients) * uint64_t(shards_per_client);
  if (num_shards > n) {
    return InvalidArgument(
        "partition: {} clients x {} shards = {} shards, more than the {} examples",
        num_clients, shards_per_client, num_shards, n);
  }
  // Indices ordered by label; stable, so equal labels stay in index order.
  std::vector<uint32_t> by_label = Iota(n);
  std::stable_sort(by_label.begin(), by_label.end(),
                   [&](uint32_t a, uint32_t b) { return labels[a] < labels[b]; });

  std::vector<uint32_t> shard_order = Iota(num_shards);
  rng.Shuffle(shard_order);
  ClientIndices clients(num_clients);
  for (int c = 0; c < num_clients; ++c) {
    for (int s = 0; s < shards_per_client; ++s) {
      const uint64_t shard = shard_order[uint64_t(c) * shards_per_client + s];
      auto [begin, end] = PieceBounds(n, num_shards, shard);
      clients[c].insert(clients[c].end(), by_label.begin() + begin, by_label.begin() + end);
    }
  }
  return clients;
}

Result<ClientIndices> PartitionDirichlet(const std::vector<int32_t>& labels, int num_classes,
                                         int num_clients, const PartitionSpec& spec,
                                         DeterministicRandom& rng) {
  const uint64_t n = labels.size();
  if (!(spec.alpha > 0) || !std::isfinite(spec.alpha)) {
    return InvalidArgument("partition: dirichlet alpha must be positive and finite, got {}",
                           spec.alpha);
  }
  if (spec.min_examples_per_client < 0 ||
      uint64_t(num_clients) * uint64_t(spec.min_examples_per_client) > n) {
    return InvalidArgument(
        "partition: {} clients cannot each get at least {} of {} examples", num_clients,
        spec.min_examples_per_client, n);
  }
  std::vector<std::vector<uint32_t>> by_class(num_classes);
  for (uint32_t i = 0; i < n; ++i) by_class[labels[i]].push_back(i);
  for (auto& members : by_class) rng.Shuffle(members);

  // cuts[k][c] .. cuts[k][c + 1] is the slice of class k's members given to client c.
  std::vector<std::vector<uint64_t>> cuts(num_classes, std::vector<uint64_t>(num_clients + 1));
  std::vector<uint64_t> client_sizes(num_clients);
  for (int attempt = 1; attempt <= kMaxDirichletAttempts; ++attempt) {
    std::fill(client_sizes.begin(), client_sizes.end(), 0);
    for (int k = 0; k < num_classes; ++k) {
      const uint64_t class_size = by_class[k].size();
      const std::vector<double> share = rng.Dirichlet(spec.alpha, num_clients);
      double cumulative = 0;
      for (int c = 0; c + 1 < num_clients; ++c) {
        cumulative += share[c];
        // Rounding can push the running sum a hair past 1 or make it dip; keep
        // the cuts inside the class and non-decreasing.
        uint64_t cut = uint64_t(std::floor(cumulative * double(class_size)));
        cut = std::clamp(cut, cuts[k][c], class_size);
        cuts[k][c + 1] = cut;
      }
      cuts[k][num_clients] = class_size;
      for (int c = 0; c < num_clients; ++c) client_sizes[c] += cuts[k][c + 1] - cuts[k][c];
    }
    const uint64_t smallest = *std::min_element(client_sizes.begin(), client_sizes.end());
    if (smallest < uint64_t(spec.min_examples_per_client)) continue;

    ClientIndices clients(num_clients);
    for (int k = 0; k < num_classes; ++k) {
      for (int c = 0; c < num_clients; ++c) {
        clients[c].insert(clients[c].end(), by_class[k].begin() + cuts[k][c],
                          by_class[k].begin() + cuts[k][c + 1]);
      }
    }
    return clients;
  }
  return FailedPrecondition(
      "partition: {} left some client with fewer than {} examples in {} draws "
      "({} clients, {} examples); use a larger alpha or fewer clients",
      PartitionName(spec), spec.min_examples_per_client, kMaxDirichletAttempts, num_clients,
      n);
}

}  // namespace

Result<PartitionSpec> ParsePartition(std::string_view text) {
  const size_t colon = text.find(':');
  const std::string_view kind = text.substr(0, colon);
  const bool has_argument = colon != std::string_view::npos;
  const std::string_view argument = has_argument ? text.substr(colon + 1) : std::string_view();
  PartitionSpec spec;
  if (kind == "iid") {
    if (has_argument) return InvalidArgument("partition \"{}\": iid takes no argument", text);
    spec.kind = PartitionSpec::kIid;
    return spec;
  }
  if (kind == "shards") {
    spec.kind = PartitionSpec::kShards;
    if (!has_argument) return spec;
    std::optional<int> shards = ParseInt(argument);
    if (!shards || *shards < 1 || *shards > kMaxShardsPerClient) {
      return InvalidArgument(
          "partition \"{}\": shards per client must be an integer from 1 to {}", text,
          kMaxShardsPerClient);
    }
    spec.shards_per_client = *shards;
    return spec;
  }
  if (kind == "dirichlet") {
    if (!has_argument) {
      return InvalidArgument("partition \"{}\": dirichlet needs alpha, e.g. dirichlet:0.5",
                             text);
    }
    std::optional<double> alpha = ParseDouble(argument);
    if (!alpha || !(*alpha > 0) || !std::isfinite(*alpha)) {
      return InvalidArgument(
          "partition \"{}\": dirichlet alpha must be a positive finite number, e.g. "
          "dirichlet:0.5",
          text);
    }
    spec.kind = PartitionSpec::kDirichlet;
    spec.alpha = *alpha;
    return spec;
  }
  return InvalidArgument(
      "partition \"{}\": unknown scheme; expected iid, shards[:N] or dirichlet:ALPHA", text);
}

std::string PartitionName(const PartitionSpec& spec) {
  switch (spec.kind) {
    case PartitionSpec::kIid: return "iid";
    case PartitionSpec::kShards:
      return spec.shards_per_client == 2 ? "shards"
                                         : fmt::format("shards:{}", spec.shards_per_client);
    case PartitionSpec::kDirichlet: return fmt::format("dirichlet:{}", spec.alpha);
  }
  return "unknown";
}

Result<std::vector<std::vector<uint32_t>>> Partition(const std::vector<int32_t>& labels,
                                                     int num_classes, int num_clients,
                                                     const PartitionSpec& spec, uint64_t seed) {
  const uint64_t n = labels.size();
  if (n > std::numeric_limits<uint32_t>::max()) {
    return InvalidArgument("partition: {} examples do not fit 32-bit indices", n);
  }
  if (num_classes <= 0) {
    return InvalidArgument("partition: num_classes must be positive, got {}", num_classes);
  }
  if (num_clients <= 0) {
    return InvalidArgument("partition: num_clients must be positive, got {}", num_clients);
  }
  if (uint64_t(num_clients) > n) {
    return InvalidArgument("partition: {} clients but only {} examples", num_clients, n);
  }
  for (uint64_t i = 0; i < n; ++i) {
    if (labels[i] < 0 || labels[i] >= num_classes) {
      return InvalidArgument("partition: label {} of example {} is outside [0, {})", labels[i],
                             i, num_classes);
    }
  }

  DeterministicRandom rng(seed);
  ClientIndices clients;
  switch (spec.kind) {
    case PartitionSpec::kIid:
      clients = PartitionIid(n, num_clients, rng);
      break;
    case PartitionSpec::kShards: {
      if (spec.shards_per_client < 1) {
        return InvalidArgument("partition: shards_per_client must be positive, got {}",
                               spec.shards_per_client);
      }
      ESTUARY_ASSIGN_OR_RETURN(clients,
                               PartitionShards(labels, num_clients, spec.shards_per_client, rng));
      break;
    }
    case PartitionSpec::kDirichlet: {
      ESTUARY_ASSIGN_OR_RETURN(
          clients, PartitionDirichlet(labels, num_classes, num_clients, spec, rng));
      break;
    }
    default:
      return InvalidArgument("partition: unknown kind {}", int(spec.kind));
  }
  // Ascending order makes a client's data independent of how it was dealt and
  // lets callers compare partitions directly.
  for (auto& indices : clients) std::sort(indices.begin(), indices.end());
  return clients;
}

uint64_t DeterministicRandom::UniformInt(uint64_t bound) { return UniformBelow(engine_, bound); }

double DeterministicRandom::Uniform01() {
  return double(engine_() >> 11) * 0x1.0p-53;
}

double DeterministicRandom::StandardNormal() {
  double u, v, s;
  do {
    u = 2 * Uniform01() - 1;
    v = 2 * Uniform01() - 1;
    s = u * u + v * v;
  } while (s >= 1 || s == 0);
  // The polar method yields two normals; we keep one so the stream has no hidden state.
  return u * std::sqrt(-2 * std::log(s) / s);
}

double DeterministicRandom::LogGamma(double shape) {
  if (shape < 1) {
    // Gamma(a) = Gamma(a + 1) * U^(1/a); in logs, a sum. 1 - U01 lies in (0, 1].
    const double u = 1 - Uniform01();
    return LogGamma(shape + 1) + std::log(u) / shape;
  }
  const double d = shape - 1.0 / 3.0;
  const double c = 1 / std::sqrt(9 * d);
  while (true) {
    double x, v;
    do {
      x = StandardNormal();
      v = 1 + c * x;
    } while (v <= 0);
    v = v * v * v;
    const double u = 1 - Uniform01();
    const double x2 = x * x;
    // Cheap squeeze first; the exact test only when it is inconclusive.
    if (u < 1 - 0.0331 * x2 * x2) return std::log(d * v);
    if (std::log(u) < 0.5 * x2 + d * (1 - v + std::log(v))) return std::log(d * v);
  }
}

std::vector<double> DeterministicRandom::Dirichlet(double alpha, int k) {
  std::vector<double> share(k);
  for (double& s : share) s = LogGamma(alpha);
  // Normalise in log space: subtracting the largest log keeps exp() from
  // underflowing every entry when alpha is small, and makes the sum >= 1.
  const double largest = *std::max_element(share.begin(), share.end());
  double total = 0;
  for (double& s : share) {
    s = std::exp(s - largest);
    total += s;
  }
  for (double& s : share) s /= total;
  return share;
}

}  // namespace estuary::simulations
