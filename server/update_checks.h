// What an announced update (UpdateBegin) must be before a byte of it is
// staged. Whether its round is open and its sender selected is the
// Coordinator's to say; this checks the announcement itself: the
// federation's update kind, an example count within the federation's
// max_examples, a loss a training can report (finite, not negative: the
// losses here are cross-entropies), a training time that is a time, and a
// layout that is the global model's (full updates) or the federation's
// adapters (lora: aggregation::CheckLoraUpload). A failure is one line that
// the sender gets back as an Error BAD_MESSAGE.
#pragma once

#include <optional>
#include <string_view>

#include "aggregation/lora_strategy.h"
#include "base/manifest.h"
#include "base/status.h"
#include "estuary.pb.h"
#include "federation.pb.h"

namespace estuary::server {

// Returns the upload's layout. `lora` is set in a federation of update kind
// lora, whose kind is `federation_kind`.
Result<Manifest> CheckUpdateBegin(const v1::UpdateBegin& begin, std::string_view client,
                                  v1::UpdateKind federation_kind, const v1::UpdateLimits& limits,
                                  const Manifest& global,
                                  const std::optional<aggregation::LoraStrategyOptions>& lora);

// What the upload of `layout` stages: `layout`, then under SCAFFOLD
// (`scaffold`: the federation's strategy) the site's control delta Δc_i as a
// tensor "scaffold.control_delta" of as many values, so both share one
// staging area, one checksum and the staging budget (twice the bytes).
// Fails when the announcement's control_follows is not what the strategy
// takes: a SCAFFOLD upload without Δc, or a Δc another strategy would drop.
Result<Manifest> StagedLayout(const v1::UpdateBegin& begin, std::string_view client, const Manifest& layout,
                              bool scaffold);

}  // namespace estuary::server
