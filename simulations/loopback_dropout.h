// estuary-sim --dropout P in loopback mode: the sites' agents close their
// connections at the stage the seeded draw of the in-process simulation
// gives them in that round, and the server carries on without them, as it
// would for sites that died there:
//   --secagg   DrawSecAggDropouts (secagg_round.h) by protocol id: the
//              server's SecAgg+ goes on with the sites left;
//   otherwise  DrawSiteDropouts (dropout_draw.h) by position in the round's
//              sample: after training or mid-upload, and the server records
//              the site as dropped (and discards its partial upload).
// A dropped site reconnects at once (its backoff starts at 10 ms in loopback
// mode), and the server, which opens a round only once every site is
// connected (--min-clients), samples the next round from the same population
// without waiting for it.
//
// The ledger keeps what the sites were told, per round and stage, so the
// report's counts (read from the server's round log) can be cross-checked
// against the draw.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "client/agent.h"
#include "server/store.h"
#include "simulations/dropout_draw.h"
#include "simulations/secagg_round.h"

namespace estuary::simulations {

// Dropouts by stage − 1, per round: what the sites were told to do
// (kSecAggDropStages or kSiteDropStages counts).
using DropLedger = std::map<uint64_t, std::vector<uint64_t>>;

// The hook for client::AgentOptions::secagg_drop: site `site` of `sites` in
// `round` stops where DrawSecAggDropouts(dropout, sites, seed, round) says,
// counted in `ledger` (shared by all the sites' hooks; called on the agents'
// one I/O thread, so it needs no lock).
std::function<client::SecAggDrop(uint64_t, uint32_t, uint32_t)> SecAggDropHook(
    double dropout, uint64_t seed, std::shared_ptr<DropLedger> ledger);

// The hook for client::AgentOptions::upload_drop: the site named `site`
// stops in `round` where DrawSiteDropouts(dropout, k, seed, round) says for
// its position in the round's sample, which the hook draws as the server
// does (aggregation::SampleClients of `names`, ClientsPerRound(per_round)),
// every site being connected when a round opens; a site not in it never
// drops. Counted in `ledger`, as above.
std::function<client::UploadDrop(uint64_t, const std::string&)> UploadDropHook(
    double dropout, uint64_t seed, std::vector<std::string> names, double per_round,
    std::shared_ptr<DropLedger> ledger);

// The round log's dropouts per stage of the server's protocol
// (RoundSecAgg::kStages) as the report's four: a site gone in the
// consistency check or the unmasking stopped after its masked input.
std::vector<uint64_t> DropoutsByDrawnStage(const server::RoundSecAgg& logged);

// A plain round's dropouts by stage (kSiteDropStages), from its
// participations: "dropped" with an upload begun (server::kLostMidUpload) is
// mid-upload, without one after training.
std::vector<uint64_t> DropoutsByDrawnStage(const std::vector<server::Participation>& logged);

// The round log's counts against the draw's, for round `round`: one line
// naming both when they differ (a site dropped that was not drawn to: its
// connection failed, or the server timed it out), nullopt when they agree.
std::optional<std::string> CompareWithDraw(uint64_t round, const std::vector<uint64_t>& logged,
                                           const DropLedger& ledger);

}  // namespace estuary::simulations
