#include "aggregation/robust.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace estuary::aggregation {

Status KeptUpdates::Add(std::span<const float> values) {
  if (values.size() != size_) {
    return InvalidArgument("robust: update has {} values, expected {}", values.size(), size_);
  }
  auto copy = std::make_shared<const std::vector<float>>(values.begin(), values.end());
  const std::span<const float> view(*copy);
  kept_.push_back({std::move(copy), view, true});
  return Status::Ok();
}

Status KeptUpdates::Keep(std::shared_ptr<const void> owner, std::span<const float> values) {
  if (values.size() != size_) {
    return InvalidArgument("robust: update has {} values, expected {}", values.size(), size_);
  }
  if (!owner) return InvalidArgument("robust: a kept update needs an owner");
  kept_.push_back({std::move(owner), values, false});
  return Status::Ok();
}

size_t KeptUpdates::copied_floats() const {
  size_t n = 0;
  for (const Kept& k : kept_) n += k.copied ? k.values.size() : 0;
  return n;
}

Status KeptUpdates::Read(size_t update, size_t offset, std::span<float> out) const {
  if (update >= count()) return InvalidArgument("robust: update {} of {}", update, count());
  if (offset > size_ || out.size() > size_ - offset) {
    return InvalidArgument("robust: values [{}, {}) outside an update of {}", offset, offset + out.size(), size_);
  }
  std::copy_n(kept_[update].values.begin() + ptrdiff_t(offset), out.size(), out.begin());
  return Status::Ok();
}

namespace {

Status CheckShape(const char* rule, const UpdateSource& updates, std::span<float> out, size_t block) {
  if (updates.count() == 0) return FailedPrecondition("robust: {}: no updates", rule);
  if (out.size() != updates.size()) {
    return InvalidArgument("robust: {}: output has {} values but the updates have {}", rule, out.size(),
                           updates.size());
  }
  if (block == 0) return InvalidArgument("robust: {}: block must be >= 1", rule);
  return Status::Ok();
}

// Calls fn(offset, width, values) for each block of coordinates, values
// holding update i's block at [i·width, (i+1)·width). Reads every update once.
template <typename Fn>
Status ForEachBlock(const UpdateSource& updates, size_t block, Fn fn) {
  const size_t n = updates.count(), d = updates.size();
  std::vector<float> values(n * std::min(block, d));
  for (size_t offset = 0; offset < d; offset += block) {
    const size_t width = std::min(block, d - offset);
    for (size_t i = 0; i < n; ++i) {
      ESTUARY_RETURN_IF_ERROR(updates.Read(i, offset, std::span<float>(values.data() + i * width, width)));
    }
    fn(offset, width, std::span<const float>(values.data(), n * width));
  }
  return Status::Ok();
}

// The median of sorted values, in double: the middle one, or the mean of the two.
double SortedMedian(std::span<const double> sorted) {
  const size_t n = sorted.size();
  return n % 2 == 1 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
}

// Scores over `among` with max(n - f - 2, 0) neighbours each; no requirement checked.
std::vector<double> Scores(std::span<const double> distances, size_t total, size_t f, std::span<const size_t> among) {
  const size_t n = among.size();
  const size_t neighbours = n > f + 2 ? n - f - 2 : 0;
  std::vector<double> scores(n, 0.0), row;
  for (size_t a = 0; a < n; ++a) {
    row.clear();
    for (size_t b = 0; b < n; ++b) {
      if (b != a) row.push_back(distances[among[a] * total + among[b]]);
    }
    std::partial_sort(row.begin(), row.begin() + ptrdiff_t(neighbours), row.end());
    // Ascending, so the sum does not depend on the order of `among`.
    for (size_t k = 0; k < neighbours; ++k) scores[a] += row[k];
  }
  return scores;
}

// Positions 0..n-1 by ascending score, ties to the lower position.
std::vector<size_t> ByScore(const std::vector<double>& scores) {
  std::vector<size_t> order(scores.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return scores[a] < scores[b]; });
  return order;
}

Status CheckKrum(const char* rule, size_t n, size_t f, size_t needed_per_f) {
  if (n < needed_per_f * f + 3) {
    return FailedPrecondition("robust: {} needs n >= {}f + 3 updates: got n = {} with f = {}", rule, needed_per_f, n,
                              f);
  }
  return Status::Ok();
}

