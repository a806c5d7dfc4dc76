// UpdateStream: an update's delta handed out slice by slice instead of held
// whole — how a ZeRO-3 site uploads without assembling its trained model on
// one rank.
//
// The producer runs on the trainer's thread (Run calls the produce function,
// which Pushes the slices in buffer order: for a site, one gathered unit of
// DataParallel::ForEachSlice at a time); the consumer, the Agent on its I/O
// thread, Pops them as its socket drains, and never blocks. At most
// `capacity` slices wait between the two: Push blocks while they do, so the
// producer's pace is the upload's. Cancel (the connection dropped) makes every
// later Push fail at once, so a producer stuck on a gone consumer finishes;
// a site's producer still runs its collectives to the end (the other ranks
// are in them too). Run exactly once, or the producer's peers wait on it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <vector>

#include "base/status.h"

namespace estuary::client {

class UpdateStream {
 public:
  struct Slice {
    uint64_t offset = 0;  // in elements of the flat buffer
    std::vector<float> values;
  };
  enum class Next { kSlice, kPending, kEnd };
  using Produce = std::function<Status(UpdateStream&)>;

  explicit UpdateStream(Produce produce, size_t capacity = 2) : produce_(std::move(produce)), capacity_(capacity) {}

  // Producer side: runs produce and ends the stream with its status.
  void Run();
  // Blocks while `capacity` slices wait; fails once the stream is cancelled.
  Status Push(Slice slice);

  // Consumer side. kSlice: *slice is the next one; kPending: none yet, on_ready
  // will say when; kEnd: *status is how the producer ended.
  Next Pop(Slice* slice, Status* status);
  // The same, waiting while kPending (for a consumer that has nothing else to do).
  Next WaitPop(Slice* slice, Status* status);
  void Cancel();
  // Whether Run has begun (on any thread).
  bool started();

  // Called on the producer's thread after each Push and at the end (the
  // Agent posts its WriteNext from here). Set before Run.
  std::function<void()> on_ready;

 private:
  Produce produce_;
  const size_t capacity_;
  std::mutex mu_;
  std::condition_variable changed_;
  std::deque<Slice> slices_;
  bool ran_ = false, ended_ = false, cancelled_ = false;
  Status status_;
};

}  // namespace estuary::client
