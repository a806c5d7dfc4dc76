// BatchSchedule: the order in which a site visits its examples in one round.
//
// At the start of every epoch the examples are shuffled by one generator
// seeded with (task seed, round, client name); each epoch is then cut into
// batches of task.batch_size, the last one possibly short (PyTorch's
// DataLoader with drop_last=False); with task.max_local_steps set, the round
// ends after that many batches. ClassifierTrainer, TextTrainer and every rank
// of a multi-rank site walk this one schedule, which is what makes a rerun
// give the same bits and N ranks train what one process trains.
//
//   BatchSchedule schedule(indices, task, round, client_name);
//   while (schedule.Next()) {
//     if (schedule.starts_epoch()) epoch_loss = 0;
//     for (uint32_t item : schedule.batch()) ...
//   }
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <string_view>
#include <vector>

#include "client/trainer.h"

namespace estuary::client {

class BatchSchedule {
 public:
  BatchSchedule(std::vector<uint32_t> items, const TaskConfig& task, uint64_t round, std::string_view client_name);

  // Moves to the next batch; false once the round's schedule is over.
  bool Next();
  // The current batch's items, in order (a view valid until the next Next()).
  std::span<const uint32_t> batch() const { return std::span(order_).subspan(begin_, size_); }
  uint32_t epoch() const { return epoch_; }
  // Whether the current batch is its epoch's first.
  bool starts_epoch() const { return begin_ == 0; }

 private:
  std::vector<uint32_t> order_;
  std::mt19937_64 rng_;
  uint32_t epochs_, batch_size_;
  uint64_t max_steps_, steps_ = 0;
  uint32_t epoch_ = 0;
  size_t begin_ = 0, size_ = 0;
  bool started_ = false;
};

}  // namespace estuary::client
