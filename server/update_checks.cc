#include "server/update_checks.h"

#include <fmt/format.h>

#include <cmath>

#include "proto/wire.h"

namespace estuary::server {

namespace {

// Far above any cross-entropy a training reports (ln of a 10^6-token
// vocabulary is 13.8), far below what breaks a log's layout or a mean.
constexpr double kLargestLoss = 1e6;
// A round longer than a year is not a measurement.
constexpr double kLongestTraining = 365.0 * 24 * 3600;
// A billion optimizer steps in one round is not a round.
constexpr uint64_t kMostLocalSteps = uint64_t{1} << 30;

}  // namespace

Result<Manifest> CheckUpdateBegin(const v1::UpdateBegin& begin, std::string_view client,
                                  v1::UpdateKind federation_kind, const v1::UpdateLimits& limits,
                                  const Manifest& global,
                                  const std::optional<aggregation::LoraStrategyOptions>& lora) {
  if (begin.kind() != federation_kind) {
    return ProtocolError("update kind {} from {}, but this federation takes {}",
                         begin.kind() == v1::UPDATE_LORA ? "lora" : "full", client, lora ? "lora" : "full");
  }
  if (begin.num_examples() == 0 || begin.num_examples() > (uint64_t{1} << 40)) {
    return ProtocolError("num_examples {} out of range", begin.num_examples());
  }
  if (limits.max_examples() > 0 && begin.num_examples() > limits.max_examples()) {
    return ProtocolError("num_examples {} beyond the federation's max_examples of {}", begin.num_examples(),
                         limits.max_examples());
  }
  if (!std::isfinite(begin.train_loss())) {
    return ProtocolError("train_loss {} is not finite", begin.train_loss());
  }
  if (begin.train_loss() < 0 || begin.train_loss() > kLargestLoss) {
    return ProtocolError("train_loss {} is not a loss (expected one in [0, {:g}])", begin.train_loss(), kLargestLoss);
  }
  if (!(begin.train_seconds() >= 0 && begin.train_seconds() <= kLongestTraining)) {
    return ProtocolError("train_seconds {} is not a training time", begin.train_seconds());
  }
  if (begin.local_steps() > kMostLocalSteps) {
    return ProtocolError("local_steps {} is beyond {}", begin.local_steps(), kMostLocalSteps);
  }
  // ‖a‖₁ ≤ τ / (1 - momentum); a site with momentum 0.999 stays well within.
  if (!(begin.normalizer() >= 0 && begin.normalizer() <= 1e4 * double(begin.local_steps()))) {
    return ProtocolError("normalizer {} is not one of {} local steps (expected one in [0, 1e4 x steps])",
                         begin.normalizer(), begin.local_steps());
  }
  ESTUARY_ASSIGN_OR_RETURN(Manifest layout, proto::FromProto(begin.manifest(), global.total_elements));
  if (lora) {
    // Names, ranks and shapes against the federation's LoRA config, before
    // a byte is staged: a bad adapter never reaches the aggregate.
    ESTUARY_RETURN_IF_ERROR(aggregation::CheckLoraUpload(client, layout, *lora));
  } else if (!(layout == global)) {
    return ProtocolError("update manifest does not match the global model's");
  }
  return layout;
}

Result<Manifest> StagedLayout(const v1::UpdateBegin& begin, std::string_view client, const Manifest& layout,
                              bool scaffold) {
  if (scaffold && !begin.control_follows()) {
    return ProtocolError("update from {} carries no control delta: strategy scaffold needs each site's Δc beside its "
                         "delta (an estuary-client that predates SCAFFOLD over the network?)",
                         client);
  }
  if (!scaffold && begin.control_follows()) {
    return ProtocolError("update from {} carries a control delta, but this federation's strategy is not scaffold",
                         client);
  }
  if (!scaffold) return layout;
  Manifest staged = layout;
  staged.Append("scaffold.control_delta", {int64_t(layout.total_elements)});
  return staged;
}

}  // namespace estuary::server