// The unweighted mean of the chosen updates, block by block.
Status MeanOf(const UpdateSource& updates, std::span<const size_t> chosen, std::span<float> out, size_t block) {
  const size_t d = updates.size();
  std::vector<float> values(std::min(block, d));
  std::vector<double> sums(values.size());
  for (size_t offset = 0; offset < d; offset += block) {
    const size_t width = std::min(block, d - offset);
    std::fill_n(sums.begin(), width, 0.0);
    for (size_t i : chosen) {
      ESTUARY_RETURN_IF_ERROR(updates.Read(i, offset, std::span<float>(values.data(), width)));
      for (size_t j = 0; j < width; ++j) sums[j] += values[j];
    }
    for (size_t j = 0; j < width; ++j) out[offset + j] = float(sums[j] / double(chosen.size()));
  }
  return Status::Ok();
}

}  // namespace

namespace {

// A block of n updates' rows (update i at values[i·width...]) as columns
// (coordinate j at columns[j·n...]), tile by tile: the rule then walks each
// coordinate's n values contiguously instead of striding a row apart.
void Transpose(std::span<const float> values, size_t n, size_t width, std::vector<float>& columns) {
  constexpr size_t kTile = 64;
  columns.resize(n * width);
  for (size_t j0 = 0; j0 < width; j0 += kTile) {
    const size_t j1 = std::min(width, j0 + kTile);
    for (size_t i = 0; i < n; ++i) {
      const float* row = values.data() + i * width;
      for (size_t j = j0; j < j1; ++j) columns[j * n + i] = row[j];
    }
  }
}

}  // namespace

Status CoordinateMedian(const UpdateSource& updates, std::span<float> out, size_t block) {
  ESTUARY_RETURN_IF_ERROR(CheckShape("median", updates, out, block));
  const size_t n = updates.count(), k = n / 2;
  std::vector<float> columns;
  return ForEachBlock(updates, block, [&](size_t offset, size_t width, std::span<const float> values) {
    Transpose(values, n, width, columns);
    for (size_t j = 0; j < width; ++j) {
      // A selection, not a sort: the k-th smallest, and for an even count
      // the largest of those below it, are the sorted column's middle two.
      float* column = columns.data() + j * n;
      std::nth_element(column, column + k, column + n);
      const double upper = column[k];
      out[offset + j] = n % 2 == 1 ? float(upper) : float((double(*std::max_element(column, column + k)) + upper) / 2);
    }
  });
}

Status TrimmedMean(const UpdateSource& updates, double beta, std::span<float> out, size_t block) {
  ESTUARY_RETURN_IF_ERROR(CheckShape("trimmed-mean", updates, out, block));
  if (!(beta >= 0 && beta < 0.5)) return InvalidArgument("robust: trimmed-mean: trim β = {} must be in [0, 0.5)", beta);
  const size_t n = updates.count();
  const size_t trim = size_t(std::floor(beta * double(n)));
  if (n <= 2 * trim) {
    return FailedPrecondition("robust: trimmed-mean with β = {} trims {} from each end of {} updates: none is left",
                              beta, trim, n);
  }
  std::vector<float> columns;
  return ForEachBlock(updates, block, [&](size_t offset, size_t width, std::span<const float> values) {
    Transpose(values, n, width, columns);
    for (size_t j = 0; j < width; ++j) {
      float* column = columns.data() + j * n;
      std::sort(column, column + n);  // summed in sorted order, as the oracle sums
      double sum = 0;
      for (size_t i = trim; i < n - trim; ++i) sum += column[i];
      out[offset + j] = float(sum / double(n - 2 * trim));
    }
  });
}

Result<std::vector<double>> PairwiseSquaredDistances(const UpdateSource& updates, size_t block) {
  if (block == 0) return InvalidArgument("robust: block must be >= 1");
  const size_t n = updates.count();
  std::vector<double> distances(n * n, 0.0);
  // Columns a tile at a time, so that the n rows' tile stays in cache while
  // every pair reads it; eight partial sums per pair, so that the loop
  // vectorises (one running sum is one dependent add per element).
  constexpr size_t kTile = 1024, kLanes = 8;
  ESTUARY_RETURN_IF_ERROR(ForEachBlock(updates, block, [&](size_t, size_t width, std::span<const float> values) {
    for (size_t j0 = 0; j0 < width; j0 += kTile) {
      const size_t j1 = std::min(width, j0 + kTile), whole = j0 + (j1 - j0) / kLanes * kLanes;
      for (size_t a = 0; a < n; ++a) {
        const float* x = values.data() + a * width;
        for (size_t b = a + 1; b < n; ++b) {
          const float* y = values.data() + b * width;
          double lanes[kLanes] = {};
          for (size_t j = j0; j < whole; j += kLanes) {
            for (size_t k = 0; k < kLanes; ++k) {
              const double diff = double(x[j + k]) - double(y[j + k]);
              lanes[k] += diff * diff;
            }
          }
          double sum = 0;
          for (size_t j = whole; j < j1; ++j) {
            const double diff = double(x[j]) - double(y[j]);
            sum += diff * diff;
          }
          for (double lane : lanes) sum += lane;
          distances[a * n + b] += sum;
        }
      }
    }
  }));
  for (size_t a = 0; a < n; ++a) {
    for (size_t b = a + 1; b < n; ++b) distances[b * n + a] = distances[a * n + b];
  }
  return distances;
}

