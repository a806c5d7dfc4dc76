// Metrics: what the server counts for its operators, in Prometheus's text
// exposition format (version 0.0.4), served by MetricsEndpoint
// (server/metrics_endpoint.h) at --metrics-listen.
//
// Every value is an atomic, so the strands that count (the core's round
// logic, each session's reads and writes, the worker's folds) and the
// endpoint that reads never take a lock and never wait on each other; a
// scrape sees each value as of some moment during it, not one snapshot of
// all. Names follow Prometheus's conventions: estuary_ prefix, base units
// (seconds, bytes), _total on counters.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <string>

#include "estuary.pb.h"
#include "server/store.h"

namespace estuary::server {

class Metrics {
 public:
  // The upper bounds of the round-duration histogram's buckets, in seconds.
  static constexpr std::array<double, 11> kRoundSecondsBuckets = {0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600};

  // A round ended in `state` (committed or failed) `seconds` after it opened.
  void RoundEnded(RoundState state, double seconds);
  void SetConnectedSites(uint64_t n) { connected_.store(n, std::memory_order_relaxed); }
  void SetSelectedSites(uint64_t n) { selected_.store(n, std::memory_order_relaxed); }
  void SetCurrentRound(uint64_t round) { round_.store(round, std::memory_order_relaxed); }
  void BytesReceived(uint64_t n) { received_.fetch_add(n, std::memory_order_relaxed); }
  void BytesSent(uint64_t n) { sent_.fetch_add(n, std::memory_order_relaxed); }
  void UploadRejected(v1::Error::Code code);
  // One update folded: its bytes and the seconds the fold took.
  void Folded(uint64_t bytes, double seconds);
  void HandshakeRefused() { handshakes_refused_.fetch_add(1, std::memory_order_relaxed); }
  // ε at δ after the last committed round of a DP federation.
  void SetEpsilon(double epsilon, double delta);

  // The text a scrape of /metrics returns.
  std::string Render() const;

 private:
  // A double kept in an atomic word (bit-cast), added to by compare-exchange.
  struct AtomicDouble {
    std::atomic<uint64_t> bits{0};
    void Add(double v);
    void Set(double v);
    double Get() const;
  };

  std::atomic<uint64_t> committed_{0}, failed_{0};
  std::array<std::atomic<uint64_t>, kRoundSecondsBuckets.size()> round_buckets_{};  // cumulative counts
  std::atomic<uint64_t> round_count_{0};
  AtomicDouble round_seconds_sum_;
  std::atomic<uint64_t> connected_{0}, selected_{0}, round_{0};
  std::atomic<uint64_t> received_{0}, sent_{0};
  std::array<std::atomic<uint64_t>, 16> rejected_{};  // by v1::Error::Code
  std::atomic<uint64_t> folds_{0}, folded_bytes_{0};
  AtomicDouble fold_seconds_;
  std::atomic<uint64_t> handshakes_refused_{0};
  std::atomic<bool> dp_{false};
  AtomicDouble epsilon_, delta_;
};

}  // namespace estuary::server
