// The Gloo engine: collectives among CPU processes over TCP.
//
// Each communicator owns one worker thread that runs its collectives in issue
// order (Gloo's calls block), so every call returns its Work at once and
// Work::Wait() blocks on the operation's completion. Every operation is bounded
// by RendezvousOptions::timeout; a peer whose process dies closes its sockets,
// which fails the operation at once. The first failure closes this rank's
// connections too, so the failure reaches every rank quickly, and every later
// call fails at once with the first error.
//
// Reduce-scatter is a ring over Gloo's point-to-point buffers (Gloo's option
// API has none): n-1 steps, each sending one block to the next rank while
// receiving and adding one from the previous.
#pragma once

#include <memory>
#include <string>

#include "base/status.h"
#include "comm/communicator.h"
#include "comm/rendezvous.h"

namespace estuary::comm {

struct GlooOptions {
  // The address this rank's collective sockets bind to. Empty: for tcp://, the
  // local address that reaches the store's host (the store's host itself on
  // rank 0); for file://, this machine's host name, as Gloo resolves it.
  std::string host;
};

// Rendezvous, then a TCP connection to every other rank. All ranks call it
// with the same address and size; it fails after options.timeout naming the
// ranks that never arrived.
// store: rank 0's store already serving (ServeLoopbackStore), or null to
// open options.address.
Result<std::unique_ptr<Communicator>> ConnectGloo(const RendezvousOptions& options, const GlooOptions& gloo = {},
                                                  std::unique_ptr<Store> store = nullptr);

}  // namespace estuary::comm
