// Rendezvous: how the ranks of one site find each other before a collective.
//
// RendezvousOptions::address names a Store every rank can reach:
// - "tcp://HOST:PORT": rank 0 serves a small key-value store on that address
//   (plain TCP, meant for the site's private network); every other rank
//   connects to it, retrying until the timeout.
// - "file:///path/to/dir": a directory every rank sees (Gloo's FileStore).
//   Use a fresh directory per run: keys left by an earlier run would be read.
//   Keys are written once; the directory gets one small file per key.
//
// Both engines use one: Gloo exchanges its pair addresses through it, NCCL
// its unique id. Every wait is bounded; a rank that never shows up makes
// AwaitRanks fail after the timeout, naming the ranks that are missing.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <string_view>

#include "base/status.h"
#include "comm/communicator.h"

namespace estuary::comm {

class Store {
 public:
  virtual ~Store() = default;

  // Sets key to value, for every rank to read. Each key is set once.
  virtual Status Set(std::string_view key, std::string_view value) = 0;
  // The value of key, waiting up to timeout for some rank to set it.
  virtual Result<std::string> Get(std::string_view key, std::chrono::milliseconds timeout) = 0;
  // Whether key is set now; never waits.
  virtual Result<bool> Has(std::string_view key) = 0;
  // What the store is, for messages: "tcp://10.0.0.1:29500".
  virtual const std::string& address() const = 0;
};

// tcp://127.0.0.1:PORT with a port the kernel just handed out (free a moment
// ago: another process could take it first). For tests that fork their ranks.
Result<std::string> FreeLoopbackRendezvous();

// Rank 0's store of a single node, already serving on a port of 127.0.0.1
// that the kernel chose and it holds (address() names it), so no other
// process can take the port between choosing and serving: estuary-client's
// default for a node of several ranks.
Result<std::unique_ptr<Store>> ServeLoopbackStore();

// Rank 0 of a tcp:// address starts serving here; the others connect. The
// server lives as long as rank 0's Store, so keep it until every rank is done
// with rendezvous (the communicators hold theirs for their whole life).
Result<std::unique_ptr<Store>> OpenStore(const RendezvousOptions& options);

// Announces this rank under `scope` and waits until all options.size ranks
// have announced theirs. Fails after options.timeout naming the absent ranks:
// "rendezvous gloo at tcp://127.0.0.1:29500: rank 3 of 4 did not arrive within 2000 ms".
Status AwaitRanks(Store& store, const RendezvousOptions& options, std::string_view scope);

}  // namespace estuary::comm
