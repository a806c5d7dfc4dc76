// ModelPatch: the part of a global model that a RoundStart sends a client
// holding the previous version (RoundStart.patch and .low_rank in
// estuary.proto). The server writes it and the client reads it through this
// one description, so both walk the same stream.
//
// Two kinds of entries: element ranges of the flat buffer that follow as
// ModelChunks (the tensors that changed), and tensors that changed by a
// low-rank product, whose factors follow past the buffer's end, each change's
// u [rows, rank] then v [rank, cols], fp32, in entry order; the client adds
// u·v to the tensor it holds. ByteRanges() is that stream.
//
// ReadModelPatch checks all of it against the round's manifest before a byte
// is taken: ranges ascending, disjoint and inside the buffer; each low-rank
// change a whole tensor of the manifest of its shape, in ascending order,
// outside the ranges, and smaller as factors than the tensor (which also
// bounds what the client allocates for them). Each failure is one line
// naming the round, the entry and what is wrong with it.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "base/manifest.h"
#include "base/status.h"
#include "estuary.pb.h"

namespace estuary::proto {

// A tensor global[offset, offset + rows·cols) that changed by u·v.
struct LowRankPatch {
  uint64_t offset = 0;  // elements
  uint64_t rows = 0;
  uint64_t cols = 0;
  uint64_t rank = 0;
  uint64_t factor_count() const { return rank * (rows + cols); }
  bool operator==(const LowRankPatch&) const = default;
};

struct ModelPatch {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // elements: (offset, count)
  std::vector<LowRankPatch> low_rank;

  bool empty() const { return ranges.empty() && low_rank.empty(); }
  uint64_t range_elements() const;  // sum of the ranges' counts
  uint64_t factor_count() const;    // floats past the buffer's end
  // The stream in bytes [begin, end) over a model of `total_elements`: each
  // range, then (with low-rank changes) the factors from the buffer's end.
  std::vector<std::pair<uint64_t, uint64_t>> ByteRanges(uint64_t total_elements) const;
};

// Sets start's patch and low_rank to `patch` (clearing what was there).
void WriteModelPatch(const ModelPatch& patch, v1::RoundStart* start);
Result<ModelPatch> ReadModelPatch(const v1::RoundStart& start, const Manifest& manifest);

}  // namespace estuary::proto
