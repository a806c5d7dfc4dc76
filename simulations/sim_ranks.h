// The ranks of an in-process simulation that `mpirun -np N estuary-sim` runs
// over N processes, on one machine or many (docs/PERFORMANCE.md, "Beyond one
// machine").
//
// Rank 0 runs the simulation as one process does: it samples, folds,
// evaluates and reports. Each round it sends every rank the round's order
// (the sampled sites) and the global model; rank r trains the sampled sites
// i with i mod N == r and sends each one's whole update to rank 0, which puts
// it in its place and folds all k in the order of the sites' names, exactly
// as one process does. The global model is therefore the single-process one
// bit for bit. A reduction of per-rank partial sums would not be: FedAvg
// accumulates in double in site order and rounds once, and a sum regrouped
// by rank rounds differently. The price is the bytes: per round the model to
// each of the N - 1 other ranks, and one update per site trained off rank 0,
// about (N - 1 + k (N - 1) / N) × the model; rank 0 holds the round's k
// updates, as one process does.
//
// Failures: every rank sets up, then all Settle; a rank whose setup failed
// makes every rank stop, and rank 0 reports its line ("rank r: ..."). A site
// whose training fails on rank r travels to rank 0 as that site's error, as
// in one process. Rank 0 ends the ranks' round loop with Close(), on every
// path out of the run, at a point where the others wait for the next order.
// An MPI failure aborts the job (MPI's own handler).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "client/trainer.h"

namespace estuary::simulations {

struct Scenario;

// What rank 0 sends every rank at the start of a round; round 0 ends the run.
struct RoundOrder {
  uint64_t round = 0;
  std::vector<uint64_t> sites;  // the sampled sites' indices, in the order they are folded
};

class SimRanks {
 public:
  // Whether an MPI launcher started this process (its environment says so):
  // estuary-sim then joins the world instead of running alone.
  static bool LaunchedByMpi();
  // Joins the world (MPI_Init). Fails in one line in a build without MPI.
  static Result<std::unique_ptr<SimRanks>> Join(int* argc, char*** argv);
  ~SimRanks();  // leaves the world (MPI_Finalize)

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The rank that trains the i-th sampled site of a round.
  int OwnerOf(size_t i) const { return int(i % size_t(size_)); }

  // Every rank, once, after its setup: its own failure, else the lowest
  // failing rank's ("rank r: ..."), else Ok on all.
  Status Settle(const Status& mine);
  // Rank 0 sends, the others receive (`order` is ignored there).
  Result<RoundOrder> ShareOrder(const RoundOrder& order);
  Status ShareGlobal(std::span<float> global);
  // Not rank 0: the update (or the training error) of one site, in the order
  // of the sites this rank owns.
  Status SendUpdate(const Result<client::Update>& update);
  // Rank 0: the next update `from` sent. An error is the site's own, or a
  // message that could not be read.
  Result<client::Update> ReceiveUpdate(int from);
  // Rank 0, on every way out: the run is over (the ranks' loop ends), or,
  // before Settle, it failed in setup.
  void Close();
  // Rank 0: the bytes sent and received over MPI so far, and the updates
  // received from each rank (its own counted by the runner).
  uint64_t bytes() const { return bytes_; }
  std::vector<uint64_t>& updates_by_rank() { return updates_by_rank_; }

  // Rank r's one line where only rank 0 may print, and the whole job ends.
  [[noreturn]] void Abort(const Status& why);

 private:
  SimRanks(int rank, int size) : rank_(rank), size_(size), updates_by_rank_(size_t(size)) {}
  enum class State { kSetup, kRunning, kStopped };
  int rank_ = 0, size_ = 1;
  State state_ = State::kSetup;
  uint64_t bytes_ = 0;
  std::vector<uint64_t> updates_by_rank_;
};

// What a run over MPI cannot do, in one line (Ok when it can).
Status CheckMpiScenario(const Scenario& s, bool async, const std::string& scenario);

// Ranks 1..N-1: set up as rank 0 does, then train each round's share of the
// sites until rank 0 closes the run (simulations/runner.cc).
Status ServeInprocRank(const Scenario& s, SimRanks& ranks);

}  // namespace estuary::simulations
