#include "proto/model_patch.h"

#include <fmt/format.h>

#include <string>

namespace estuary::proto {

uint64_t ModelPatch::range_elements() const {
  uint64_t n = 0;
  for (const auto& [offset, count] : ranges) n += count;
  return n;
}

uint64_t ModelPatch::factor_count() const {
  uint64_t n = 0;
  for (const LowRankPatch& change : low_rank) n += change.factor_count();
  return n;
}

std::vector<std::pair<uint64_t, uint64_t>> ModelPatch::ByteRanges(uint64_t total_elements) const {
  std::vector<std::pair<uint64_t, uint64_t>> bytes;
  for (const auto& [offset, count] : ranges) bytes.emplace_back(offset * sizeof(float), (offset + count) * sizeof(float));
  if (const uint64_t factors = factor_count(); factors > 0) {
    bytes.emplace_back(total_elements * sizeof(float), (total_elements + factors) * sizeof(float));
  }
  return bytes;
}

void WriteModelPatch(const ModelPatch& patch, v1::RoundStart* start) {
  start->clear_patch();
  start->clear_low_rank();
  for (const auto& [offset, count] : patch.ranges) {
    auto* range = start->add_patch();
    range->set_offset(offset);
    range->set_count(count);
  }
  for (const LowRankPatch& change : patch.low_rank) {
    auto* factors = start->add_low_rank();
    factors->set_offset(change.offset);
    factors->set_rows(change.rows);
    factors->set_cols(change.cols);
    factors->set_rank(change.rank);
  }
}

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
    patch.ranges.emplace_back(range.offset(), range.count());
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
    for (const auto& [begin, count] : patch.ranges) overlaps = overlaps || (begin < offset + n && offset < begin + count);
    if (offset < end || overlaps) return ProtocolError("{}: is out of order or inside a patch range", what);
    end = offset + n;
    patch.low_rank.push_back({.offset = offset, .rows = rows, .cols = cols, .rank = rank});
  }
  return patch;
}

}  // namespace estuary::proto
