#include "server/operator_views.h"

#include <fmt/chrono.h>

#include <nlohmann/json.hpp>

#include <algorithm>

#include "base/utc.h"
#include "crypto/revocation.h"

namespace estuary::server {

namespace {

using nlohmann::ordered_json;

// The log's times are milliseconds since the epoch; 0: not yet.
std::string Utc(int64_t ms) {
  if (ms <= 0) return "-";
  return estuary::Utc(std::chrono::system_clock::time_point(std::chrono::milliseconds(ms)));
}

std::string Metric(const std::optional<double>& v, int precision = 4) {
  return v ? fmt::format("{:.{}f}", *v, precision) : "-";
}

std::string Megabytes(uint64_t bytes) { return fmt::format("{:.2f}", double(bytes) / (1 << 20)); }

ordered_json Nullable(const std::optional<double>& v) { return v ? ordered_json(*v) : ordered_json(nullptr); }

double Seconds(const RoundRecord& r) { return r.ended_ms > 0 ? double(r.ended_ms - r.started_ms) / 1000.0 : 0.0; }

uint32_t Dropped(Store& store, uint64_t round) {
  auto participations = store.Participations(round);
  uint32_t n = 0;
  if (participations.ok()) {
    for (const auto& p : *participations) n += (p.status == "dropped" || p.status == "late");
  }
  return n;
}

ordered_json SecAggJson(const RoundSecAgg& a) {
  ordered_json stages = ordered_json::array();
  for (int i = 0; i < RoundSecAgg::kStageCount; ++i) {
    stages.push_back({{"stage", RoundSecAgg::kStages[i]},
                      {"answered", a.answered[i]},
                      {"dropouts", a.dropouts[i]},
                      {"bytes_up", a.bytes_up[i]},
                      {"bytes_down", a.bytes_down[i]}});
  }
  return {{"stage_reached", a.stage}, {"sites", a.sites},   {"neighbours", a.neighbours}, {"threshold", a.threshold},
          {"bits", a.bits},           {"clip", a.clip},     {"scale", a.scale},           {"stages", std::move(stages)}};
}

ordered_json EvaluationJson(const RoundEvaluation& e) {
  return {{"accuracy", Nullable(e.accuracy)}, {"loss", e.reported > 0 ? ordered_json(e.loss) : ordered_json(nullptr)},
          {"examples", e.examples},           {"accuracy_examples", e.accuracy_examples},
          {"sites_selected", e.selected},     {"sites_reported", e.reported},
          {"sites_unsupported", e.unsupported}, {"sites_failed", e.failed},
          {"seconds", e.seconds}};
}

// The federated columns, in a log with an evaluated round only.
std::string Federated(const RoundRecord& r) {
  if (!r.evaluation) return fmt::format("  {:>8}  {:>9}", "-", "-");
  const RoundEvaluation& e = *r.evaluation;
  return fmt::format("  {:>8}  {:>9}", Metric(e.accuracy),
                     Metric(e.reported > 0 ? std::optional<double>(e.loss) : std::nullopt));
}

ordered_json RoundJson(const RoundRecord& r) {
  return {{"round", r.round},
          {"state", RoundStateName(r.state)},
          {"started", Utc(r.started_ms)},
          {"ended", r.ended_ms > 0 ? ordered_json(Utc(r.ended_ms)) : ordered_json(nullptr)},
          {"seconds", Seconds(r)},
          {"model_version", r.model_version},
          {"global_checksum", r.global_checksum},
          {"strategy", r.strategy},
          {"clients_selected", r.clients_selected},
          {"updates_received", r.updates_received},
          {"train_loss", r.train_loss},
          {"test_accuracy", Nullable(r.test_accuracy)},
          {"test_loss", Nullable(r.test_loss)},
          {"bytes_up", r.bytes_up},
          {"bytes_down", r.bytes_down},
          {"detail", r.detail},
          {"privacy", r.privacy ? ordered_json{{"epsilon", r.privacy->epsilon},
                                               {"delta", r.privacy->delta},
                                               {"sampling_rate", r.privacy->sampling_rate},
                                               {"noise_multiplier", r.privacy->noise_multiplier},
                                               {"clip", r.privacy->clip},
                                               {"noise_stddev", r.privacy->noise_stddev}}
                                : ordered_json(nullptr)},
          {"protocol", r.secagg ? "secagg" : "plain"},
          {"secagg", r.secagg ? SecAggJson(*r.secagg) : ordered_json(nullptr)},
          {"federated_evaluation", r.evaluation ? EvaluationJson(*r.evaluation) : ordered_json(nullptr)}};
}

// The ε column, in a DP federation's log only.
std::string Epsilon(const RoundRecord& r) { return r.privacy ? fmt::format("  {:>8.4g}", r.privacy->epsilon) : ""; }

}  // namespace

Status ListRounds(Store& store, bool json, std::string* out) {
  ESTUARY_ASSIGN_OR_RETURN(auto rounds, store.Rounds());
  if (json) {
    ordered_json array = ordered_json::array();
    for (const auto& r : rounds) {
      auto row = RoundJson(r);
      row["dropped"] = Dropped(store, r.round);
      array.push_back(std::move(row));
    }
    *out = array.dump(2) + "\n";
    return Status::Ok();
  }
  const bool private_log = std::any_of(rounds.begin(), rounds.end(), [](const auto& r) { return r.privacy; });
  const double delta = private_log ? std::find_if(rounds.begin(), rounds.end(), [](const auto& r) {
                                       return r.privacy.has_value();
                                     })->privacy->delta
                                   : 0;
  const bool evaluated_log = std::any_of(rounds.begin(), rounds.end(), [](const auto& r) { return r.evaluation; });
  *out = fmt::format("{:>5}  {:<10}  {:<20}  {:>8}  {:>4}  {:>4}  {:>4}  {:>10}  {:>8}  {:>9}{}  {:>8}  {:>8}{}  {}\n",
                     "round", "state", "started (UTC)", "seconds", "sel", "recv", "drop", "train loss", "test acc",
                     "test loss", evaluated_log ? fmt::format("  {:>8}  {:>9}", "fed acc", "fed loss") : "", "MB up",
                     "MB down", private_log ? fmt::format("  {:>8}", "ε") : "", "checksum");
  for (const auto& r : rounds) {
    *out += fmt::format(
        "{:>5}  {:<10}  {:<20}  {:>8.2f}  {:>4}  {:>4}  {:>4}  {:>10.4f}  {:>8}  {:>9}{}  {:>8}  {:>8}{}  {}\n", r.round,
        RoundStateName(r.state), Utc(r.started_ms), Seconds(r), r.clients_selected, r.updates_received,
        Dropped(store, r.round), r.train_loss, Metric(r.test_accuracy), Metric(r.test_loss),
        evaluated_log ? Federated(r) : "", Megabytes(r.bytes_up), Megabytes(r.bytes_down),
        private_log ? (r.privacy ? Epsilon(r) : fmt::format("  {:>8}", "-")) : "", r.global_checksum.substr(0, 12));
  }
  if (evaluated_log) *out += "fed: the global model on the sites' own held-out examples (federated evaluation)\n";
  if (private_log) *out += fmt::format("ε: differential privacy spent after the round, at δ = {:g}\n", delta);
  if (rounds.empty()) *out += "(no rounds yet)\n";
  return Status::Ok();
}

Status ShowRound(Store& store, uint64_t round, bool json, std::string* out) {
  ESTUARY_ASSIGN_OR_RETURN(auto record, store.GetRound(round));
  if (!record) return NotFound("round {} is not in the round log", round);
  ESTUARY_ASSIGN_OR_RETURN(auto participants, store.Participations(round));
  ESTUARY_ASSIGN_OR_RETURN(auto transitions, store.Transitions(round));
  ESTUARY_ASSIGN_OR_RETURN(auto arrivals, store.Arrivals(round));
  const RoundRecord& r = *record;
  if (json) {
    ordered_json doc = RoundJson(r);
    doc["participants"] = ordered_json::array();
    for (const auto& p : participants) {
      doc["participants"].push_back({{"client", p.client}, {"status", p.status}, {"examples", p.examples},
                                     {"train_loss", p.train_loss}, {"bytes_up", p.bytes_up},
                                     {"bytes_down", p.bytes_down}, {"seconds", p.seconds}, {"detail", p.detail}});
    }
    // Asynchronous rounds: the updates of this version, in arrival order (empty for a round).
    doc["arrivals"] = ordered_json::array();
    for (const auto& a : arrivals) {
      doc["arrivals"].push_back({{"seq", a.seq}, {"client", a.client}, {"status", a.status},
                                 {"trained_from", a.trained_from}, {"staleness", a.staleness}, {"weight", a.weight},
                                 {"examples", a.examples}, {"train_loss", a.train_loss}, {"bytes_up", a.bytes_up},
                                 {"seconds", a.seconds}, {"at", Utc(a.at_ms)}, {"detail", a.detail}});
    }
    doc["transitions"] = ordered_json::array();
    for (const auto& t : transitions) {
      doc["transitions"].push_back({{"from", RoundStateName(t.from)}, {"to", RoundStateName(t.to)},
                                    {"at", Utc(t.at_ms)}, {"detail", t.detail}});
    }
    *out = doc.dump(2) + "\n";
    return Status::Ok();
  }
  *out = fmt::format(
      "round {}: {}\n  started   {}\n  ended     {}\n  seconds   {:.2f}\n  model     version {}, sha256 {}\n"
      "  strategy  {}\n  updates   {} of {} selected\n  train     loss {:.4f}\n  test      accuracy {}, loss {}\n"
      "  bytes     {} up, {} down\n",
      r.round, RoundStateName(r.state), Utc(r.started_ms), Utc(r.ended_ms), Seconds(r), r.model_version,
      r.global_checksum.empty() ? "-" : r.global_checksum, r.strategy, r.updates_received, r.clients_selected,
      r.train_loss, Metric(r.test_accuracy), Metric(r.test_loss), r.bytes_up, r.bytes_down);
  if (r.privacy) {
    const RoundPrivacy& p = *r.privacy;
    *out += fmt::format("  privacy   ε {:.4g} at δ {:g} after this round (sampling rate {:.4g}, noise multiplier {:g}, "
                        "clip {:.4g}, noise stddev {:.4g})\n",
                        p.epsilon, p.delta, p.sampling_rate, p.noise_multiplier, p.clip, p.noise_stddev);
  }
  if (r.secagg) {
    const RoundSecAgg& a = *r.secagg;
    *out += fmt::format("  protocol  secagg: {} sites, k {}, t {}, {} bits, clip {:g}, scale {:g}; reached {}\n", a.sites,
                        a.neighbours, a.threshold, a.bits, a.clip, a.scale, a.stage);
    *out += fmt::format("  {:<19}  {:>8}  {:>8}  {:>12}  {:>12}\n", "  stage", "answered", "dropouts", "bytes up",
                        "bytes down");
    for (int i = 0; i < RoundSecAgg::kStageCount; ++i) {
      *out += fmt::format("  {:<19}  {:>8}  {:>8}  {:>12}  {:>12}\n", fmt::format("  {}", RoundSecAgg::kStages[i]),
                          a.answered[i], a.dropouts[i], a.bytes_up[i], a.bytes_down[i]);
    }
  } else {
    *out += "  protocol  plain\n";
  }
  if (r.evaluation) {
    const RoundEvaluation& e = *r.evaluation;
    *out += fmt::format("  federated accuracy {}, loss {} over {} held-out examples of {} of {} sites ({} do not "
                        "evaluate, {} failed; {:.2f} s)\n",
                        Metric(e.accuracy), Metric(e.reported > 0 ? std::optional<double>(e.loss) : std::nullopt),
                        e.examples, e.reported, e.selected, e.unsupported, e.failed, e.seconds);
  }
  if (!r.detail.empty()) *out += fmt::format("  detail    {}\n", r.detail);
  *out += fmt::format("\n  {:<20}  {:<10}  {:>8}  {:>8}  {:>10}  {:>10}  {:>8}  {}\n", "client", "status", "examples",
                      "loss", "bytes up", "bytes down", "seconds", "detail");
  for (const auto& p : participants) {
    *out += fmt::format("  {:<20}  {:<10}  {:>8}  {:>8.4f}  {:>10}  {:>10}  {:>8.2f}  {}\n", p.client, p.status,
                        p.examples, p.train_loss, p.bytes_up, p.bytes_down, p.seconds, p.detail);
  }
  if (!arrivals.empty()) {
    *out += fmt::format("\n  arrivals (asynchronous: each update weighted by s(staleness), staleness = this version - 1 "
                        "- the version it trained from)\n  {:>4}  {:<20}  {:<8}  {:>5}  {:>9}  {:>8}  {:>8}  {:>8}  "
                        "{:>8}  {}\n",
                        "seq", "client", "status", "from", "staleness", "weight", "examples", "loss", "seconds", "detail");
    for (const auto& a : arrivals) {
      *out += fmt::format("  {:>4}  {:<20}  {:<8}  {:>5}  {:>9}  {:>8.4f}  {:>8}  {:>8.4f}  {:>8.2f}  {}\n", a.seq,
                          a.client, a.status, a.trained_from, a.staleness, a.weight, a.examples, a.train_loss,
                          a.seconds, a.detail);
    }
  }
  *out += "\n  transitions\n";
  for (const auto& t : transitions) {
    *out += fmt::format("  {}  {:>11} -> {:<11} {}\n", Utc(t.at_ms), RoundStateName(t.from), RoundStateName(t.to),
                        t.detail);
  }
  return Status::Ok();
}

Status ListClients(Store& store, bool json, std::string* out) {
  ESTUARY_ASSIGN_OR_RETURN(auto clients, store.Clients());
  if (json) {
    ordered_json array = ordered_json::array();
    for (const auto& c : clients) {
      array.push_back({{"name", c.name}, {"first_seen", Utc(c.first_seen_ms)}, {"last_seen", Utc(c.last_seen_ms)},
                       {"last_address", c.last_address}, {"rounds_joined", c.rounds_joined},
                       {"rounds_dropped", c.rounds_dropped}});
    }
    *out = array.dump(2) + "\n";
    return Status::Ok();
  }
  *out = fmt::format("{:<20}  {:<20}  {:<20}  {:<22}  {:>6}  {:>7}\n", "client", "first seen (UTC)", "last seen (UTC)",
                     "last address", "joined", "dropped");
  for (const auto& c : clients) {
    *out += fmt::format("{:<20}  {:<20}  {:<20}  {:<22}  {:>6}  {:>7}\n", c.name, Utc(c.first_seen_ms),
                        Utc(c.last_seen_ms), c.last_address, c.rounds_joined, c.rounds_dropped);
  }
  if (clients.empty()) *out += "(no clients yet)\n";
  return Status::Ok();
}

Status ListEvents(Store& store, int limit, bool json, std::string* out) {
  if (limit < 1) return InvalidArgument("events: --limit {}: expected 1 or more", limit);
  ESTUARY_ASSIGN_OR_RETURN(auto events, store.Events(limit));
  if (json) {
    ordered_json array = ordered_json::array();
    for (const auto& e : events) {
      array.push_back({{"at", Utc(e.at_ms)}, {"kind", e.kind}, {"peer", e.peer}, {"detail", e.detail}});
    }
    *out = array.dump(2) + "\n";
    return Status::Ok();
  }
  *out = fmt::format("{:<20}  {:<19}  {:<32}  {}\n", "at (UTC)", "event", "peer", "detail");
  for (const auto& e : events) {
    *out += fmt::format("{:<20}  {:<19}  {:<32}  {}\n", Utc(e.at_ms), e.kind, e.peer, e.detail);
  }
  if (events.empty()) *out += "(no events)\n";
  return Status::Ok();
}

Status ListCertificates(const std::filesystem::path& dir, bool json, std::string* out) {
  ESTUARY_ASSIGN_OR_RETURN(auto certs, crypto::ListCertificates(dir));
  if (json) {
    ordered_json array = ordered_json::array();
    for (const auto& c : certs) {
      ordered_json revoked = nullptr;
      if (c.revocation) {
        revoked = {{"at", estuary::Utc(c.revocation->revoked_at)},
                   {"reason", crypto::RevocationReasonName(c.revocation->reason)}};
      }
      array.push_back({{"name", c.name}, {"role", c.role}, {"hosts", c.hosts}, {"serial", c.serial},
                       {"not_after", estuary::Utc(c.not_after)}, {"state", crypto::CertificateStateName(c.state)},
                       {"revoked", revoked}});
    }
    *out = array.dump(2) + "\n";
    return Status::Ok();
  }
  *out = fmt::format("{:<20}  {:<6}  {:<34}  {:<20}  {}\n", "name", "role", "serial", "not after (UTC)", "state");
  for (const auto& c : certs) {
    std::string state = crypto::CertificateStateName(c.state);
    if (c.revocation) {
      state += fmt::format(" {} ({})", estuary::Utc(c.revocation->revoked_at), crypto::RevocationReasonName(c.revocation->reason));
    }
    // Neither end takes a certificate of both roles any more (crypto/tls.h).
    if (c.role == "both") state += "; issued before certificate roles: issue it anew";
    *out += fmt::format("{:<20}  {:<6}  {:<34}  {:<20}  {}\n", c.name, c.role, c.serial, estuary::Utc(c.not_after),
                        state);
  }
  if (certs.empty()) *out += "(no certificates besides the CA's)\n";
  return Status::Ok();
}

}  // namespace estuary::server
