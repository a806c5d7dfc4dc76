#include "simulations/report.h"

#include "base/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <tuple>

#include <fmt/format.h>

#include <span>

namespace estuary::simulations {
namespace {

using nlohmann::json;

constexpr const char* kRoundKeys[] = {"round",      "clients_selected", "updates_received",
                                      "test_accuracy", "test_loss",     "train_loss",
                                      "seconds",    "bytes_up",         "bytes_down",
                                      "global_checksum"};
// Round keys added later: written always, read when present.
constexpr const char* kOptionalRoundKeys[] = {"bytes_per_update", "merge_bytes_down", "epsilon", "dp_clip",
                                              "attackers", "updates_refused", "secagg_bytes_per_site",
                                              "secagg_seconds", "secagg_dropouts", "secagg_dropouts_by_stage", "secagg_error_bound",
                                              "sim_time", "staleness_mean", "staleness_max",
                                              "federated_accuracy", "federated_loss", "federated_examples",
                                              "mpi_bytes", "dropouts", "dropouts_by_stage"};
constexpr const char* kReportKeys[] = {"scenario", "mode",          "round_log",
                                       "rounds",   "total_seconds", "final_accuracy"};
// A DP run's (epsilon, delta); a run under attack's (attackers).
// An mpirun run's (mpi_ranks, updates_by_rank).
constexpr const char* kOptionalReportKeys[] = {"epsilon", "delta", "attackers", "trained_on", "peak_rss_bytes",
                                               "mpi_ranks", "updates_by_rank"};

// A key that only some reports hold: written when set.
void SetIfPresent(json& object, const char* key, const std::optional<double>& value) {
  if (value) object[key] = *value;
}
void SetIfPresent(json& object, const char* key, const std::optional<uint64_t>& value) {
  if (value) object[key] = *value;
}

// JSON cannot hold NaN or infinity; null stands for "not a finite number".
json NumberOrNull(double value) { return std::isfinite(value) ? json(value) : json(nullptr); }

// ---- Validation -------------------------------------------------------------

template <size_t N>
Status CheckKeys(const json& object, const char* const (&expected)[N], std::string_view where,
                 std::span<const char* const> optional = {}) {
  if (!object.is_object()) return InvalidArgument("{}: expected an object", where);
  for (const char* key : expected) {
    if (!object.contains(key)) return InvalidArgument("{}: missing key \"{}\"", where, key);
  }
  for (const auto& [key, value] : object.items()) {
    if (std::find_if(std::begin(expected), std::end(expected),
                     [&](const char* k) { return key == k; }) == std::end(expected) &&
        std::find_if(optional.begin(), optional.end(), [&](const char* k) { return key == k; }) == optional.end()) {
      return InvalidArgument("{}: unknown key \"{}\"", where, key);
    }
  }
  return Status::Ok();
}

Status ReadUnsigned(const json& object, const char* key, uint64_t max, std::string_view where,
                    uint64_t& out) {
  const json& value = object.at(key);
  // Parsed text stores non-negative integers as unsigned, but JSON built in
  // code may hold them signed; accept either when the value is >= 0.
  const bool non_negative_integer =
      value.is_number_unsigned() || (value.is_number_integer() && value.get<int64_t>() >= 0);
  if (!non_negative_integer) {
    return InvalidArgument("{}.{}: expected a non-negative integer, got {}", where, key,
                           value.dump());
  }
  out = value.get<uint64_t>();
  if (out > max) return InvalidArgument("{}.{}: {} is larger than {}", where, key, out, max);
  return Status::Ok();
}

Status ReadDouble(const json& object, const char* key, std::string_view where, double& out) {
  const json& value = object.at(key);
  if (value.is_null()) {
    out = std::numeric_limits<double>::quiet_NaN();
    return Status::Ok();
  }
  if (!value.is_number()) {
    return InvalidArgument("{}.{}: expected a number or null, got {}", where, key, value.dump());
  }
  out = value.get<double>();
  return Status::Ok();
}

// A fraction in [0, 1], or NaN; catches percentages written where fractions belong.
Status ReadFraction(const json& object, const char* key, std::string_view where, double& out) {
  ESTUARY_RETURN_IF_ERROR(ReadDouble(object, key, where, out));
  if (out < 0 || out > 1) return InvalidArgument("{}.{}: {} is not in [0, 1]", where, key, out);
  return Status::Ok();
}

Status ReadNonNegative(const json& object, const char* key, std::string_view where, double& out) {
  ESTUARY_RETURN_IF_ERROR(ReadDouble(object, key, where, out));
  if (out < 0) return InvalidArgument("{}.{}: {} is negative", where, key, out);
  return Status::Ok();
}

Status ReadString(const json& object, const char* key, std::string_view where, std::string& out) {
  const json& value = object.at(key);
  if (!value.is_string()) {
    return InvalidArgument("{}.{}: expected a string, got {}", where, key, value.dump());
  }
  out = value.get<std::string>();
  return Status::Ok();
}

Result<RoundReport> RoundFromJson(const json& object, std::string_view where) {
  ESTUARY_RETURN_IF_ERROR(CheckKeys(object, kRoundKeys, where, kOptionalRoundKeys));
  RoundReport round;
  uint64_t selected = 0, received = 0;
  constexpr uint64_t kMaxU32 = std::numeric_limits<uint32_t>::max();
  constexpr uint64_t kMaxU64 = std::numeric_limits<uint64_t>::max();
  ESTUARY_RETURN_IF_ERROR(ReadUnsigned(object, "round", kMaxU64, where, round.round));
  ESTUARY_RETURN_IF_ERROR(ReadUnsigned(object, "clients_selected", kMaxU32, where, selected));
  ESTUARY_RETURN_IF_ERROR(ReadUnsigned(object, "updates_received", kMaxU32, where, received));
  round.clients_selected = uint32_t(selected);
  round.updates_received = uint32_t(received);
  ESTUARY_RETURN_IF_ERROR(ReadFraction(object, "test_accuracy", where, round.test_accuracy));
  ESTUARY_RETURN_IF_ERROR(ReadDouble(object, "test_loss", where, round.test_loss));
  ESTUARY_RETURN_IF_ERROR(ReadDouble(object, "train_loss", where, round.train_loss));
  ESTUARY_RETURN_IF_ERROR(ReadNonNegative(object, "seconds", where, round.seconds));
  ESTUARY_RETURN_IF_ERROR(ReadUnsigned(object, "bytes_up", kMaxU64, where, round.bytes_up));
  ESTUARY_RETURN_IF_ERROR(ReadUnsigned(object, "bytes_down", kMaxU64, where, round.bytes_down));
  ESTUARY_RETURN_IF_ERROR(ReadString(object, "global_checksum", where, round.global_checksum));
  if (object.contains("bytes_per_update")) {
    ESTUARY_RETURN_IF_ERROR(ReadUnsigned(object, "bytes_per_update", kMaxU64, where, round.bytes_per_update));
  }
  if (object.contains("merge_bytes_down")) {
    ESTUARY_RETURN_IF_ERROR(ReadUnsigned(object, "merge_bytes_down", kMaxU64, where, round.merge_bytes_down));
  }
  if (object.contains("federated_accuracy")) {
    double value = 0;
    ESTUARY_RETURN_IF_ERROR(ReadFraction(object, "federated_accuracy", where, value));
    round.federated_accuracy = value;
  }
  if (object.contains("federated_examples")) {
    uint64_t value = 0;
    ESTUARY_RETURN_IF_ERROR(ReadUnsigned(object, "federated_examples", kMaxU64, where, value));
    round.federated_examples = value;
  }
  for (auto [key, out] : {std::pair{"epsilon", &round.epsilon}, std::pair{"dp_clip", &round.dp_clip},
                          std::pair{"federated_loss", &round.federated_loss},
                          std::pair{"secagg_seconds", &round.secagg_seconds},
                          std::pair{"secagg_error_bound", &round.secagg_error_bound},
                          std::pair{"sim_time", &round.sim_time}, std::pair{"staleness_mean", &round.staleness_mean}}) {
    if (!object.contains(key)) continue;
    double value = 0;
    ESTUARY_RETURN_IF_ERROR(ReadNonNegative(object, key, where, value));
    *out = value;
  }
  for (auto [key, out] : {std::pair{"attackers", &round.attackers}, std::pair{"updates_refused", &round.updates_refused},
                          std::pair{"secagg_dropouts", &round.secagg_dropouts},
                          std::pair{"dropouts", &round.dropouts},
                          std::pair{"staleness_max", &round.staleness_max}}) {
    if (!object.contains(key)) continue;
    uint64_t value = 0;
    ESTUARY_RETURN_IF_ERROR(ReadUnsigned(object, key, kMaxU32, where, value));
    *out = value;
  }
  for (auto [key, stage_count, out] :
       {std::tuple{"secagg_dropouts_by_stage", size_t{4}, &round.secagg_dropouts_by_stage},
        std::tuple{"dropouts_by_stage", size_t{2}, &round.dropouts_by_stage}}) {
    if (!object.contains(key)) continue;
    const json& stages = object[key];
    std::vector<uint64_t> counts;
    for (size_t i = 0; stages.is_array() && stages.size() == stage_count && i < stage_count; ++i) {
      const json& count = stages[i];
      if (!count.is_number_unsigned() && !(count.is_number_integer() && count.get<int64_t>() >= 0)) break;
      counts.push_back(count.get<uint64_t>());
    }
    if (counts.size() != stage_count) {
      return InvalidArgument("{}.{}: expected an array of {} non-negative integers, got {}", where, key, stage_count,
                             stages.dump().substr(0, 80));
    }
    *out = std::move(counts);
  }
  for (auto [key, out] : {std::pair{"secagg_bytes_per_site", &round.secagg_bytes_per_site},
                          std::pair{"mpi_bytes", &round.mpi_bytes}}) {
    if (!object.contains(key)) continue;
    uint64_t value = 0;
    ESTUARY_RETURN_IF_ERROR(ReadUnsigned(object, key, kMaxU64, where, value));
    *out = value;
  }
  return round;
}

// ---- Files ----------------------------------------------------------------------


// ---- Formatting -------------------------------------------------------------------

std::string FormatBytes(uint64_t bytes) {
  if (bytes < 1024) return fmt::format("{} B", bytes);
  const char* const units[] = {"KiB", "MiB", "GiB", "TiB"};
  double value = double(bytes) / 1024;
  int unit = 0;
  while (value >= 1024 && unit < 3) {
    value /= 1024;
    ++unit;
  }
  return fmt::format("{:.2f} {}", value, units[unit]);
}

std::string EscapeXml(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  }
  return out;
}

// An axis range widened to whole multiples of a 1-2-5 step, giving about
// `target_ticks` ticks.
struct Axis {
  double lo, hi, step;
  int ticks() const { return int(std::lround((hi - lo) / step)) + 1; }
  double tick(int i) const { return lo + i * step; }
};

Axis NiceAxis(double lo, double hi, int target_ticks, double min_step) {
  if (!(hi > lo)) hi = lo + min_step;
  const double raw = (hi - lo) / target_ticks;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double normalized = raw / magnitude;
  double step = (normalized <= 1 ? 1 : normalized <= 2 ? 2 : normalized <= 5 ? 5 : 10) * magnitude;
  step = std::max(step, min_step);
  return {std::floor(lo / step) * step, std::ceil(hi / step) * step, step};
}

// Enough decimals to tell ticks `step` apart, and no more.
int DecimalsFor(double step) {
  return std::max(0, int(-std::floor(std::log10(step) + 1e-9)));
}

constexpr const char* kPalette[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

// Column layout shared by the header and the rows so they always line up.
constexpr const char* kRowFormat = "{:>6} {:>9} {:>9} {:>10} {:>10} {:>8} {:>11} {:>11} {:>11}  {:<12}\n";

}  // namespace

nlohmann::json ToJson(const Report& report) {
  json rounds = json::array();
  for (const RoundReport& r : report.rounds) {
    rounds.push_back({{"round", r.round},
                      {"clients_selected", r.clients_selected},
                      {"updates_received", r.updates_received},
                      {"test_accuracy", NumberOrNull(r.test_accuracy)},
                      {"test_loss", NumberOrNull(r.test_loss)},
                      {"train_loss", NumberOrNull(r.train_loss)},
                      {"seconds", NumberOrNull(r.seconds)},
                      {"bytes_up", r.bytes_up},
                      {"bytes_down", r.bytes_down},
                      {"bytes_per_update", r.bytes_per_update},
                      {"merge_bytes_down", r.merge_bytes_down},
                      {"global_checksum", r.global_checksum}});
    SetIfPresent(rounds.back(), "epsilon", r.epsilon);
    SetIfPresent(rounds.back(), "dp_clip", r.dp_clip);
    SetIfPresent(rounds.back(), "attackers", r.attackers);
    SetIfPresent(rounds.back(), "updates_refused", r.updates_refused);
    SetIfPresent(rounds.back(), "secagg_bytes_per_site", r.secagg_bytes_per_site);
    SetIfPresent(rounds.back(), "secagg_seconds", r.secagg_seconds);
    SetIfPresent(rounds.back(), "secagg_dropouts", r.secagg_dropouts);
    if (r.secagg_dropouts_by_stage) rounds.back()["secagg_dropouts_by_stage"] = *r.secagg_dropouts_by_stage;
    SetIfPresent(rounds.back(), "secagg_error_bound", r.secagg_error_bound);
    SetIfPresent(rounds.back(), "dropouts", r.dropouts);
    if (r.dropouts_by_stage) rounds.back()["dropouts_by_stage"] = *r.dropouts_by_stage;
    SetIfPresent(rounds.back(), "sim_time", r.sim_time);
    SetIfPresent(rounds.back(), "staleness_mean", r.staleness_mean);
    SetIfPresent(rounds.back(), "staleness_max", r.staleness_max);
    SetIfPresent(rounds.back(), "federated_accuracy", r.federated_accuracy);
    SetIfPresent(rounds.back(), "federated_loss", r.federated_loss);
    SetIfPresent(rounds.back(), "federated_examples", r.federated_examples);
    SetIfPresent(rounds.back(), "mpi_bytes", r.mpi_bytes);
  }
  json out = {{"scenario", report.scenario},
              {"mode", report.mode},
              {"round_log", report.round_log.empty() ? json(nullptr) : json(report.round_log)},
              {"rounds", std::move(rounds)},
              {"total_seconds", NumberOrNull(report.total_seconds)},
              {"final_accuracy", NumberOrNull(report.final_accuracy)}};
  SetIfPresent(out, "epsilon", report.epsilon);
  SetIfPresent(out, "delta", report.delta);
  SetIfPresent(out, "attackers", report.attackers);
  if (!report.trained_on.empty()) out["trained_on"] = report.trained_on;
  SetIfPresent(out, "peak_rss_bytes", report.peak_rss_bytes);
  if (report.mpi_ranks) {
    out["mpi_ranks"] = *report.mpi_ranks;
    out["updates_by_rank"] = report.updates_by_rank;
  }
  return out;
}

Result<Report> ReportFromJson(const nlohmann::json& object, std::string_view where) {
  ESTUARY_RETURN_IF_ERROR(CheckKeys(object, kReportKeys, where, kOptionalReportKeys));
  Report report;
  report.scenario = object.at("scenario");
  if (!report.scenario.is_object() && !report.scenario.is_null()) {
    return InvalidArgument("{}.scenario: expected an object, got {}", where,
                           report.scenario.type_name());
  }
  ESTUARY_RETURN_IF_ERROR(ReadString(object, "mode", where, report.mode));
  if (!object.at("round_log").is_null()) {
    ESTUARY_RETURN_IF_ERROR(ReadString(object, "round_log", where, report.round_log));
    if (report.round_log.empty()) {
      return InvalidArgument("{}.round_log: empty; write null when there is none", where);
    }
  }
  const json& rounds = object.at("rounds");
  if (!rounds.is_array()) return InvalidArgument("{}.rounds: expected an array", where);
  for (size_t i = 0; i < rounds.size(); ++i) {
    const std::string round_where = fmt::format("{}.rounds[{}]", where, i);
    ESTUARY_ASSIGN_OR_RETURN(RoundReport round, RoundFromJson(rounds[i], round_where));
    if (!report.rounds.empty() && round.round <= report.rounds.back().round) {
      return InvalidArgument("{}.round: {} does not follow round {}", round_where, round.round,
                             report.rounds.back().round);
    }
    report.rounds.push_back(std::move(round));
  }
  ESTUARY_RETURN_IF_ERROR(ReadNonNegative(object, "total_seconds", where, report.total_seconds));
  ESTUARY_RETURN_IF_ERROR(ReadFraction(object, "final_accuracy", where, report.final_accuracy));
  for (auto [key, out] : {std::pair{"epsilon", &report.epsilon}, std::pair{"delta", &report.delta}}) {
    if (!object.contains(key)) continue;
    double value = 0;
    ESTUARY_RETURN_IF_ERROR(ReadNonNegative(object, key, where, value));
    *out = value;
  }
  if (object.contains("attackers")) {
    uint64_t attackers = 0;
    ESTUARY_RETURN_IF_ERROR(ReadUnsigned(object, "attackers", std::numeric_limits<uint32_t>::max(), where, attackers));
    report.attackers = attackers;
  }
  if (object.contains("peak_rss_bytes")) {
    uint64_t bytes = 0;
    ESTUARY_RETURN_IF_ERROR(
        ReadUnsigned(object, "peak_rss_bytes", std::numeric_limits<uint64_t>::max(), where, bytes));
    report.peak_rss_bytes = bytes;
  }
  if (object.contains("trained_on")) {
    ESTUARY_RETURN_IF_ERROR(ReadString(object, "trained_on", where, report.trained_on));
  }
  if (object.contains("mpi_ranks") != object.contains("updates_by_rank")) {
    return InvalidArgument("{}: mpi_ranks and updates_by_rank come together", where);
  }
  if (object.contains("mpi_ranks")) {
    uint64_t ranks = 0;
    ESTUARY_RETURN_IF_ERROR(ReadUnsigned(object, "mpi_ranks", std::numeric_limits<uint32_t>::max(), where, ranks));
    const json& counts = object.at("updates_by_rank");
    if (!counts.is_array() || counts.size() != ranks) {
      return InvalidArgument("{}.updates_by_rank: expected an array of mpi_ranks ({}) counts", where, ranks);
    }
    for (size_t r = 0; r < counts.size(); ++r) {
      if (!counts[r].is_number_unsigned()) {
        return InvalidArgument("{}.updates_by_rank[{}]: expected a non-negative integer", where, r);
      }
      report.updates_by_rank.push_back(counts[r].get<uint64_t>());
    }
    report.mpi_ranks = ranks;
  }
  return report;
}

Status WriteReport(const std::filesystem::path& path, const Report& report) {
  // Replace invalid UTF-8 rather than throw: a report is worth more than a byte.
  const std::string text =
      ToJson(report).dump(2, ' ', false, json::error_handler_t::replace) + "\n";
  return WriteFileAtomically(path, text);
}

Result<Report> ReadReport(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    if (!std::filesystem::exists(path)) return NotFound("{}: no such report", path.string());
    return IoError("{}: cannot open: {}", path.string(), std::strerror(errno));
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) return IoError("{}: read failed", path.string());
  json object;
  try {
    object = json::parse(buffer.str());
  } catch (const json::parse_error& e) {
    return InvalidArgument("{}: not valid JSON: {}", path.string(), e.what());
  }
  return ReportFromJson(object, path.string());
}

