// Tests of simulations/report: the JSON record, its validation, the atomic
// file write, the SVG plot and the console table. Suites are named
// simulations_* because ctest -R matches GoogleTest names, not targets.
#include "simulations/report.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>

namespace estuary::simulations {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

RoundReport MakeRound(uint64_t round, double accuracy) {
  RoundReport r;
  r.round = round;
  r.clients_selected = 10;
  r.updates_received = 9;
  r.test_accuracy = accuracy;
  r.test_loss = 0.1 + 1.0 / double(round);
  r.train_loss = 0.2 + 1.0 / double(round);
  r.seconds = 1.25 * double(round);
  r.bytes_up = 3'000'000'000ull + round;  // past 32 bits on purpose
  r.bytes_down = 1536 * round;
  r.bytes_per_update = 333'333'333ull + round;
  r.merge_bytes_down = 4096 * round;
  r.global_checksum = fmt::format("{:064x}", round * 0x9e3779b97f4a7c15ull);
  return r;
}

Report MakeReport(int rounds, double start_accuracy = 0.5) {
  Report report;
  report.scenario = {{"name", "mnist-fedavg"}, {"clients", 10}, {"partition", "dirichlet:0.5"}};
  report.mode = "inproc";
  report.round_log = "run/rounds.sqlite";
  for (int i = 1; i <= rounds; ++i) {
    report.rounds.push_back(MakeRound(i, start_accuracy + 0.4 * (1 - 1.0 / i)));
  }
  report.total_seconds = 42.5;
  report.final_accuracy = report.rounds.empty() ? 0 : report.rounds.back().test_accuracy;
  return report;
}

void ExpectSameReport(const Report& a, const Report& b) {
  EXPECT_EQ(a.scenario, b.scenario);
  EXPECT_EQ(a.mode, b.mode);
  EXPECT_EQ(a.round_log, b.round_log);
  EXPECT_EQ(a.rounds, b.rounds);
  EXPECT_EQ(a.total_seconds, b.total_seconds);
  EXPECT_EQ(a.final_accuracy, b.final_accuracy);
}

// A fresh directory under the build tree, removed afterwards.
class TempDir {
 public:
  TempDir() : path_(fs::path(ESTUARY_BINARY_DIR) / "tmp" /
                    fmt::format("report_test.{}.{}", ::getpid(), counter_++)) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

std::string ReadText(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteText(const fs::path& path, const std::string& text) { std::ofstream(path) << text; }

size_t CountOf(const std::string& haystack, const std::string& needle) {
  size_t count = 0;
  for (size_t at = haystack.find(needle); at != std::string::npos;
       at = haystack.find(needle, at + 1)) {
    ++count;
  }
  return count;
}

// ---- JSON ----------------------------------------------------------------------

TEST(simulations_report_json, HasExactlyTheDocumentedKeys) {
  const json j = ToJson(MakeReport(3));
  std::set<std::string> top;
  for (const auto& [key, value] : j.items()) top.insert(key);
  EXPECT_EQ(top, (std::set<std::string>{"scenario", "mode", "round_log", "rounds",
                                        "total_seconds", "final_accuracy"}));
  ASSERT_TRUE(j["rounds"].is_array());
  ASSERT_EQ(j["rounds"].size(), 3u);
  for (const json& round : j["rounds"]) {
    std::set<std::string> keys;
    for (const auto& [key, value] : round.items()) keys.insert(key);
    EXPECT_EQ(keys, (std::set<std::string>{"round", "clients_selected", "updates_received",
                                           "test_accuracy", "test_loss", "train_loss", "seconds",
                                           "bytes_up", "bytes_down", "bytes_per_update", "merge_bytes_down",
                                           "global_checksum"}));
  }
  EXPECT_EQ(j["rounds"][2]["round"], 3);
  EXPECT_EQ(j["rounds"][0]["bytes_up"].get<uint64_t>(), 3'000'000'001ull);
  EXPECT_EQ(j["mode"], "inproc");
  EXPECT_EQ(j["scenario"]["partition"], "dirichlet:0.5");
}

TEST(simulations_report_json, RoundLogIsNullWhenThereIsNone) {
  Report report = MakeReport(1);
  EXPECT_EQ(ToJson(report)["round_log"], "run/rounds.sqlite");
  report.round_log.clear();
  EXPECT_TRUE(ToJson(report)["round_log"].is_null());
  Result<Report> back = ReportFromJson(ToJson(report));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(back->round_log.empty());
}

TEST(simulations_report_json, RoundTripsThroughAFile) {
  TempDir dir;
  const fs::path path = dir.path() / "report.json";
  const Report report = MakeReport(25);
  ASSERT_TRUE(WriteReport(path, report).ok());
  Result<Report> back = ReadReport(path);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ExpectSameReport(report, *back);  // doubles too: JSON keeps them exact
  // Indented for people reading it, with a final newline for tools.
  const std::string text = ReadText(path);
  EXPECT_NE(text.find("\n  \"mode\": \"inproc\""), std::string::npos) << text.substr(0, 200);
  EXPECT_EQ(text.back(), '\n');

  // Writing again replaces the file and leaves no temporary behind.
  ASSERT_TRUE(WriteReport(path, MakeReport(2)).ok());
  Result<Report> second = ReadReport(path);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->rounds.size(), 2u);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
}

TEST(simulations_report_json, SecAggFieldsRoundTripAndAreAbsentWithoutIt) {
  TempDir dir;
  const fs::path path = dir.path() / "report.json";
  Report report = MakeReport(2);
  report.rounds[1].secagg_bytes_per_site = 801'322;
  report.rounds[1].secagg_seconds = 0.25;
  report.rounds[1].secagg_dropouts = 3;
  report.rounds[1].secagg_error_bound = 4.66e-7;
  ASSERT_TRUE(WriteReport(path, report).ok());
  Result<Report> back = ReadReport(path);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ExpectSameReport(report, *back);
  const nlohmann::json json = ToJson(report);
  EXPECT_FALSE(json["rounds"][0].contains("secagg_bytes_per_site"));
  EXPECT_EQ(json["rounds"][1]["secagg_dropouts"], 3);
}

// --dropout without --secagg: the dropouts and their two stages; a run
// without it has neither key, and a stage array of another length is refused.
TEST(simulations_report_json, DropoutFieldsRoundTripAndAreAbsentWithoutIt) {
  TempDir dir;
  const fs::path path = dir.path() / "report.json";
  Report report = MakeReport(2);
  EXPECT_FALSE(ToJson(report)["rounds"][1].contains("dropouts"));
  report.rounds[1].dropouts = 3;
  report.rounds[1].dropouts_by_stage = std::vector<uint64_t>{1, 2};
  ASSERT_TRUE(WriteReport(path, report).ok());
  Result<Report> back = ReadReport(path);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ExpectSameReport(report, *back);
  EXPECT_EQ(back->rounds[1].dropouts_by_stage, (std::vector<uint64_t>{1, 2}));
  EXPECT_FALSE(back->rounds[0].dropouts.has_value());
  json bad = ToJson(report);
  bad["rounds"][1]["dropouts_by_stage"] = json::array({1, 2, 0, 0});
  EXPECT_EQ(ReportFromJson(bad).status().message(),
            "report.rounds[1].dropouts_by_stage: expected an array of 2 non-negative integers, got [1,2,0,0]");
}

TEST(simulations_report_json, SimulatedTimeAndStalenessRoundTrip) {
  TempDir dir;
  const fs::path path = dir.path() / "report.json";
  Report report = MakeReport(2);
  report.rounds[0].sim_time = 40;
  report.rounds[1].sim_time = 120;
  report.rounds[1].staleness_mean = 0.7;
  report.rounds[1].staleness_max = 3;
  ASSERT_TRUE(WriteReport(path, report).ok());
  Result<Report> back = ReadReport(path);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ExpectSameReport(report, *back);
  EXPECT_EQ(back->rounds[1].staleness_max, 3u);
  EXPECT_FALSE(ToJson(report)["rounds"][0].contains("staleness_max"));
  json bad = ToJson(report);
  bad["rounds"][1]["sim_time"] = -1;
  EXPECT_FALSE(ReportFromJson(bad).ok());
}

// An mpirun run's ranks, the updates each sent and each round's bytes between
// ranks; a run of one process has none of the keys.
TEST(simulations_report_json, MpiFieldsRoundTripAndComeTogether) {
  TempDir dir;
  const fs::path path = dir.path() / "report.json";
  Report report = MakeReport(2);
  EXPECT_FALSE(ToJson(report).contains("mpi_ranks"));
  EXPECT_FALSE(ToJson(report)["rounds"][0].contains("mpi_bytes"));
  report.mpi_ranks = 3;
  report.updates_by_rank = {4, 3, 3};
  report.rounds[0].mpi_bytes = 5'578'040;
  report.rounds[1].mpi_bytes = 4'781'200;
  ASSERT_TRUE(WriteReport(path, report).ok());
  Result<Report> back = ReadReport(path);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ExpectSameReport(report, *back);
  EXPECT_EQ(back->mpi_ranks, 3u);
  EXPECT_EQ(back->updates_by_rank, (std::vector<uint64_t>{4, 3, 3}));
  json bad = ToJson(report);
  bad["updates_by_rank"] = json::array({4, 3});
  EXPECT_NE(ReportFromJson(bad).status().message().find("updates_by_rank"), std::string::npos);
  bad.erase("updates_by_rank");
  EXPECT_NE(ReportFromJson(bad).status().message().find("come together"), std::string::npos);
}

TEST(simulations_report_json, NonFiniteMetricsBecomeNullAndComeBackAsNaN) {
  Report report = MakeReport(2);
  report.rounds[1].test_loss = std::numeric_limits<double>::quiet_NaN();
  report.rounds[1].train_loss = std::numeric_limits<double>::infinity();
  const json j = ToJson(report);
  EXPECT_TRUE(j["rounds"][1]["test_loss"].is_null());
  EXPECT_TRUE(j["rounds"][1]["train_loss"].is_null());
  Result<Report> back = ReportFromJson(json::parse(j.dump()));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(std::isnan(back->rounds[1].test_loss));
  EXPECT_TRUE(std::isnan(back->rounds[1].train_loss));
  EXPECT_EQ(back->rounds[0].test_loss, report.rounds[0].test_loss);
}

TEST(simulations_report_json, ValidationNamesTheBadField) {
  const json good = ToJson(MakeReport(3));
  ASSERT_TRUE(ReportFromJson(good).ok());
  struct Case {
    const char* what;
    std::function<void(json&)> damage;
    const char* message_part;
  };
  const std::vector<Case> cases = {
      {"not an object", [](json& j) { j = json::array(); }, "expected an object"},
      {"missing key", [](json& j) { j.erase("mode"); }, "missing key \"mode\""},
      {"unknown key", [](json& j) { j["extra"] = 1; }, "unknown key \"extra\""},
      {"mode type", [](json& j) { j["mode"] = 3; }, "report.mode"},
      {"scenario type", [](json& j) { j["scenario"] = "x"; }, "report.scenario"},
      {"empty round_log", [](json& j) { j["round_log"] = ""; }, "round_log"},
      {"rounds type", [](json& j) { j["rounds"] = json::object(); }, "report.rounds"},
      {"round key missing", [](json& j) { j["rounds"][1].erase("seconds"); },
       "report.rounds[1]: missing key \"seconds\""},
      {"round key unknown", [](json& j) { j["rounds"][0]["loss"] = 1; }, "unknown key \"loss\""},
      {"negative round", [](json& j) { j["rounds"][0]["round"] = -1; }, "rounds[0].round"},
      {"fractional bytes", [](json& j) { j["rounds"][2]["bytes_up"] = 1.5; }, "rounds[2].bytes_up"},
      {"clients over 32 bits", [](json& j) { j["rounds"][0]["clients_selected"] = 1ull << 32; },
       "clients_selected"},
      {"accuracy as percent", [](json& j) { j["rounds"][1]["test_accuracy"] = 97.5; },
       "rounds[1].test_accuracy: 97.5 is not in [0, 1]"},
      {"loss as string", [](json& j) { j["rounds"][1]["test_loss"] = "0.3"; }, "test_loss"},
      {"negative seconds", [](json& j) { j["rounds"][1]["seconds"] = -2; }, "seconds"},
      {"checksum type", [](json& j) { j["rounds"][1]["global_checksum"] = 5; }, "global_checksum"},
      {"rounds out of order", [](json& j) { j["rounds"][2]["round"] = 1; }, "does not follow"},
      {"final accuracy", [](json& j) { j["final_accuracy"] = 2; }, "final_accuracy"},
  };
  for (const Case& c : cases) {
    json bad = good;
    c.damage(bad);
    Result<Report> result = ReportFromJson(bad);
    ASSERT_FALSE(result.ok()) << c.what;
    EXPECT_EQ(result.status().code(), Code::kInvalidArgument) << c.what;
    EXPECT_NE(result.status().message().find(c.message_part), std::string::npos)
        << c.what << ": " << result.status().message();
  }
}

TEST(simulations_report_json, ReadReportExplainsBadFiles) {
  TempDir dir;
  Result<Report> missing = ReadReport(dir.path() / "absent.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), Code::kNotFound);

  const fs::path truncated = dir.path() / "truncated.json";
  WriteText(truncated, ToJson(MakeReport(2)).dump().substr(0, 40));
  Result<Report> broken = ReadReport(truncated);
  ASSERT_FALSE(broken.ok());
  EXPECT_EQ(broken.status().code(), Code::kInvalidArgument);
  EXPECT_NE(broken.status().message().find("not valid JSON"), std::string::npos);

  // Validation errors name the file.
  const fs::path wrong = dir.path() / "wrong.json";
  json j = ToJson(MakeReport(2));
  j["rounds"][0]["test_accuracy"] = "high";
  WriteText(wrong, j.dump());
  Result<Report> invalid = ReadReport(wrong);
  ASSERT_FALSE(invalid.ok());
  EXPECT_NE(invalid.status().message().find(wrong.string() + ".rounds[0].test_accuracy"),
            std::string::npos)
      << invalid.status().message();
}

TEST(simulations_report_json, WriteReportFailsCleanlyIntoAMissingDirectory) {
  TempDir dir;
  Status status = WriteReport(dir.path() / "no" / "such" / "report.json", MakeReport(1));
  EXPECT_FALSE(status.ok());
  EXPECT_EQ(status.code(), Code::kIo);
}

// ---- SVG -------------------------------------------------------------------------

TEST(simulations_report_svg, OnePolylinePerRunWithLegendAndAxes) {
  const std::vector<Report> runs = {MakeReport(20, 0.5), MakeReport(20, 0.3), MakeReport(5, 0.6)};
  const std::string svg = RenderSvgPlot(runs, {"iid", "dirichlet:0.1 <skewed> & \"odd\"", "short"});
  EXPECT_EQ(svg.rfind("<svg", 0), 0u) << svg.substr(0, 80);
  EXPECT_NE(svg.find("xmlns=\"http://www.w3.org/2000/svg\""), std::string::npos);
  EXPECT_EQ(svg.substr(svg.size() - 7), "</svg>\n");
  EXPECT_EQ(CountOf(svg, "<polyline"), 3u);
  EXPECT_EQ(CountOf(svg, "<svg"), 1u);
  // Legend text, escaped.
  EXPECT_NE(svg.find(">iid</text>"), std::string::npos);
  EXPECT_NE(svg.find("dirichlet:0.1 &lt;skewed&gt; &amp; &quot;odd&quot;"), std::string::npos);
  EXPECT_EQ(svg.find("<skewed>"), std::string::npos);
  EXPECT_NE(svg.find(">round</text>"), std::string::npos);
  EXPECT_NE(svg.find(">test accuracy</text>"), std::string::npos);
  // Every opened element is closed or self-closing: count tags crudely.
  EXPECT_EQ(CountOf(svg, "<text"), CountOf(svg, "</text>"));
  EXPECT_EQ(CountOf(svg, "<g "), CountOf(svg, "</g>"));
}

TEST(simulations_report_svg, PointsFollowTheData) {
  // One run whose accuracy rises: later rounds are drawn further right and
  // higher up (smaller y in SVG coordinates).
  const std::string svg = RenderSvgPlot({MakeReport(4, 0.5)}, {"rising"});
  const size_t at = svg.find("points=\"");
  ASSERT_NE(at, std::string::npos);
  std::istringstream points(svg.substr(at + 8, svg.find('"', at + 8) - at - 8));
  std::vector<std::pair<double, double>> xy;
  std::string pair;
  while (points >> pair) {
    const size_t comma = pair.find(',');
    xy.emplace_back(std::stod(pair.substr(0, comma)), std::stod(pair.substr(comma + 1)));
  }
  ASSERT_EQ(xy.size(), 4u);
  for (size_t i = 1; i < xy.size(); ++i) {
    EXPECT_GT(xy[i].first, xy[i - 1].first);
    EXPECT_LT(xy[i].second, xy[i - 1].second);
  }
  for (const auto& [x, y] : xy) {  // inside the 760 x 440 canvas
    EXPECT_GT(x, 0);
    EXPECT_LT(x, 760);
    EXPECT_GT(y, 0);
    EXPECT_LT(y, 440);
  }
}

TEST(simulations_report_svg, CopesWithMissingLabelsEmptyRunsAndNaN) {
  Report with_nan = MakeReport(3);
  with_nan.rounds[1].test_accuracy = std::numeric_limits<double>::quiet_NaN();
  const std::string svg = RenderSvgPlot({with_nan, Report{}, MakeReport(1)}, {});
  EXPECT_EQ(CountOf(svg, "<polyline"), 3u);
  EXPECT_NE(svg.find(">run 1</text>"), std::string::npos);
  EXPECT_NE(svg.find(">run 3</text>"), std::string::npos);
  EXPECT_EQ(svg.find("nan"), std::string::npos);
  EXPECT_EQ(svg.find("inf"), std::string::npos);
  // No runs at all still gives a valid, empty chart.
  const std::string empty = RenderSvgPlot({}, {});
  EXPECT_EQ(empty.rfind("<svg", 0), 0u);
  EXPECT_EQ(CountOf(empty, "<polyline"), 0u);
}

// ---- Table -------------------------------------------------------------------------

TEST(simulations_report_table, RowsLineUpWithTheHeader) {
  const std::string header = RenderRoundTableHeader();
  ASSERT_EQ(CountOf(header, "\n"), 2u);
  const std::string names = header.substr(0, header.find('\n'));
  EXPECT_NE(names.find("round"), std::string::npos);
  EXPECT_NE(names.find("accuracy"), std::string::npos);

  const Report report = MakeReport(12);
  const std::string table = RenderRoundTable(report.rounds);
  EXPECT_EQ(CountOf(table, "\n"), 12u);
  std::istringstream lines(table);
  std::string line;
  while (std::getline(lines, line)) {
    // The checksum column is cut to 12 characters, so every row is as wide as the header.
    EXPECT_EQ(line.size(), names.size()) << line;
  }
  const std::string first = RenderRoundTable({report.rounds[0]});
  EXPECT_EQ(table.rfind(first, 0), 0u);  // printing rows one by one gives the same text
  EXPECT_NE(first.find("9/10"), std::string::npos) << first;
  EXPECT_NE(first.find(fmt::format("{:.2f}%", 100 * report.rounds[0].test_accuracy)),
            std::string::npos)
      << first;
  EXPECT_NE(first.find("2.79 GiB"), std::string::npos) << first;  // 3,000,000,001 bytes
  EXPECT_NE(first.find("1.50 KiB"), std::string::npos) << first;
  EXPECT_EQ(RenderRoundTable({}), "");
}

}  // namespace
}  // namespace estuary::simulations
