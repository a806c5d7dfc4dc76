#include "client/batch_schedule.h"

#include <algorithm>

#include "base/seed.h"

namespace estuary::client {

BatchSchedule::BatchSchedule(std::vector<uint32_t> items, const TaskConfig& task, uint64_t round,
                             std::string_view client_name)
    : order_(std::move(items)),
      rng_(MixSeed(MixSeed(task.seed, round), client_name)),
      epochs_(task.epochs),
      batch_size_(task.batch_size),
      max_steps_(task.max_local_steps == 0 ? UINT64_MAX : task.max_local_steps) {}

bool BatchSchedule::Next() {
  if (order_.empty() || batch_size_ == 0 || steps_ >= max_steps_) return false;
  if (!started_ || begin_ + size_ >= order_.size()) {
    if (started_ && ++epoch_ >= epochs_) return false;
    if (epoch_ >= epochs_) return false;
    started_ = true;
    Shuffle(order_, rng_);
    begin_ = 0;
  } else {
    begin_ += size_;
  }
  size_ = std::min<size_t>(batch_size_, order_.size() - begin_);
  ++steps_;
  return true;
}

}  // namespace estuary::client