std::string RenderSvgPlot(const std::vector<Report>& runs,
                          const std::vector<std::string>& labels) {
  constexpr double kWidth = 760, kHeight = 440;
  constexpr double kLeft = 70, kTop = 40, kRight = kWidth - 200, kBottom = kHeight - 60;
  constexpr size_t kMaxMarkedPoints = 60;  // beyond this, dots would only clutter

  // Data range over every finite point of every run.
  double min_round = std::numeric_limits<double>::infinity(), max_round = -min_round;
  double min_accuracy = min_round, max_accuracy = -min_round;
  for (const Report& run : runs) {
    for (const RoundReport& r : run.rounds) {
      if (!std::isfinite(r.test_accuracy)) continue;
      min_round = std::min(min_round, double(r.round));
      max_round = std::max(max_round, double(r.round));
      min_accuracy = std::min(min_accuracy, r.test_accuracy);
      max_accuracy = std::max(max_accuracy, r.test_accuracy);
    }
  }
  if (!std::isfinite(min_round)) {  // nothing to plot: an empty but valid chart
    min_round = 0, max_round = 1, min_accuracy = 0, max_accuracy = 1;
  }
  const Axis x = NiceAxis(min_round, max_round, 10, 1);
  Axis y = NiceAxis(min_accuracy, max_accuracy, 8, 0.001);
  // Accuracy lives in [0, 1]; ticks beyond it would mislead.
  y.lo = std::max(y.lo, 0.0);
  y.hi = std::min(y.hi, 1.0);
  if (!(y.hi > y.lo)) y = {std::max(0.0, y.hi - y.step), std::max(y.hi, y.step), y.step};

  auto px = [&](double round) { return kLeft + (round - x.lo) / (x.hi - x.lo) * (kRight - kLeft); };
  auto py = [&](double acc) { return kBottom - (acc - y.lo) / (y.hi - y.lo) * (kBottom - kTop); };

  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" "
      "viewBox=\"0 0 {0} {1}\" font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"{0}\" height=\"{1}\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">Test accuracy per "
      "round</text>\n",
      kWidth, kHeight, (kLeft + kRight) / 2);

  // Grid and tick labels.
  const int y_decimals = DecimalsFor(y.step);
  for (int i = 0; i < y.ticks(); ++i) {
    const double v = y.tick(i), yy = py(v);
    if (v > y.hi + y.step * 1e-6) break;
    svg += fmt::format(
        "<line x1=\"{0}\" y1=\"{1:.1f}\" x2=\"{2}\" y2=\"{1:.1f}\" stroke=\"#e0e0e0\"/>\n"
        "<text x=\"{3}\" y=\"{4:.1f}\" text-anchor=\"end\">{5:.{6}f}</text>\n",
        kLeft, yy, kRight, kLeft - 6, yy + 4, v, y_decimals);
  }
  for (int i = 0; i < x.ticks(); ++i) {
    const double v = x.tick(i), xx = px(v);
    svg += fmt::format(
        "<line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2}\" stroke=\"#e0e0e0\"/>\n"
        "<text x=\"{0:.1f}\" y=\"{3}\" text-anchor=\"middle\">{4}</text>\n",
        xx, kTop, kBottom, kBottom + 18, std::llround(v));
  }
  // Axes and their names.
  svg += fmt::format(
      "<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"black\"/>\n"
      "<line x1=\"{0}\" y1=\"{3}\" x2=\"{0}\" y2=\"{1}\" stroke=\"black\"/>\n"
      "<text x=\"{4}\" y=\"{5}\" text-anchor=\"middle\">round</text>\n"
      "<text x=\"18\" y=\"{6}\" text-anchor=\"middle\" transform=\"rotate(-90 18 {6})\">"
      "test accuracy</text>\n",
      kLeft, kBottom, kRight, kTop, (kLeft + kRight) / 2, kBottom + 40, (kTop + kBottom) / 2);

  // One polyline per run, and its legend entry.
  for (size_t i = 0; i < runs.size(); ++i) {
    const char* color = kPalette[i % std::size(kPalette)];
    const std::string label =
        i < labels.size() && !labels[i].empty() ? labels[i] : fmt::format("run {}", i + 1);
    std::string points, markers;
    size_t finite_points = 0;
    for (const RoundReport& r : runs[i].rounds) {
      if (!std::isfinite(r.test_accuracy)) continue;
      ++finite_points;
      const double xx = px(double(r.round)), yy = py(r.test_accuracy);
      points += fmt::format("{}{:.1f},{:.1f}", points.empty() ? "" : " ", xx, yy);
      markers += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2.5\" fill=\"{}\"/>\n", xx,
                             yy, color);
    }
    svg += fmt::format(
        "<g class=\"run\">\n<title>{0}</title>\n"
        "<polyline fill=\"none\" stroke=\"{1}\" stroke-width=\"2\" points=\"{2}\"/>\n",
        EscapeXml(label), color, points);
    if (finite_points <= kMaxMarkedPoints) svg += markers;
    svg += "</g>\n";
    const double legend_y = kTop + 10 + 20 * double(i);
    svg += fmt::format(
        "<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"{3}\" stroke-width=\"3\"/>\n"
        "<text x=\"{4}\" y=\"{5}\">{6}</text>\n",
        kRight + 20, legend_y, kRight + 44, color, kRight + 50, legend_y + 4, EscapeXml(label));
  }
  svg += "</svg>\n";
  return svg;
}

std::string RenderRoundTableHeader() {
  std::string names = fmt::format(kRowFormat, "round", "clients", "accuracy", "test loss",
                                  "train loss", "seconds", "up", "per update", "down", "checksum");
  return names + std::string(names.size() - 1, '-') + "\n";
}

std::string RenderRoundTable(const std::vector<RoundReport>& rounds) {
  std::string table;
  for (const RoundReport& r : rounds) {
    table += fmt::format(kRowFormat, r.round,
                         fmt::format("{}/{}", r.updates_received, r.clients_selected),
                         fmt::format("{:.2f}%", 100 * r.test_accuracy),
                         fmt::format("{:.4f}", r.test_loss), fmt::format("{:.4f}", r.train_loss),
                         fmt::format("{:.2f}", r.seconds), FormatBytes(r.bytes_up),
                         FormatBytes(r.bytes_per_update), FormatBytes(r.bytes_down), r.global_checksum.substr(0, 12));
  }
  return table;
}

}  // namespace estuary::simulations
