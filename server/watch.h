// `estuary-server rounds watch --db F`: a live federation followed from its
// round log, refreshed in place — the round running, its arrivals by status,
// the last committed round's metrics and the time left at the pace so far.
//
// It only reads the log (the server writes it in WAL mode, so readers never
// block it), and stops by itself once the server has marked the federation
// complete. On a terminal each refresh redraws the view; otherwise a line
// is printed whenever the round or its arrivals change, for logs and tests.
#pragma once

#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "server/store.h"

namespace estuary::server {

// The view at one moment.
struct WatchFrame {
  std::string federation, model, strategy;
  uint64_t planned = 0;    // rounds planned; 0 when the log does not say
  bool complete = false;   // the server marked the federation complete
  uint64_t committed = 0, failed = 0;
  std::vector<RoundRecord> rounds;     // every round in the log, in order
  std::optional<RoundRecord> current;  // the latest round, running or not
  double current_seconds = 0;          // since it started (to its end, once ended)
  // The current round's participants by status: selected (training), committed, dropped, late, failed, rejected,
  // refused.
  std::map<std::string, uint32_t> arrivals;
  std::optional<RoundRecord> last_committed;
  double mean_round_seconds = 0;  // over the committed rounds
};

Result<WatchFrame> ReadWatchFrame(Store& store, int64_t now_ms);
// Lines without a trailing line break. RenderWatchFrame is the terminal's
// view; off a terminal, each round that ends is one DescribeEndedRound line
// and the running round one DescribeWatchFrame line whenever it changes
// (the frame without its clocks).
std::string RenderWatchFrame(const WatchFrame& frame);
std::string DescribeWatchFrame(const WatchFrame& frame);
std::string DescribeEndedRound(const RoundRecord& round, uint64_t planned);

struct WatchOptions {
  double interval_s = 1;
  bool once = false;      // one frame, then return
  bool redraw = false;    // a terminal: redraw in place
};
// Follows the log at `db` until the federation completes (or once), writing to `out`.
Status Watch(const std::filesystem::path& db, const WatchOptions& options, FILE* out);

}  // namespace estuary::server
