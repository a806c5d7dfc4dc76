// What a simulation run reports: per-round metrics as JSON, a console table
// and an SVG plot comparing runs.
//
// The JSON file is the run's record, so WriteReport replaces it atomically
// and ReadReport checks every field before handing it back:
//   { "scenario": {...}, "mode": "inproc", "round_log": "run/rounds.sqlite" | null,
//     "rounds": [ { "round": 1, "clients_selected": 10, "updates_received": 10,
//                   "test_accuracy": 0.91, "test_loss": 0.31, "train_loss": 0.42,
//                   "seconds": 1.2, "bytes_up": 123, "bytes_down": 456,
//                   "bytes_per_update": 12, "merge_bytes_down": 0,
//                   "global_checksum": "..." }, ... ],
// (bytes_per_update and merge_bytes_down may be absent in older reports: 0.)
//     "total_seconds": 12.5, "final_accuracy": 0.97 }
// A DP run's rounds also hold "epsilon" (spent after the round) and "dp_clip"
// (the clip norm the round used), and the report "epsilon" and "delta" (spent
// by the whole run); a run without DP has none of these keys. A --secagg run's
// rounds hold "secagg_bytes_per_site", "secagg_seconds", "secagg_dropouts",
// "secagg_dropouts_by_stage" and "secagg_error_bound"; a --dropout run's without it, "dropouts" and
// "dropouts_by_stage". An inproc run's rounds hold "sim_time", an --async
// run's also "staleness_mean" and "staleness_max". A run under mpirun
// (docs/PERFORMANCE.md, "Beyond one machine") holds "mpi_ranks" and
// "updates_by_rank" (the updates each rank trained and sent, rank 0 first),
// and its rounds "mpi_bytes" (what the round moved between the ranks).
// JSON has no NaN or infinity; a non-finite metric (a diverged loss) is written
// as null and read back as NaN, so such a run still leaves a readable report.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"

namespace estuary::simulations {

struct RoundReport {
  uint64_t round = 0;
  uint32_t clients_selected = 0;
  uint32_t updates_received = 0;  // may be fewer than selected: dropouts, stragglers
  double test_accuracy = 0;       // in [0, 1]
  double test_loss = 0;
  double train_loss = 0;          // mean over the updates received
  double seconds = 0;             // wall time of the round
  uint64_t bytes_up = 0;          // clients -> server
  uint64_t bytes_down = 0;        // server -> clients
  uint64_t bytes_per_update = 0;  // one client's upload: the delta (full) or the adapter factors (lora)
  // lora: what the merge changed, per client (merged adapters, plus the
  // residuals exact folds into the base); 0 when the whole model changed.
  uint64_t merge_bytes_down = 0;
  std::string global_checksum;    // of the global model after the round
  std::optional<double> epsilon;  // DP: spent after this round, at Report::delta
  std::optional<double> dp_clip;  // DP: the clip norm the round's updates were clipped to
  // Under --attack: the malicious sites among those sampled, and the updates
  // refused (not finite: a nan attack's) rather than folded.
  std::optional<uint64_t> attackers;
  std::optional<uint64_t> updates_refused;
  // Under --secagg (docs/SECAGG.md): the protocol's bytes per sampled site
  // (sent and received, all four rounds), its wall time in the round
  // (quantisation to the dequantised mean, training excluded), the sites that
  // dropped out of it, and the bound on each element of the mean's
  // quantisation error.
  std::optional<uint64_t> secagg_bytes_per_site;
  std::optional<double> secagg_seconds;
  std::optional<uint64_t> secagg_dropouts;
  // Those dropouts by where the site stopped (JSON "secagg_dropouts_by_stage":
  // four counts): before advertising its keys, after advertising them, after
  // sharing them, after sending its masked input (then it is in the sum).
  // Inproc, from the seeded draw; loopback, from the server's round log.
  std::optional<std::vector<uint64_t>> secagg_dropouts_by_stage;
  std::optional<double> secagg_error_bound;
  // Under --dropout without --secagg: the sampled sites that dropped out, and
  // by stage (JSON "dropouts_by_stage": two counts): after training (no
  // upload begun), mid-upload (a partial upload, discarded). Inproc, from the
  // seeded draw; loopback, from the server's round log (its participations
  // "dropped", told apart by their detail).
  std::optional<uint64_t> dropouts;
  std::optional<std::vector<uint64_t>> dropouts_by_stage;
  // The simulated clock when the round (an --async run: the model version)
  // was committed, in local steps of a full-speed site (stragglers.h); set
  // by inproc runs. An --async version's folded updates' staleness: the mean
  // and the largest, in versions (its updates_refused: those too stale).
  std::optional<double> sim_time;
  std::optional<double> staleness_mean;
  std::optional<uint64_t> staleness_max;
  // Under --evaluate-every (docs/EVALUATION.md): the global model after the
  // round scored by the sampled sites on their own held-out examples, the
  // example-weighted means, and the examples scored. Unset in a round not
  // evaluated.
  std::optional<double> federated_accuracy;
  std::optional<double> federated_loss;
  std::optional<uint64_t> federated_examples;
  // Under mpirun: the bytes the round moved between the ranks (the round's
  // order and the global model to every other rank, their sites' updates to
  // rank 0). Unset in a run of one process.
  std::optional<uint64_t> mpi_bytes;

