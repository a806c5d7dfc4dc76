#include "simulations/loopback_dropout.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "aggregation/sampling.h"

namespace estuary::simulations {

namespace {

void Count(DropLedger& ledger, uint64_t round, int stages, int stage) {
  std::vector<uint64_t>& counts = ledger[round];
  counts.resize(size_t(stages), 0);
  ++counts[size_t(stage) - 1];
}

}  // namespace

std::function<client::SecAggDrop(uint64_t, uint32_t, uint32_t)> SecAggDropHook(
    double dropout, uint64_t seed, std::shared_ptr<DropLedger> ledger) {
  return [dropout, seed, ledger = std::move(ledger)](uint64_t round, uint32_t site, uint32_t sites) {
    // Drawn again by every site of the round: O(sites) each, and the same stream as inproc's.
    const std::vector<SecAggDropStage> drawn = DrawSecAggDropouts(dropout, sites, seed, round);
    const SecAggDropStage stage = site < drawn.size() ? drawn[site] : SecAggDropStage::kNone;
    if (stage != SecAggDropStage::kNone) Count(*ledger, round, kSecAggDropStages, int(stage));
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

std::function<client::UploadDrop(uint64_t, const std::string&)> UploadDropHook(
    double dropout, uint64_t seed, std::vector<std::string> names, double per_round,
    std::shared_ptr<DropLedger> ledger) {
  // The round's sample and draw, made by the first of its sites to ask (all
  // ask on the one I/O thread).
  // Shared by every copy of the hook (one a site), as are the names.
  struct Drawn {
    std::vector<std::string> names;
    uint64_t round = 0;
    std::vector<std::string> sample;
    std::vector<SiteDropStage> stages;
  };
  auto drawn = std::make_shared<Drawn>(Drawn{.names = std::move(names)});
  return [=, ledger = std::move(ledger)](uint64_t round, const std::string& site) {
    if (drawn->round != round || drawn->sample.empty()) {
      const std::vector<std::string>& names = drawn->names;
      drawn->round = round;
      drawn->sample = aggregation::SampleClients(names, aggregation::ClientsPerRound(per_round, names.size()), seed,
                                                 round);
      drawn->stages = DrawSiteDropouts(dropout, uint32_t(drawn->sample.size()), seed, round);
    }
    const auto at = std::find(drawn->sample.begin(), drawn->sample.end(), site);
    const SiteDropStage stage =
        at == drawn->sample.end() ? SiteDropStage::kNone : drawn->stages[size_t(at - drawn->sample.begin())];
    if (stage != SiteDropStage::kNone) Count(*ledger, round, kSiteDropStages, int(stage));
    switch (stage) {
      case SiteDropStage::kNone: return client::UploadDrop::kNone;
      case SiteDropStage::kAfterTraining: return client::UploadDrop::kAfterTraining;
      case SiteDropStage::kMidUpload: return client::UploadDrop::kMidUpload;
    }
    return client::UploadDrop::kNone;
  };
}

std::vector<uint64_t> DropoutsByDrawnStage(const server::RoundSecAgg& logged) {
  static_assert(server::RoundSecAgg::kStageCount == kSecAggDropStages + 1);
  std::vector<uint64_t> out(kSecAggDropStages, 0);
  for (int i = 0; i < server::RoundSecAgg::kStageCount; ++i) out[std::min(i, kSecAggDropStages - 1)] += logged.dropouts[i];
  return out;
}

std::vector<uint64_t> DropoutsByDrawnStage(const std::vector<server::Participation>& logged) {
  std::vector<uint64_t> out(kSiteDropStages, 0);
  for (const server::Participation& p : logged) {
    if (p.status != "dropped") continue;
    const bool mid_upload = std::string_view(p.detail).starts_with(server::kLostMidUpload);
    ++out[int(mid_upload ? SiteDropStage::kMidUpload : SiteDropStage::kAfterTraining) - 1];
  }
  return out;
}

std::optional<std::string> CompareWithDraw(uint64_t round, const std::vector<uint64_t>& logged,
                                           const DropLedger& ledger) {
  std::vector<uint64_t> drawn(logged.size(), 0);
  if (auto it = ledger.find(round); it != ledger.end()) drawn = it->second;
  if (logged == drawn) return std::nullopt;
  return fmt::format("sim: round {}: the round log counts dropouts [{}] by stage, the draw [{}]: a site dropped "
                     "that was not drawn to (a lost connection or a stage's deadline; see the server's log)",
                     round, fmt::join(logged, ", "), fmt::join(drawn, ", "));
}

}  // namespace estuary::simulations
