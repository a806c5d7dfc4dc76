// What the operator sees: `estuary-server rounds list | rounds show N | clients | events`.
//
// Each function renders from the Store into *out, as an aligned text table
// or, with json, as one JSON document with the same fields (numbers as
// numbers, null where a metric is missing).
#pragma once

#include <filesystem>
#include <string>

#include "server/store.h"

namespace estuary::server {

Status ListRounds(Store& store, bool json, std::string* out);
// NotFound naming the round if it is not in the log.
Status ShowRound(Store& store, uint64_t round, bool json, std::string* out);
Status ListClients(Store& store, bool json, std::string* out);
// The last `limit` events (refused handshakes, rejected frames, revoked
// certificates), oldest first.
Status ListEvents(Store& store, int limit, bool json, std::string* out);
// `estuary-server certs list`: each certificate of a CA directory, its
// serial, expiry and state (crypto::ListCertificates).
Status ListCertificates(const std::filesystem::path& dir, bool json, std::string* out);

}  // namespace estuary::server
