// One round's SecAgg+ on the server: what the Coordinator keeps while it
// relays the protocol's five stages between the selected sites' sessions
// (coordinator_secagg.cc). Touched only on the Coordinator's strand.
//
// The sampled sites are protocol ids 0..n−1 in sampling order. A stage waits
// for an answer from every site it opened for (`waiting`); one whose session
// closes, or whose message is refused, is gone and counts as a dropout of the
// stage it was waiting in; one silent at the stage's deadline likewise. The
// stage closes when nobody is left waiting, through SecAggServer::Close*,
// whose threshold refusal fails the round.
//
// The masked inputs stream into the SecAggServer's one ring sum, each chunk
// added as it arrives; a site takes one of the Coordinator's staging slots
// from its opening chunk (secagg::MaskedBeginMessage) to its SecAggMaskedDone (the others wait,
// paused, as plain uploads do), and the slot holds a copy of what the site
// has added so far (StagingSlots::Journal). A site that stops partway is
// withdrawn from the sum with that copy (SecAggServer::WithdrawMaskedInput)
// and its slot freed. Memory: one sum, and at most staging_slots partial
// inputs, each in memory up to staging_memory_bytes and in a spill file beyond.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "privacy/distributed_dp.h"
#include "secagg/quantize.h"
#include "secagg/server.h"
#include "server/store.h"

namespace estuary::server {

struct SecAggState {
  enum Stage { kAdvertise = 0, kShare = 1, kMasked = 2, kConsistency = 3, kUnmask = 4, kDone = 5 };

  explicit SecAggState(secagg::SecAggServer s) : server(std::move(s)) {}

  secagg::SecAggServer server;
  secagg::QuantizationConfig quantization;
  Stage stage = kAdvertise;
  std::map<std::string, uint32_t> ids;  // by site name
  std::vector<std::string> names;       // by id
  std::vector<uint64_t> weights;        // by id: the examples its Hello claimed (distributed DP: 1 each)
  std::vector<uint64_t> examples;       // by id: the examples its Hello claimed, for the round log
  std::set<uint32_t> waiting;           // the stage's sites that have not answered yet
  std::set<uint32_t> gone;              // lost or refused: silent from then on
  std::set<uint32_t> begun;             // opened its masked input: queued for a slot, or streaming
  std::vector<uint32_t> chunk;          // the arriving chunk's elements, decoded
  // By id: the signature and certificate its advertised keys came with, relayed beside them.
  std::map<uint32_t, std::pair<std::string, std::string>> signed_keys;
  // A lora federation's: the global adapter's tensors in the upload layout,
  // added back to the mean movement the protocol sums. Empty otherwise.
  std::vector<float> lora_reference;
  RoundSecAgg record;
  // Distributed DP: the round's plan (privacy/distributed_dp.h); none otherwise.
  std::optional<privacy::DistributedDpPlan> dp;
  uint32_t included = 0;  // the inputs the unmasked sum held
};

}  // namespace estuary::server
