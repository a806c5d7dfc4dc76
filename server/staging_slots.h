// StagingSlots: which uploads may be staged now, so that server memory stays
// O(slots × model) however many clients upload at once.
//
// An upload holds one of `slots` slots from Begin until it is released
// (rejected, dropped, late) or, once committed, until its fold is done. A
// client that begins while every slot is taken is paused (its chunks wait in
// the socket) and queued; Grant() gives freed slots to the queue in the order
// it was joined, staging each upload and resuming its session. Uploads are
// known by client name, one per client. Runs on the I/O thread.
//
// A secure-aggregation round's masked inputs take the same slots
// (BeginJournal): each arriving chunk goes into the round's one ring sum, and
// the slot holds the site's copy of what it added (a SpillBuffer, in memory up
// to the same budget) until its input is complete, so that a site that
// stops partway can be subtracted again (server/secagg_state.h).
#pragma once

#include <cstdint>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "base/manifest.h"
#include "base/status.h"
#include "server/client_session.h"
#include "server/spill_buffer.h"
#include "server/staging.h"

namespace estuary::server {

class StagingSlots {
 public:
  // Each upload is staged in memory up to `memory_budget` bytes, beyond it
  // in a file under `spill_dir` (StagedUpdate).
  StagingSlots(uint32_t slots, uint64_t memory_budget, std::filesystem::path spill_dir);

  // Stages `session`'s upload of `layout` if a slot is free, else pauses the
  // session and queues it. Fails, holding no slot, when the staging area
  // cannot be created.
  Status Begin(const std::shared_ptr<ClientSession>& session, const Manifest& layout);
  // The same for a secure-aggregation input of `bytes`: its undo copy.
  Status BeginJournal(const std::shared_ptr<ClientSession>& session, uint64_t bytes);
  // `name`'s undo copy; null when none is held (not begun, or queued).
  SpillBuffer* Journal(const std::string& name) const;
  // The upload being staged for `name`; null when none is (not begun,
  // queued, or handed to its fold).
  StagedUpdate* Staged(const std::string& name) const;
  bool Queued(const std::string& name) const;
  // Hands `name`'s committed upload to its fold; the slot stays taken until
  // FoldDone().
  std::shared_ptr<StagedUpdate> TakeForFold(const std::string& name);
  void FoldDone();
  // Discards `name`'s staged upload, unread, or its place in the queue.
  void Release(const std::string& name);
  // Grants free slots to the queue in order. Returns the sessions whose
  // staging area could not be created, with why: they hold no slot, and the
  // caller refuses their upload.
  std::vector<std::pair<std::shared_ptr<ClientSession>, Status>> Grant();
  // A new round: the queue and any staged upload are dropped; folds still
  // running keep their slots.
  void Reset();

  uint32_t in_use() const { return uint32_t(staged_.size() + journals_.size()) + folding_; }

 private:
  struct Waiting {
    std::string name;
    std::weak_ptr<ClientSession> session;
    Manifest layout;
    uint64_t journal_bytes = 0;  // > 0: a secure-aggregation input's undo copy, not an upload
  };

  Result<std::unique_ptr<StagedUpdate>> Stage(const Manifest& layout) const;
  // Stages `next` (an upload or a journal) into its slot.
  Status StageWaiting(const Waiting& next);

  const uint32_t slots_;
  const uint64_t memory_budget_;
  const std::filesystem::path spill_dir_;
  std::map<std::string, std::unique_ptr<StagedUpdate>> staged_;
  std::map<std::string, std::unique_ptr<SpillBuffer>> journals_;
  uint32_t folding_ = 0;
  std::deque<Waiting> queue_;
};

}  // namespace estuary::server
