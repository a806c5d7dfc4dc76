#include "server/staging_slots.h"

#include <algorithm>

namespace estuary::server {

StagingSlots::StagingSlots(uint32_t slots, uint64_t memory_budget, std::filesystem::path spill_dir)
    : slots_(slots), memory_budget_(memory_budget), spill_dir_(std::move(spill_dir)) {}

Result<std::unique_ptr<StagedUpdate>> StagingSlots::Stage(const Manifest& layout) const {
  return StagedUpdate::Create(layout, memory_budget_, spill_dir_);
}

Status StagingSlots::StageWaiting(const Waiting& next) {
  if (next.journal_bytes > 0) {
    ESTUARY_ASSIGN_OR_RETURN(journals_[next.name],
                             SpillBuffer::Create(next.journal_bytes, memory_budget_, spill_dir_, "secagg staging"));
    return Status::Ok();
  }
  ESTUARY_ASSIGN_OR_RETURN(staged_[next.name], Stage(next.layout));
  return Status::Ok();
}

Status StagingSlots::Begin(const std::shared_ptr<ClientSession>& session, const Manifest& layout) {
  Waiting next{.name = session->name(), .session = session, .layout = layout};
  if (in_use() >= slots_) {
    queue_.push_back(std::move(next));
    session->Pause();  // its chunks wait in the socket until a slot frees
    return Status::Ok();
  }
  return StageWaiting(next);
}

Status StagingSlots::BeginJournal(const std::shared_ptr<ClientSession>& session, uint64_t bytes) {
  Waiting next{.name = session->name(), .session = session, .layout = {}, .journal_bytes = std::max<uint64_t>(bytes, 1)};
  if (in_use() >= slots_) {
    queue_.push_back(std::move(next));
    session->Pause();
    return Status::Ok();
  }
  return StageWaiting(next);
}

SpillBuffer* StagingSlots::Journal(const std::string& name) const {
  auto it = journals_.find(name);
  return it == journals_.end() ? nullptr : it->second.get();
}

StagedUpdate* StagingSlots::Staged(const std::string& name) const {
  auto it = staged_.find(name);
  return it == staged_.end() ? nullptr : it->second.get();
}

bool StagingSlots::Queued(const std::string& name) const {
  return std::any_of(queue_.begin(), queue_.end(), [&](const Waiting& w) { return w.name == name; });
}

std::shared_ptr<StagedUpdate> StagingSlots::TakeForFold(const std::string& name) {
  auto it = staged_.find(name);
  if (it == staged_.end()) return nullptr;
  std::shared_ptr<StagedUpdate> staged = std::move(it->second);
  staged_.erase(it);
  ++folding_;
  return staged;
}

void StagingSlots::FoldDone() { --folding_; }

void StagingSlots::Release(const std::string& name) {
  staged_.erase(name);
  journals_.erase(name);
  std::erase_if(queue_, [&](const Waiting& w) { return w.name == name; });
}

std::vector<std::pair<std::shared_ptr<ClientSession>, Status>> StagingSlots::Grant() {
  std::vector<std::pair<std::shared_ptr<ClientSession>, Status>> refused;
  while (in_use() < slots_ && !queue_.empty()) {
    Waiting next = std::move(queue_.front());
    queue_.pop_front();
    auto session = next.session.lock();
    if (!session || session->closed()) continue;
    if (Status staged = StageWaiting(next); !staged.ok()) {
      staged_.erase(next.name);
      journals_.erase(next.name);
      refused.emplace_back(std::move(session), staged);
      continue;
    }
    session->Resume();
  }
  return refused;
}

void StagingSlots::Reset() {
  staged_.clear();
  journals_.clear();
  queue_.clear();
}

}  // namespace estuary::server
