#include "server/watch.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <set>
#include <tuple>
#include <thread>

namespace estuary::server {
namespace {

std::string Duration(double seconds) {
  if (seconds < 60) return fmt::format("{:.1f} s", seconds);
  const auto s = int64_t(seconds);
  if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}h{:02}m", s / 3600, (s % 3600) / 60);
}

std::string Planned(uint64_t planned) { return planned ? fmt::format(" of {}", planned) : ""; }

bool Running(const RoundRecord& r) { return r.state != RoundState::kCommitted && r.state != RoundState::kFailed; }

std::string Arrivals(const WatchFrame& f) {
  std::string out;
  for (const char* status : {"committed", "selected", "dropped", "late", "failed", "rejected", "refused", "stale"}) {
    auto it = f.arrivals.find(status);
    if (it == f.arrivals.end() || it->second == 0) continue;
    const char* label = std::string_view(status) == "selected" ? "training" : status;
    out += fmt::format("{}{} {}", out.empty() ? "" : ", ", it->second, label);
  }
  return out;
}

}  // namespace

Result<WatchFrame> ReadWatchFrame(Store& store, int64_t now_ms) {
  WatchFrame f;
  auto meta = [&store](const char* key) -> Result<std::string> {
    ESTUARY_ASSIGN_OR_RETURN(std::optional<std::string> value, store.GetMeta(key));
    return value.value_or("");
  };
  ESTUARY_ASSIGN_OR_RETURN(f.federation, meta("federation_id"));
  ESTUARY_ASSIGN_OR_RETURN(f.model, meta("model"));
  ESTUARY_ASSIGN_OR_RETURN(f.strategy, meta("strategy"));
  ESTUARY_ASSIGN_OR_RETURN(const std::string rounds, meta("rounds"));
  std::from_chars(rounds.data(), rounds.data() + rounds.size(), f.planned);  // 0 if not a number
  ESTUARY_ASSIGN_OR_RETURN(const std::string complete, meta("complete"));
  f.complete = !complete.empty();
  ESTUARY_ASSIGN_OR_RETURN(f.rounds, store.Rounds());
  double committed_seconds = 0;
  for (const RoundRecord& r : f.rounds) {
    if (r.state == RoundState::kCommitted) {
      ++f.committed;
      committed_seconds += double(r.ended_ms - r.started_ms) / 1000;
      f.last_committed = r;
    } else if (r.state == RoundState::kFailed) {
      ++f.failed;
    }
  }
  if (f.committed > 0) f.mean_round_seconds = committed_seconds / double(f.committed);
  if (f.rounds.empty()) return f;
  f.current = f.rounds.back();
  f.current_seconds = double((Running(*f.current) ? now_ms : f.current->ended_ms) - f.current->started_ms) / 1000;
  ESTUARY_ASSIGN_OR_RETURN(const std::vector<Participation> participants, store.Participations(f.current->round));
  for (const Participation& p : participants) ++f.arrivals[p.status];
  // An asynchronous version's updates are arrivals, not participations.
  ESTUARY_ASSIGN_OR_RETURN(const std::vector<Arrival> arrivals, store.Arrivals(f.current->round));
  for (const Arrival& a : arrivals) ++f.arrivals[a.status == "folded" ? "committed" : a.status];
  return f;
}

std::string DescribeWatchFrame(const WatchFrame& f) {
  if (!f.current) return fmt::format("federation {}: no round yet", f.federation);
  const RoundRecord& r = *f.current;
  if (!Running(r)) return DescribeEndedRound(r, f.planned) + (f.complete ? "; federation complete" : "");
  const auto arrived = f.arrivals.find("committed");
  std::string line = fmt::format("round {}{} {}: {} of {} updates", r.round, Planned(f.planned),
                                 RoundStateName(r.state), arrived != f.arrivals.end() ? arrived->second : 0,
                                 r.clients_selected);
  if (const std::string arrivals = Arrivals(f); !arrivals.empty()) line += fmt::format(" ({})", arrivals);
  return line;
}

