#include "client/update_stream.h"

namespace estuary::client {

void UpdateStream::Run() {
  {
    std::lock_guard lock(mu_);
    if (ran_) return;
    ran_ = true;
  }
  Status status = produce_(*this);
  {
    std::lock_guard lock(mu_);
    ended_ = true;
    status_ = cancelled_ && status.ok() ? Aborted("update stream: cancelled") : status;
  }
  changed_.notify_all();
  if (on_ready) on_ready();
}

Status UpdateStream::Push(Slice slice) {
  {
    std::unique_lock lock(mu_);
    changed_.wait(lock, [&] { return cancelled_ || slices_.size() < capacity_; });
    if (cancelled_) return Aborted("update stream: cancelled");
    slices_.push_back(std::move(slice));
  }
  changed_.notify_all();
  if (on_ready) on_ready();
  return Status::Ok();
}

UpdateStream::Next UpdateStream::Pop(Slice* slice, Status* status) {
  std::unique_lock lock(mu_);
  if (!slices_.empty()) {
    *slice = std::move(slices_.front());
    slices_.pop_front();
    lock.unlock();
    changed_.notify_all();
    return Next::kSlice;
  }
  if (ended_) {
    *status = status_;
    return Next::kEnd;
  }
  return Next::kPending;
}

UpdateStream::Next UpdateStream::WaitPop(Slice* slice, Status* status) {
  {
    std::unique_lock lock(mu_);
    changed_.wait(lock, [&] { return !slices_.empty() || ended_; });
  }
  return Pop(slice, status);
}

bool UpdateStream::started() {
  std::lock_guard lock(mu_);
  return ran_;
}

void UpdateStream::Cancel() {
  {
    std::lock_guard lock(mu_);
    cancelled_ = true;
    slices_.clear();
  }
  changed_.notify_all();
}

}  // namespace estuary::client
