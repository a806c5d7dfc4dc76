// ModelDistribution: the published global model, and what of it each site
// selected for a round downloads, and when.
//
// It holds the current global model and the one before it, shared with the
// sessions that stream them, never copied per client. A site that already
// holds the current version gets nothing; a site that kept exactly the
// previous version (its Hello said keeps_model, with that version and
// checksum) gets a patch (proto/model_patch.h): the tensors that changed, and
// those that changed by a low-rank product as their factors; every other site
// gets the whole model. At most kConcurrentDownloads stream at once, in the
// order the sites were offered, so the first sites start training while the
// last still download instead of all of them finishing together. Runs on the
// I/O thread.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "aggregation/strategy.h"
#include "base/manifest.h"
#include "estuary.pb.h"
#include "proto/model_patch.h"
#include "server/client_session.h"
#include "server/global_model.h"

namespace estuary::server {

class ModelDistribution {
 public:
  static constexpr uint32_t kConcurrentDownloads = 2;

  // The model a server starts from (new, or recovered): there is no previous
  // version to patch from.
  void Reset(Manifest manifest, GlobalModel current);
  // A committed round's model. The current one becomes the previous; the
  // patch from it is every tensor that differs, those in `low_rank`
  // (Strategy::low_rank_changes) as their factors.
  void Publish(GlobalModel next, std::vector<aggregation::LowRankChange> low_rank);

  const Manifest& manifest() const { return manifest_; }
  const GlobalModel& current() const { return current_; }
  // Empty when there is nothing to patch: no previous version, or a model
  // that changed everywhere.
  const proto::ModelPatch& patch() const { return patch_; }

  // Which version the site says it holds, and whether it keeps its models.
  void OnHello(const std::string& name, const v1::Hello& hello);
  // Round `round` begins: downloads queued or running for an earlier
  // attempt no longer count.
  void BeginRound(uint64_t round);
  // Sets the model fields of `start` for `session` (model_follows, the patch,
  // patch_base_version), records that the site holds the current version
  // from now on, and queues its download. Returns the bytes it downloads.
  uint64_t Offer(const std::shared_ptr<ClientSession>& session, v1::RoundStart* start);
  // Starts queued downloads while fewer than kConcurrentDownloads stream.
  void StreamQueued();

 private:
  struct Held {
    uint64_t version = 0;
    std::string checksum;
  };
  struct Download {
    std::weak_ptr<ClientSession> session;
    bool patch = false;
  };

  void FindChangedRanges();

  Manifest manifest_;
  GlobalModel current_;
  GlobalModel previous_;
  proto::ModelPatch patch_;  // previous_ to current_
  // Every low-rank change's u then v: the stream's tail after the ranges.
  std::shared_ptr<const std::vector<float>> factors_;
  std::map<std::string, Held> held_;
  std::set<std::string> keeps_model_;

  uint64_t round_ = 0;
  uint64_t attempt_ = 0;  // a retried round reuses its number, not its attempt
  std::deque<Download> queue_;
  uint32_t streaming_ = 0;
};

}  // namespace estuary::server
