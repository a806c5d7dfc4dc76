#include "simulations/loopback_dropout.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace estuary::simulations {

std::function<client::SecAggDrop(uint64_t, uint32_t, uint32_t)> SecAggDropHook(
    double dropout, uint64_t seed, std::shared_ptr<SecAggDropLedger> ledger) {
  return [dropout, seed, ledger = std::move(ledger)](uint64_t round, uint32_t site, uint32_t sites) {
    // Drawn again by every site of the round: O(sites) each, and the same stream as inproc's.
    const std::vector<SecAggDropStage> drawn = DrawSecAggDropouts(dropout, sites, seed, round);
    const SecAggDropStage stage = site < drawn.size() ? drawn[site] : SecAggDropStage::kNone;
    if (stage != SecAggDropStage::kNone) ++(*ledger)[round][int(stage) - 1];
    switch (stage) {
      case SecAggDropStage::kNone: return client::SecAggDrop::kNone;
      case SecAggDropStage::kBeforeAdvertise: return client::SecAggDrop::kBeforeAdvertise;
      case SecAggDropStage::kAfterAdvertise: return client::SecAggDrop::kAfterAdvertise;
      case SecAggDropStage::kAfterShare: return client::SecAggDrop::kAfterShare;
      case SecAggDropStage::kAfterMaskedInput: return client::SecAggDrop::kAfterMaskedInput;
    }
    return client::SecAggDrop::kNone;
  };
}

std::vector<uint64_t> DropoutsByDrawnStage(const server::RoundSecAgg& logged) {
  static_assert(server::RoundSecAgg::kStageCount == kSecAggDropStages + 1);
  std::vector<uint64_t> out(kSecAggDropStages, 0);
  for (int i = 0; i < server::RoundSecAgg::kStageCount; ++i) out[std::min(i, kSecAggDropStages - 1)] += logged.dropouts[i];
  return out;
}

std::optional<std::string> CompareWithDraw(uint64_t round, const std::vector<uint64_t>& logged,
                                           const SecAggDropLedger& ledger) {
  std::vector<uint64_t> drawn(kSecAggDropStages, 0);
  if (auto it = ledger.find(round); it != ledger.end()) drawn.assign(it->second.begin(), it->second.end());
  if (logged == drawn) return std::nullopt;
  return fmt::format("sim: round {}: the round log counts dropouts [{}] by stage, the draw [{}]: a site dropped "
                     "that was not drawn to (a lost connection or a stage's deadline; see the server's log)",
                     round, fmt::join(logged, ", "), fmt::join(drawn, ", "));
}

}  // namespace estuary::simulations