  bool operator==(const RoundReport&) const = default;
};

struct Report {
  nlohmann::json scenario;     // the scenario as it was run, echoed verbatim
  std::string mode;            // how clients were run, e.g. "inproc" or "loopback"
  std::string round_log;       // path of the SQLite round log; empty when none
  std::vector<RoundReport> rounds;
  double total_seconds = 0;
  double final_accuracy = 0;
  std::optional<double> epsilon;  // DP: spent by the run
  std::optional<double> delta;
  std::optional<uint64_t> attackers;  // under --attack: the malicious sites of the federation
  // inproc: where the first update folded trained (client::SiteTrainer's
  // "models::Llama (recompute, arena N bytes) on cpu in f32, 1 rank (solo,
  // ddp)"); empty when not known.
  std::string trained_on;
  // inproc: the simulating process's peak resident memory (VmHWM) when the
  // run ended, in bytes; absent where /proc does not say.
  std::optional<uint64_t> peak_rss_bytes;
  // Under mpirun: the processes the run used, and how many of the updates
  // folded each rank trained (counted as they arrived, by sender).
  std::optional<uint64_t> mpi_ranks;
  std::vector<uint64_t> updates_by_rank;
};

nlohmann::json ToJson(const Report& report);
// Checks types, ranges and keys (missing or unknown ones are errors); `where`
// names the source in error messages.
Result<Report> ReportFromJson(const nlohmann::json& json, std::string_view where = "report");

// Writes ToJson(report) to `path` via a temporary file, fsync and rename, so a
// reader sees the old report or the new one, never half of one.
Status WriteReport(const std::filesystem::path& path, const Report& report);
Result<Report> ReadReport(const std::filesystem::path& path);

// A self-contained SVG line chart of test accuracy against round, one
// polyline per run, with axes, ticks and a legend. labels[i] names runs[i];
// runs without a label are called "run <i+1>". Non-finite accuracies are skipped.
std::string RenderSvgPlot(const std::vector<Report>& runs, const std::vector<std::string>& labels);

// A fixed-width console table. The header (column names and a rule, each line
// ending in '\n') is separate so a runner can print it once and then print
// RenderRoundTable({round}) as each round finishes; rows line up with it.
std::string RenderRoundTableHeader();
// One line per round, each ending in '\n'; no header.
std::string RenderRoundTable(const std::vector<RoundReport>& rounds);

}  // namespace estuary::simulations
