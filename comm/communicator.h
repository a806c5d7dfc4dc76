// Communicator: the collectives among the ranks of one client site.
//
// A site that trains on several GPUs (or several CPU processes) runs one rank
// per device; DDP and ZeRO (parallel/data_parallel.h) are written once against
// this interface, with two real engines behind it: NCCL for GPUs and Gloo for
// CPU processes (comm/gloo_communicator.h, comm/nccl_communicator.h).
//
// The contract, shared by both engines:
// - Every rank issues the same collectives, with the same sizes, in the same
//   order (as MPI and NCCL require). Buffers live on the communicator's
//   device(): host memory for Gloo, the rank's GPU for NCCL.
// - Each call returns a Work handle at once; the operations run in issue
//   order on the communicator's own thread (Gloo) or stream (NCCL), so a
//   caller can launch a bucket's all-reduce and go on computing. A buffer
//   handed to a collective must not be touched until its Wait() returns.
// - Wait() blocks until the operation is done. A peer that dies or stalls
//   makes Wait() fail within the timeout given at creation, with a Status
//   naming the operation and the rank — never a hang. After one failure every
//   later call fails at once: a site whose ranks disagree cannot go on.
// - kAverage divides the sum by size() once, in the reduction's own order;
//   results are identical on every rank.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <span>
#include <string>

#include "base/status.h"
#include "base/device.h"

namespace estuary::comm {

enum class ReduceOp { kSum, kAverage };

// A launched collective.
class Work {
 public:
  virtual ~Work() = default;
  virtual Status Wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Device device() const = 0;
  // "gloo" or "nccl".
  virtual std::string_view backend() const = 0;

  // data = op over all ranks of data, in place.
  virtual std::unique_ptr<Work> AllReduce(std::span<float> data, ReduceOp op) = 0;
  // The same in double: global gradient norms and loss sums agreed across ranks.
  virtual std::unique_ptr<Work> AllReduce(std::span<double> data, ReduceOp op) = 0;
  // in holds size() equal blocks of out.size() elements; rank r receives in
  // out the reduction over all ranks of block r. out may be in's block r (in place).
  virtual std::unique_ptr<Work> ReduceScatter(std::span<const float> in, std::span<float> out, ReduceOp op) = 0;
  // out (size() * in.size() elements) receives every rank's in, in rank order.
  // in may be out's block rank() (in place).
  virtual std::unique_ptr<Work> AllGather(std::span<const float> in, std::span<float> out) = 0;
  // Every rank's data becomes root's.
  virtual std::unique_ptr<Work> Broadcast(std::span<float> data, int root) = 0;
  // Host bytes, on either engine: tasks, sizes and other control messages.
  virtual std::unique_ptr<Work> Broadcast(std::span<std::byte> data, int root) = 0;
  virtual std::unique_ptr<Work> Barrier() = 0;
};

// The communicator of a site of one rank: every collective over one rank
// leaves its data as it is, and completes at once. It lets a single process
// run the same DataParallel (DDP) loop as the ranks of a site. On a GPU
// (device kCuda) only the in-place collectives apply: ReduceScatter and
// AllGather, which would copy device memory, fail.
std::unique_ptr<Communicator> MakeSoloCommunicator(Device device);

// Where ranks find each other: "tcp://HOST:PORT" (rank 0 serves a small
// key-value store there) or "file:///path/to/dir" (a shared directory).
struct RendezvousOptions {
  std::string address;
  int rank = 0;
  int size = 1;
  // Bounds every collective and the rendezvous itself.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
};

}  // namespace estuary::comm
