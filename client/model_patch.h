// ModelPatch: what a RoundStart asks of a client that holds the previous
// global model (proto/estuary.proto, RoundStart.patch and .low_rank): the
// byte ranges of the buffer that follow as ModelChunks, and the tensors that
// changed by a low-rank product, whose factors follow past the buffer's end
// and which the client adds to the tensors it holds
// (models::LowRankMatrix::AddTo).
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

#include "base/status.h"
#include "estuary.pb.h"
#include "models/low_rank.h"
#include "models/tensor.h"

namespace estuary::client {

struct ModelPatch {
  // [begin, end) in bytes: the dense ranges, then (with low-rank changes)
  // the factors' range past the buffer's end.
  std::vector<std::pair<uint64_t, uint64_t>> byte_ranges;
  // Offset (elements) and shape of each low-rank change; u and v are empty
  // until their factors arrive.
  std::vector<std::pair<uint64_t, models::LowRankMatrix>> low_rank;
  uint64_t factor_count = 0;  // floats past the buffer's end
};

Result<ModelPatch> ReadModelPatch(const v1::RoundStart& start, const Manifest& manifest);

}  // namespace estuary::client
