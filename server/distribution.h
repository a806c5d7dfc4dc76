// ModelDistribution: the published global model, and what of it each site
// selected for a round downloads, and when.
//
// It holds the current global model and the one before it, shared with the
// sessions that stream them, never copied per client. A site that already
// holds the current version gets nothing; a site that kept exactly the
// previous version (its Hello said keeps_model, with that version and
// checksum) gets a patch (proto/model_patch.h): the tensors that changed, and
// those that changed by a low-rank product as their factors; every other site
// gets the whole model, except in a federation on a Hugging Face base, where
// every site holds the base and gets the tensors that differ from it
// (SetHeldBase). At most kConcurrentDownloads stream at once, in the
// order the sites were offered, so the first sites start training while the
// last still download instead of all of them finishing together; a download
// that has held its place for `slot_timeout` gives it to the next one and
// goes on beside it, so sites that read slowly, or not at all, cannot hold
// back the rest (a site that reads nothing is cut off by its session's write
// deadline).
//
// Under SCAFFOLD (SetControl) every selected site also downloads the
// server's control variate c, past the model's end (RoundStart.
// control_follows), whatever of the model it holds: c changes every round.
//
// What a site holds is what it said in its Hello, and a version it was sent
// only once it has confirmed it: its UpdateBegin for the round (it trains
// only on a model whose checksum it verified) while it keeps its models. A
// download written to the socket proves nothing: a retried round sends the
// model again to every site that did not confirm it. Runs on the
// Coordinator's strand; its timers come from the Clock.
#pragma once

#include <chrono>
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
#include "server/clock.h"
#include "server/global_model.h"

namespace estuary::server {

class ModelDistribution {
 public:
  static constexpr uint32_t kConcurrentDownloads = 2;

  ModelDistribution(Clock& clock, std::chrono::steady_clock::duration slot_timeout)
      : clock_(clock), slot_timeout_(slot_timeout) {}

  // The model a server starts from (new, or recovered): there is no previous
  // version to patch from.
  void Reset(Manifest manifest, GlobalModel current);
  // A federation on a Hugging Face base (aggregation::Federation::held_base):
  // every site holds `held` itself, so a site that holds no earlier version
  // gets a patch on it (RoundStart.patch_on_base: the tensors that differ
  // from it, whole) instead of the whole model: the base is never sent.
  // Call before Reset.
  void SetHeldBase(std::shared_ptr<const std::vector<float>> held) { held_base_ = std::move(held); }
  // A committed round's model. The current one becomes the previous; the
  // patch from it is every tensor that differs, those in `low_rank`
  // (Strategy::low_rank_changes) as their factors.
  void Publish(GlobalModel next, std::vector<aggregation::LowRankChange> low_rank);
  // SCAFFOLD: c, of the model's size, that every offer from now on sends
  // after the model (Aggregator::Finished::control); null: none.
  void SetControl(std::shared_ptr<const std::vector<float>> control);

  const Manifest& manifest() const { return manifest_; }
  const GlobalModel& current() const { return current_; }
  // Empty when there is nothing to patch: no previous version, or a model
  // that changed everywhere.
  const proto::ModelPatch& patch() const { return patch_; }

  // Which version the site says it holds, and whether it keeps its models.
  void OnHello(const std::string& name, const v1::Hello& hello);
  // Round `round` begins: downloads queued or running for an earlier
  // attempt no longer count, and what was offered then is forgotten unless
  // confirmed. Asynchronous rounds call it once: their offers are each
  // site's own, of the version current when it was offered.
  void BeginRound(uint64_t round);
  // Sets the model fields of `start` for `session` (model_follows, the patch,
  // patch_base_version; control_follows and its checksum unless `start` is
  // evaluate_only) and queues its download, as ModelChunks of start->round().
  // Returns the bytes it downloads.
  uint64_t Offer(const std::shared_ptr<ClientSession>& session, v1::RoundStart* start);
  // The site began its update for this round: it holds what it was offered,
  // and keeps it if its Hello said so.
  void Confirm(const std::string& name);
  // Starts queued downloads while fewer than kConcurrentDownloads stream.
  void StreamQueued();
  // Downloads streaming that hold a place (for tests and logs).
  uint32_t streaming() const { return streaming_; }

 private:
  struct Held {
    uint64_t version = 0;
    std::string checksum;
  };
  enum class Send { kWhole, kPatch, kPatchOnBase, kNone };
  // What was offered, fixed when it was: a version published before the
  // download streams (asynchronous rounds publish while sites download) does
  // not change what this site was told to expect.
  struct Download {
    std::weak_ptr<ClientSession> session;
    uint64_t round = 0;
    std::shared_ptr<const std::vector<float>> values;
    std::vector<std::pair<uint64_t, uint64_t>> bytes;  // empty: the whole model
    std::shared_ptr<const std::vector<float>> tail;
  };
  // A download streaming: until it is written (or its session closes) or
  // its place times out.
  struct Stream {
    std::string name;
    bool holds_place = true;
    std::unique_ptr<Timer> slot_timer;
  };

  void FindChangedRanges();
  // base_patch_: the tensors of current_ that differ from held_base_.
  void FindChangesFromBase();
  // `id`'s download no longer holds a place: the next queued one starts.
  void FreeSlot(uint64_t id);

  Manifest manifest_;
  GlobalModel current_;
  GlobalModel previous_;
  proto::ModelPatch patch_;  // previous_ to current_
  std::shared_ptr<const std::vector<float>> held_base_;
  proto::ModelPatch base_patch_;  // held_base_ to current_
  // Every low-rank change's u then v: the stream's tail after the ranges.
  std::shared_ptr<const std::vector<float>> factors_;
  std::shared_ptr<const std::vector<float>> control_;  // SCAFFOLD's c; null: none
  std::string control_digest_;
  Clock& clock_;
  const std::chrono::steady_clock::duration slot_timeout_;
  std::map<std::string, Held> held_;     // said in a Hello, or confirmed
  std::map<std::string, Held> offered_;  // this attempt's offers, until confirmed
  std::set<std::string> keeps_model_;

  uint64_t round_ = 0;
  std::deque<Download> queue_;
  std::map<uint64_t, Stream> streams_;  // by id; only this attempt's
  uint64_t next_stream_ = 0;
  uint32_t streaming_ = 0;              // streams_ that hold a place
};

}  // namespace estuary::server
