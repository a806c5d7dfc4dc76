// estuary-sim --secagg --dropout P in loopback mode: the sites' agents close
// their connections at the stage the seeded draw of the in-process
// simulation (DrawSecAggDropouts, secagg_round.h) gives their protocol id in
// that round, and the server's SecAgg+ carries on without them, as it would
// for sites that died there. A dropped site reconnects at once (its backoff
// starts at 10 ms in loopback mode), and the server, which opens a round only
// once every site is connected (--min-clients), samples the next round from
// the same population without waiting for it.
//
// The ledger keeps what the sites were told, per round and stage, so the
// report's counts (read from the server's round log) can be cross-checked
// against the draw.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>

#include "client/agent.h"
#include "server/store.h"
#include "simulations/secagg_round.h"

namespace estuary::simulations {

// Dropouts by SecAggDropStage − 1, per round: what the sites were told to do.
using SecAggDropLedger = std::map<uint64_t, std::array<uint64_t, kSecAggDropStages>>;

// The hook for client::AgentOptions::secagg_drop: site `site` of `sites` in
// `round` stops where DrawSecAggDropouts(dropout, sites, seed, round) says,
// counted in `ledger` (shared by all the sites' hooks; called on the agents'
// one I/O thread, so it needs no lock).
std::function<client::SecAggDrop(uint64_t, uint32_t, uint32_t)> SecAggDropHook(
    double dropout, uint64_t seed, std::shared_ptr<SecAggDropLedger> ledger);

// The round log's dropouts per stage of the server's protocol
// (RoundSecAgg::kStages) as the report's four: a site gone in the
// consistency check or the unmasking stopped after its masked input.
std::vector<uint64_t> DropoutsByDrawnStage(const server::RoundSecAgg& logged);

// The round log's counts against the draw's, for round `round`: one line
// naming both when they differ (a site dropped that was not drawn to: its
// connection failed, or the server timed it out), nullopt when they agree.
std::optional<std::string> CompareWithDraw(uint64_t round, const std::vector<uint64_t>& logged,
                                           const SecAggDropLedger& ledger);

}  // namespace estuary::simulations
