// estuary-sim --dropout P: which of a round's sampled sites drop out, and at
// which stage, drawn from the federation's seed and the round alone, so that
// the in-process run and the loopback run (where each site's agent asks the
// same draw where to close its connection) drop the same sites at the same
// stages.
//
// A site is named by its position in the round's sample (ascending by name:
// aggregation::SampleClients, the server's SecAgg+ protocol ids). Each drops
// with probability `dropout`, at a stage drawn uniformly.
//
// Without secure aggregation a site has two places to stop (SiteDropStage):
// after training (it trains, paying the cost, and never uploads) and
// mid-upload (it closes its connection part-way through streaming its update,
// and the server discards the partial upload). Under --secagg the protocol's
// four stages apply instead (secagg_round.h).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace estuary::simulations {

// Stage per site, 0 (none) or 1..stages, from mt19937_64(MixSeed(MixSeed(seed,
// round), purpose)): per site one draw p (it drops when p < dropout) and one
// uniform stage. With keep_one, when every site was drawn to drop, one chosen
// by the stream's next draw completes instead.
std::vector<int> DrawDropStages(double dropout, uint32_t sites, int stages, uint64_t seed, uint64_t round,
                                std::string_view purpose, bool keep_one);

enum class SiteDropStage { kNone, kAfterTraining, kMidUpload };
constexpr int kSiteDropStages = 2;  // the stages above but kNone, in the report's order

// A round without secure aggregation: DrawDropStages(dropout, sites, 2, seed,
// round, "site dropout", keep_one = true). One site always completes: a round
// folds at least one update (the server's --min-updates 1), and a round that
// failed would be sampled again from another seed by the server
// (Coordinator::DrawSites), which the in-process run does not do.
std::vector<SiteDropStage> DrawSiteDropouts(double dropout, uint32_t sites, uint64_t seed, uint64_t round);

// The counts of `drawn` by stage (kSiteDropStages entries).
std::vector<uint64_t> CountByStage(const std::vector<SiteDropStage>& drawn);

}  // namespace estuary::simulations
