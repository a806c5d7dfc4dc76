// A RoundStart as a site reads it (client/agent.cc): its manifest through
// proto::FromProto under the client's limit, its task through
// proto::CheckTask, and a model patch through proto::ReadModelPatch against
// the manifest. A patch accepted must describe a stream that stays inside the
// model and its factors; on a small model the harness applies it the way the
// client does, so a change outside its tensor is an out-of-bounds write.
#include <span>
#include <vector>

#include "fuzz/fuzz_util.h"
#include "fuzz/quiet_protobuf.h"
#include "models/low_rank.h"
#include "proto/model_patch.h"
#include "proto/task.h"
#include "proto/wire.h"

namespace {

constexpr uint64_t kClientMaxElements = uint64_t{1} << 34;  // as client/agent.cc
constexpr uint64_t kApplyUpTo = uint64_t{1} << 16;          // elements of model and factors applied

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace estuary;
  v1::RoundStart start;
  if (!start.ParseFromArray(data, int(size))) return 0;
  if (Status task = proto::CheckTask(start.task()); !task.ok()) fuzz::CheckError(task);
  auto manifest = proto::FromProto(start.manifest(), kClientMaxElements);
  if (!manifest.ok()) {
    fuzz::CheckError(manifest.status());
    return 0;
  }
  fuzz::CheckAcceptedManifest(*manifest, kClientMaxElements);
  const uint64_t total = manifest->total_elements;

  auto patch = proto::ReadModelPatch(start, *manifest);
  if (!patch.ok()) {
    fuzz::CheckError(patch.status());
    return 0;
  }
  uint64_t end = 0;
  for (const auto& [offset, count] : patch->ranges) {
    FUZZ_CHECK(count > 0 && offset >= end && offset <= total && count <= total - offset);
    end = offset + count;
  }
  end = 0;
  for (const proto::LowRankPatch& change : patch->low_rank) {
    const TensorSpec* tensor = nullptr;
    for (const TensorSpec& t : manifest->tensors) {
      if (t.offset == change.offset) tensor = &t;
    }
    FUZZ_CHECK(tensor != nullptr && change.offset >= end);
    FUZZ_CHECK(change.rows == uint64_t(tensor->shape[0]) && change.rows * change.cols == tensor->numel());
    FUZZ_CHECK(change.rank > 0 && change.factor_count() < tensor->numel());
    for (const auto& [offset, count] : patch->ranges) {
      FUZZ_CHECK(offset + count <= change.offset || change.offset + tensor->numel() <= offset);
    }
    end = change.offset + tensor->numel();
  }
  const auto bytes = patch->ByteRanges(total);
  for (size_t i = 0; i < bytes.size(); ++i) {
    FUZZ_CHECK(bytes[i].first < bytes[i].second && (i == 0 || bytes[i - 1].second <= bytes[i].first));
  }
  if (!bytes.empty()) FUZZ_CHECK(bytes.back().second <= (total + patch->factor_count()) * sizeof(float));

  // Applied as the client applies it (Agent::ApplyLowRank), on a model small enough.
  if (total > kApplyUpTo || patch->factor_count() > kApplyUpTo) return 0;
  std::vector<float> model(total, 1.0f), factors(patch->factor_count(), 0.5f);
  const float* at = factors.data();
  for (const proto::LowRankPatch& change : patch->low_rank) {
    models::LowRankMatrix m{.rows = change.rows, .cols = change.cols, .rank = change.rank};
    m.u.assign(at, at + change.rows * change.rank);
    at += m.u.size();
    m.v.assign(at, at + change.rank * change.cols);
    at += m.v.size();
    m.AddTo(std::span<float>(model).subspan(change.offset, change.rows * change.cols));
  }
  FUZZ_CHECK(at == factors.data() + factors.size());
  return 0;
}
