// The checkpoint directory's half of Checkpointer: its FEDERATION file, and
// reconciling the directory with the round log at Open.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <charconv>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <sstream>

#include "base/atomic_file.h"
#include "server/checkpointer.h"

namespace estuary::server {
namespace fs = std::filesystem;

namespace {

constexpr char kMarkerName[] = "FEDERATION";

struct Marker {
  std::string federation_id;
  uint64_t last_committed = 0;
};

bool IsFederationId(std::string_view id) {
  return id.size() == 32 && id.find_first_not_of("0123456789abcdef") == std::string_view::npos;
}

std::string FreshFederationId() {
  std::random_device entropy;  // the kernel's generator on Linux
  std::string id;
  for (int i = 0; i < 4; ++i) id += fmt::format("{:08x}", uint32_t(entropy()));
  return id;
}

Result<std::optional<Marker>> ReadMarker(const fs::path& dir) {
  const fs::path path = dir / kMarkerName;
  if (!fs::exists(path)) return std::optional<Marker>();
  std::ifstream in(path);
  if (!in) return IoError("server: {}: cannot read", path.string());
  Marker marker;
  bool has_id = false, has_round = false;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    std::string key, value, extra;
    fields >> key >> value >> extra;
    if (key == "federation_id" && IsFederationId(value) && extra.empty()) {
      marker.federation_id = value;
      has_id = true;
      continue;
    }
    const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), marker.last_committed);
    if (key == "last_committed_round" && ec == std::errc() && end == value.data() + value.size() && extra.empty()) {
      has_round = true;
      continue;
    }
    return FailedPrecondition("server: {}:{}: '{}' is not 'federation_id <32 hex digits>' or 'last_committed_round <n>'",
                    path.string(), number, line);
  }
  if (!has_id || !has_round) {
    return FailedPrecondition("server: {}: lacks its {}", path.string(), has_id ? "last_committed_round" : "federation_id");
  }
  return std::optional<Marker>(marker);
}

Status WriteMarker(const fs::path& dir, const Marker& marker) {
  return WriteFileAtomically(dir / kMarkerName,
                             fmt::format("# Estuary: this checkpoint directory's federation, and the last round its "
                                         "round log committed. Do not edit.\nfederation_id {}\nlast_committed_round "
                                         "{}\n",
                                         marker.federation_id, marker.last_committed));
}

// The directory's files by kind: each round's model (and state) files, and
// the temporaries a killed atomic write leaves (".NAME.XXXXXX").
struct Listing {
  std::map<uint64_t, std::vector<fs::path>> rounds;
  std::vector<fs::path> temporaries;
};

Result<Listing> List(const fs::path& dir) {
  static const std::regex kRoundFile(R"(global-r(\d{5,})\.safetensors(\.strategy)?)");
  static const std::regex kTemporary(R"(\.(global-r\d{5,}\.safetensors(\.strategy)?|FEDERATION)\.[A-Za-z0-9]{6})");
  Listing listing;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    std::smatch match;
    if (std::regex_match(name, match, kRoundFile)) {
      listing.rounds[std::stoull(match[1].str())].push_back(entry.path());
    } else if (std::regex_match(name, kTemporary)) {
      listing.temporaries.push_back(entry.path());
    }
  }
  if (ec) return IoError("server: {}: cannot list: {}", dir.string(), ec.message());
  return listing;
}

std::string Names(const std::map<uint64_t, std::vector<fs::path>>& rounds) {
  std::vector<std::string> names;
  for (const auto& [round, files] : rounds) {
    for (const auto& file : files) names.push_back(file.filename().string());
  }
  if (names.size() > 3) names.resize(3), names.push_back("...");
  return fmt::format("{}", fmt::join(names, ", "));
}

}  // namespace

Status Checkpointer::Reconcile(const LogView& log) {
  ESTUARY_ASSIGN_OR_RETURN(std::optional<Marker> marker, ReadMarker(dir_));
  ESTUARY_ASSIGN_OR_RETURN(Listing listing, List(dir_));
  const uint64_t logged = log.last_committed;
  const std::string dir = dir_.string();
  constexpr char kStartAfresh[] = "to start a new federation, give a new --db and an empty --checkpoint-dir";

  if (!marker) {
    if (log.federation_id && !(logged == 0 && listing.rounds.empty())) {
      return FailedPrecondition("server: {} has no {} file, but the round log {} records federation {} up to round "
                                "{}: is this the directory that belongs to the log?",
                                dir, kMarkerName, log.path, *log.federation_id, logged);
    }
    // A log older than federation ids is adopted as it stands: Restore
    // still checks its last checkpoint against its checksum.
    if (!log.federation_id && logged == 0 && !listing.rounds.empty()) {
      return FailedPrecondition("server: {} holds checkpoints ({}) but no {} file, and the round log {} holds no "
                                "round: refusing to start a new federation over them; {}",
                                dir, Names(listing.rounds), kMarkerName, log.path, kStartAfresh);
    }
    is_new_ = !log.federation_id && logged == 0;
    marker = Marker{log.federation_id.value_or(FreshFederationId()), logged};
    ESTUARY_RETURN_IF_ERROR(WriteMarker(dir_, *marker));
  } else if (!log.federation_id) {
    // The marker is written before the log's meta row: a server stopped
    // between the two left a marker of nothing committed.
    if (logged != 0 || marker->last_committed != 0) {
      return FailedPrecondition("server: the round log {} holds no federation, but {} holds federation {} committed "
                                "up to round {}: the log is missing, empty or truncated; restore it (with its -wal "
                                "file), or {}",
                                log.path, dir, marker->federation_id, marker->last_committed, kStartAfresh);
    }
  } else if (*log.federation_id != marker->federation_id) {
    return FailedPrecondition("server: the round log {} records federation {} but {} holds federation {}: they "
                              "belong to different federations",
                              log.path, *log.federation_id, dir, marker->federation_id);
  } else if (logged < marker->last_committed) {
    return FailedPrecondition("server: the round log {} ends at round {} but {} says round {} was committed: the log "
                              "lost rounds {}..{} (a missing or truncated -wal file?); restore it, or {}",
                              log.path, logged, dir, marker->last_committed, logged + 1, marker->last_committed,
                              kStartAfresh);
  } else if (logged > marker->last_committed) {
    // Stopped between the log's commit and the marker's (or the marker's
    // write failed): the log is right, and Restore checks its checkpoint.
    marker->last_committed = logged;
    ESTUARY_RETURN_IF_ERROR(WriteMarker(dir_, *marker));
  }

  federation_id_ = marker->federation_id;
  last_committed_ = logged;
  metadata_["federation_id"] = federation_id_;
  // Written but never committed (the server stopped, or the round failed,
  // after the write): the round runs again and writes its own.
  for (auto it = listing.rounds.upper_bound(logged); it != listing.rounds.end(); ++it) {
    for (const auto& file : it->second) listing.temporaries.push_back(file);
  }
  for (const auto& file : listing.temporaries) {
    std::error_code ec;
    fs::remove(file, ec);
    if (ec) return IoError("server: {}: cannot remove a leftover: {}", file.string(), ec.message());
    removed_.push_back(file.filename().string());
  }
  return Status::Ok();
}

Status Checkpointer::MarkCommitted(uint64_t round) {
  ESTUARY_RETURN_IF_ERROR(WriteMarker(dir_, {federation_id_, round}));
  last_committed_ = round;
  return Status::Ok();
}

}  // namespace estuary::server
