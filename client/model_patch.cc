#include "client/model_patch.h"

#include <fmt/format.h>

#include <string>

namespace estuary::client {

Result<ModelPatch> ReadModelPatch(const v1::RoundStart& start, const Manifest& manifest) {
  const uint64_t total = manifest.total_elements;
  ModelPatch patch;
  uint64_t end = 0;
  for (const auto& range : start.patch()) {
    if (range.count() == 0 || range.offset() < end || range.offset() > total || range.count() > total - range.offset()) {
      return ProtocolError("round {}: patch range {} (+{}) is not ascending within the model's {}", start.round(),
                           range.offset(), range.count(), total);
    }
    end = range.offset() + range.count();
    patch.byte_ranges.emplace_back(range.offset() * sizeof(float), end * sizeof(float));
  }
  end = 0;
  for (const auto& change : start.low_rank()) {
    const uint64_t offset = change.offset(), rows = change.rows(), cols = change.cols(), rank = change.rank();
    const std::string what = fmt::format("round {}: low-rank patch at element {} ({} x {}, rank {})", start.round(),
                                         offset, rows, cols, rank);
    const TensorSpec* tensor = nullptr;
    for (const TensorSpec& spec : manifest.tensors) {
      if (spec.offset == offset) tensor = &spec;
    }
    const uint64_t n = tensor ? tensor->numel() : 0;
    if (!tensor || tensor->shape.empty() || rows != uint64_t(tensor->shape[0]) || rows == 0 || cols != n / rows ||
        rows * cols != n) {
      return ProtocolError("{}: is not a whole tensor of the model, rows by the rest", what);
    }
    // rank (rows + cols) < n, written so that no product can overflow.
    if (rank == 0 || rank > n / (rows + cols) || rank * (rows + cols) >= n) {
      return ProtocolError("{}: is not smaller as factors than the tensor's {} values", what, n);
    }
    bool overlaps = false;
    for (const auto& [begin, stop] : patch.byte_ranges) {
      overlaps = overlaps || (begin < (offset + n) * sizeof(float) && offset * sizeof(float) < stop);
    }
    if (offset < end || overlaps) return ProtocolError("{}: is out of order or inside a patch range", what);
    end = offset + n;
    patch.factor_count += rank * (rows + cols);
    patch.low_rank.push_back({offset, models::LowRankMatrix{.rows = rows, .cols = cols, .rank = rank}});
  }
  if (patch.factor_count > 0) {
    patch.byte_ranges.emplace_back(total * sizeof(float), (total + patch.factor_count) * sizeof(float));
  }
  return patch;
}

}  // namespace estuary::client
