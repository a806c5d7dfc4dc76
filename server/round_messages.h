// The messages the Coordinator sends, built from what it knows: the round's
// record, the published model and the config. Keeping the protobuf setters
// here leaves the Coordinator's handlers to say what happens, not how a
// message is laid out.
#pragma once

#include <cstdint>
#include <string>

#include "base/manifest.h"
#include "base/status.h"
#include "estuary.pb.h"
#include "server/config.h"
#include "server/global_model.h"
#include "server/store.h"

namespace estuary::server {

// The reply to a Hello: the name the certificate gives the client, and the
// frame size, chunk size and heartbeat the server wants.
v1::Envelope WelcomeMessage(const std::string& client, const ServerConfig& config);
// To a client that arrives after the last round: there is nothing left to train.
v1::Envelope FederationCompleteMessage(uint64_t rounds, const GlobalModel& model);
// Round `round` begins from `model`: the federation's task and the deadline.
// The download fields are ModelDistribution::Offer's to set.
v1::Envelope RoundStartMessage(uint64_t round, const GlobalModel& model, const Manifest& manifest,
                               const v1::TaskConfig& task, int64_t deadline_unix_ms);
// The answer to a committed update: folded, or why not.
v1::Envelope UpdateAckMessage(uint64_t round, const Status& folded);
// The round `record` describes committed (its model_version, global_checksum
// and metrics filled in), after `seconds`.
v1::Envelope RoundCommittedMessage(const RoundRecord& record, double seconds, uint64_t bytes_per_update,
                                   uint64_t merge_bytes_down, bool federation_complete);
// The round failed for `reason`; the global model is still `model`.
v1::Envelope RoundFailedMessage(const RoundRecord& record, const GlobalModel& model, const std::string& reason);

}  // namespace estuary::server