Result<std::vector<double>> KrumScores(std::span<const double> distances, size_t total, size_t f,
                                       std::span<const size_t> among) {
  if (distances.size() != total * total) {
    return InvalidArgument("robust: krum: {} distances for {} updates (needs {})", distances.size(), total,
                           total * total);
  }
  std::vector<size_t> all;
  if (among.empty()) {
    all.resize(total);
    std::iota(all.begin(), all.end(), 0);
    among = all;
  }
  for (size_t i : among) {
    if (i >= total) return InvalidArgument("robust: krum: update {} of {}", i, total);
  }
  ESTUARY_RETURN_IF_ERROR(CheckKrum("krum", among.size(), f, 2));
  return Scores(distances, total, f, among);
}

Result<std::vector<size_t>> KrumSelect(const UpdateSource& updates, size_t f, size_t m, size_t block) {
  const size_t n = updates.count();
  ESTUARY_RETURN_IF_ERROR(CheckKrum(m == 1 ? "krum" : "multi-krum", n, f, 2));
  if (m < 1 || m > n - f) {
    return InvalidArgument("robust: multi-krum selects m in [1, n - f] = [1, {}] updates, got m = {}", n - f, m);
  }
  ESTUARY_ASSIGN_OR_RETURN(const std::vector<double> distances, PairwiseSquaredDistances(updates, block));
  ESTUARY_ASSIGN_OR_RETURN(const std::vector<double> scores, KrumScores(distances, n, f));
  std::vector<size_t> order = ByScore(scores);
  order.resize(m);
  return order;
}

Result<std::vector<size_t>> MultiKrum(const UpdateSource& updates, size_t f, size_t m, std::span<float> out,
                                      size_t block) {
  ESTUARY_RETURN_IF_ERROR(CheckShape(m == 1 ? "krum" : "multi-krum", updates, out, block));
  ESTUARY_ASSIGN_OR_RETURN(const std::vector<size_t> chosen, KrumSelect(updates, f, m, block));
  ESTUARY_RETURN_IF_ERROR(MeanOf(updates, chosen, out, block));
  return chosen;
}

Result<std::vector<size_t>> Bulyan(const UpdateSource& updates, size_t f, std::span<float> out, size_t block) {
  ESTUARY_RETURN_IF_ERROR(CheckShape("bulyan", updates, out, block));
  const size_t n = updates.count();
  ESTUARY_RETURN_IF_ERROR(CheckKrum("bulyan", n, f, 4));
  const size_t theta = n - 2 * f, beta = theta - 2 * f;
  ESTUARY_ASSIGN_OR_RETURN(const std::vector<double> distances, PairwiseSquaredDistances(updates, block));
  std::vector<size_t> remaining(n), selected;
  std::iota(remaining.begin(), remaining.end(), 0);
  while (selected.size() < theta) {
    const std::vector<double> scores = Scores(distances, n, f, remaining);
    const size_t best = ByScore(scores).front();
    selected.push_back(remaining[best]);
    remaining.erase(remaining.begin() + ptrdiff_t(best));
  }
  // Per coordinate: the β selected values closest to their median, in the
  // order of their distance to it (ties: the earlier selected), summed in that order.
  const size_t d = updates.size();
  std::vector<float> values(theta * std::min(block, d));
  std::vector<float> columns;
  std::vector<double> column(theta), sorted(theta);
  std::vector<size_t> order(theta);
  for (size_t offset = 0; offset < d; offset += block) {
    const size_t width = std::min(block, d - offset);
    for (size_t s = 0; s < theta; ++s) {
      ESTUARY_RETURN_IF_ERROR(updates.Read(selected[s], offset, std::span<float>(values.data() + s * width, width)));
    }
    Transpose(std::span<const float>(values.data(), theta * width), theta, width, columns);
    for (size_t j = 0; j < width; ++j) {
      for (size_t s = 0; s < theta; ++s) column[s] = columns[j * theta + s];
      sorted = column;
      std::sort(sorted.begin(), sorted.end());
      const double median = SortedMedian(sorted);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        return std::abs(column[a] - median) < std::abs(column[b] - median);
      });
      double sum = 0;
      for (size_t k = 0; k < beta; ++k) sum += column[order[k]];
      out[offset + j] = float(sum / double(beta));
    }
  }
  return selected;
}

}  // namespace estuary::aggregation