std::string DescribeEndedRound(const RoundRecord& r, uint64_t planned) {
  if (r.state == RoundState::kFailed) return fmt::format("round {}{} failed: {}", r.round, Planned(planned), r.detail);
  return fmt::format("round {}{} committed: {} of {} updates{}", r.round, Planned(planned), r.updates_received,
                     r.clients_selected, r.test_accuracy ? fmt::format(", test accuracy {:.4f}", *r.test_accuracy) : "");
}

std::string RenderWatchFrame(const WatchFrame& f) {
  std::string out = fmt::format("federation {} · {} · {} · {} committed, {} failed{}", f.federation.substr(0, 12),
                                f.model, f.strategy, f.committed, f.failed, f.complete ? " · complete" : "");
  if (!f.current) return out + "\nwaiting for the first round";
  out += fmt::format("\nnow   {} ({})", DescribeWatchFrame(f), Duration(f.current_seconds));
  if (f.last_committed) {
    const RoundRecord& r = *f.last_committed;
    out += fmt::format("\nlast  round {} committed in {}: train loss {:.4f}{}", r.round,
                       Duration(double(r.ended_ms - r.started_ms) / 1000), r.train_loss,
                       r.test_accuracy ? fmt::format(", test accuracy {:.4f}", *r.test_accuracy) : "");
  }
  if (f.planned > 0 && !f.complete && f.committed > 0) {
    const uint64_t left = f.planned > f.committed ? f.planned - f.committed : 0;
    out += fmt::format("\neta   {} ({} a round, {} rounds left)", Duration(f.mean_round_seconds * double(left)),
                       Duration(f.mean_round_seconds), left);
  }
  return out;
}

Status Watch(const std::filesystem::path& db, const WatchOptions& options, FILE* out) {
  ESTUARY_ASSIGN_OR_RETURN(std::unique_ptr<Store> store, Store::OpenReadOnly(db));
  std::string last_running;
  std::set<std::tuple<uint64_t, int, int64_t>> printed;  // ended rounds: (round, state, end); a retry reuses the number
  size_t drawn_lines = 0;
  for (;;) {
    ESTUARY_ASSIGN_OR_RETURN(const WatchFrame frame, ReadWatchFrame(*store, NowMs()));
    if (options.redraw) {
      const std::string text = RenderWatchFrame(frame);
      // Up over the last frame, each line cleared as it is rewritten.
      if (drawn_lines > 0) std::fprintf(out, "\x1b[%zuA", drawn_lines);
      size_t start = 0;
      drawn_lines = 0;
      for (size_t end; start <= text.size(); start = end + 1, ++drawn_lines) {
        end = std::min(text.find('\n', start), text.size());
        std::fprintf(out, "\x1b[2K%.*s\n", int(end - start), text.data() + start);
      }
    } else {
      for (const RoundRecord& r : frame.rounds) {
        if (Running(r) || !printed.insert({r.round, int(r.state), r.ended_ms}).second) continue;
        if (options.once && &r != &frame.rounds.back()) continue;  // once: the latest only
        std::fprintf(out, "%s\n", DescribeEndedRound(r, frame.planned).c_str());
      }
      if (frame.current && Running(*frame.current)) {
        if (const std::string running = DescribeWatchFrame(frame); running != last_running) {
          std::fprintf(out, "%s\n", running.c_str());
          last_running = running;
        }
      } else if (frame.complete) {
        std::fprintf(out, "federation complete: %llu rounds committed, %llu failed\n",
                     (unsigned long long)frame.committed, (unsigned long long)frame.failed);
      } else if (!frame.current) {
        std::fprintf(out, "%s\n", DescribeWatchFrame(frame).c_str());
      }
    }
    std::fflush(out);
    if (options.once || frame.complete) return Status::Ok();
    std::this_thread::sleep_for(std::chrono::duration<double>(options.interval_s));
  }
}

}  // namespace estuary::server
