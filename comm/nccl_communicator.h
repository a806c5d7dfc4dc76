// The NCCL engine: collectives among the GPUs of a site, one rank per GPU.
// Built only when CMake finds CUDA and NCCL (ESTUARY_HAVE_NCCL).
//
// Rank 0 makes NCCL's unique id and publishes it through the rendezvous
// Store; every rank then joins a nonblocking NCCL communicator, so that a rank
// that never joins fails initialisation after the timeout instead of hanging.
//
// Buffers are device memory on this rank's GPU, except the byte broadcast,
// which takes host memory and stages it through pinned and device buffers.
// Each collective is enqueued on the communicator's own stream after an event
// recorded on the caller's compute stream, so it sees every kernel launched
// there before the call, and the caller can go on computing. Wait() waits for
// the operation's completion event while polling NCCL for asynchronous errors
// (a dead peer); on an error or after the timeout it aborts the communicator,
// and every later call fails at once. Calls make `device` the current device.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "base/status.h"
#include "comm/communicator.h"
#include "comm/rendezvous.h"

namespace estuary::comm {

// compute: the stream the caller's kernels run on (nullptr: the legacy default stream).
// store: rank 0's store already serving (ServeLoopbackStore), or null to
// open options.address.
Result<std::unique_ptr<Communicator>> ConnectNccl(const RendezvousOptions& options, int device,
                                                  cudaStream_t compute = nullptr, std::unique_ptr<Store> store = nullptr);

}  // namespace estuary::comm
