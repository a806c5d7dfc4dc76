// estuary-server: the aggregation server and the operator's tools.
//
//   estuary-server certs init  --dir D              a federation CA
//   estuary-server certs issue --dir D --name N     a site's certificate (--role server: the server's)
//   estuary-server certs revoke --dir D --name N    add a site's certificate to D/crl.pem
//   estuary-server certs crl --dir D                re-sign D/crl.pem with a fresh validity
//   estuary-server certs list --dir D               each certificate: serial, expiry, valid/expired/revoked
//   estuary-server serve ...                        run the federation (flags or --config)
//   estuary-server rounds list|show N|watch --db F  the round log
//   estuary-server clients --db F                   the client registry
//   estuary-server events --db F                    refused handshakes, rejected frames, revocations
//   estuary-server export --db F --out D [--round N]  a round's model: PEFT adapter, base, merged (lora),
//                                                     model.safetensors (--initial-model)
#include <fmt/ranges.h>

#include <google/protobuf/text_format.h>

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "aggregation/federation_flags.h"
#include "base/cli.h"
#include "base/config_file.h"
#include "base/memory.h"
#include "crypto/certs.h"
#include "crypto/revocation.h"
#include "proto/frame.h"
#include "server/export.h"
#include "server/operator_views.h"
#include "server/server.h"
#include "server/watch.h"

extern "C" void openblas_set_num_threads(int);

namespace {

// Whether a federation file gives limits.max_norm_over_median a value (a
// file read over the defaults cannot say 0, so --secagg's default of none
// applies unless it says something else).
bool SetsMaxNormOverMedian(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  estuary::v1::FederationConfig given;
  google::protobuf::TextFormat::Parser parser;
  parser.AllowPartialMessage(true);
  return parser.ParseFromString(text.str(), &given) && given.limits().max_norm_over_median() != 0;
}


using namespace estuary;

int Fail(const Status& status) { return estuary::Fail("estuary-server", status); }

int Print(const Status& status, const std::string& out) {
  if (!status.ok()) return Fail(status);
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  estuary::proto::QuietProtobufLog();
  // The server's only BLAS work is evaluation on a small test set; idle BLAS
  // threads would spin against the I/O thread and co-located clients.
  RetainFreedMemory();
  openblas_set_num_threads(1);
  CLI::App app{"estuary-server: federated learning aggregation server"};
  ShowDefaultsInHelp(app);
  app.require_subcommand(1);

  // certs
  auto* certs = app.add_subcommand("certs", "create the federation CA, issue and revoke certificates");
  certs->require_subcommand(1);
  std::string cert_dir, cert_name, ca_name = "estuary-ca";
  int cert_days = 825;
  auto* init = certs->add_subcommand("init", "create DIR/ca.pem and DIR/ca.key");
  init->add_option("--dir", cert_dir, "directory for the CA")->required();
  init->add_option("--name", ca_name, "the CA's common name");
  auto* issue = certs->add_subcommand("issue", "issue DIR/NAME.pem and DIR/NAME.key signed by DIR/ca.*");
  issue->add_option("--dir", cert_dir, "directory holding ca.pem and ca.key")->required();
  issue->add_option("--name", cert_name, "the certificate's name (DIR/NAME.pem): a site's identity in the federation")
      ->required();
  issue->add_option("--days", cert_days, "validity in days");
  std::string cert_role;
  std::vector<std::string> cert_dns, cert_ips;
  issue->add_option("--role", cert_role,
                    "site: a site's certificate, for client authentication only; server: the server's, for server "
                    "authentication as the hosts in --dns/--ip (default: server for --name server, site otherwise)")
      ->check(CLI::IsMember({"site", "server"}));
  issue->add_option("--dns", cert_dns, "a DNS name sites reach the server by (repeatable; the server role only)");
  issue->add_option("--ip", cert_ips,
                    "an IP address sites reach the server by (repeatable; the server role only; with no --dns or "
                    "--ip: localhost, 127.0.0.1 and ::1)");
  std::string revoke_reason = "unspecified";
  int crl_days = 365;
  auto* revoke = certs->add_subcommand("revoke", "revoke DIR/NAME.pem: add its serial to DIR/crl.pem, signed by DIR/ca.*");
  revoke->add_option("--dir", cert_dir, "directory holding ca.pem, ca.key and NAME.pem")->required();
  revoke->add_option("--name", cert_name, "the site whose certificate is revoked")->required();
  revoke->add_option("--reason", revoke_reason,
                     "unspecified | keyCompromise | affiliationChanged | superseded | cessationOfOperation");
  revoke->add_option("--days", crl_days, "the list's validity in days (its next update)");
  bool certs_json = false;
  auto* cert_list = certs->add_subcommand("list", "every certificate in DIR: serial, expiry, valid | expired | revoked");
  cert_list->add_option("--dir", cert_dir, "directory holding ca.pem (and crl.pem)")->required();
  cert_list->add_flag("--json", certs_json, "machine-readable output");
  auto* crl = certs->add_subcommand("crl", "re-sign DIR/crl.pem (an empty one if none) with a fresh validity");
  crl->add_option("--dir", cert_dir, "directory holding ca.pem and ca.key")->required();
  crl->add_option("--days", crl_days, "the list's validity in days (its next update)");

  // serve
  auto* serve = app.add_subcommand("serve", "run the aggregation server");
  server::ServerConfig config;
  std::string config_file, federation_file, log_level = "info";
  serve->add_option("--config", config_file, "TOML file with the same keys as these flags");
  serve->add_option("--listen", config.listen, "HOST:PORT to listen on (port 0: any free port)");
  serve->add_option("--metrics-listen", config.metrics_listen,
                    "HOST:PORT of a plain-HTTP Prometheus endpoint, GET /metrics (default: none; port 0: any free port)");
  serve->add_option("--tensorboard", config.tensorboard,
                    "DIR: a TensorBoard event file of every committed round's scalars (tensorboard --logdir DIR)");
  serve->add_option("--cert", config.tls.cert, "server certificate (PEM)");
  serve->add_option("--key", config.tls.key, "server private key (PEM)");
  serve->add_option("--ca", config.tls.ca, "federation CA certificate (PEM)");
  serve->add_option("--crl", config.tls.crl,
                    "the CA's revocation list (PEM; estuary-server certs revoke): revoked sites are refused; "
                    "SIGHUP rereads it");
  serve->add_option("--db", config.db, "SQLite round log");
  serve->add_option("--checkpoint-dir", config.checkpoint_dir, "where global models are written (default DB.checkpoints)");
  serve->add_option("--eval-data", config.eval_data,
                    "what the server evaluates each global model on: an IDX directory's test split (text models: a "
                    "fortunes directory; instruction tuning: a JSON Lines file of held-out examples, scored on "
                    "their responses)");
  serve->add_option("--tokenizer", config.tokenizer,
                    "an instruction --eval-data's tokenizer.json (default: the Hugging Face --base-model's own)");
  serve->add_option("--mode", config.mode,
                    "sync (rounds) | async (FedBuff: no round barrier, a new model version every --buffer updates)");
  serve->add_option("--rounds", config.rounds, "number of rounds (async: model versions committed)");
  serve->add_option("--buffer", config.async.buffer, "async: K, the accepted updates folded into each model version");
  serve->add_option("--concurrency", config.async.concurrency,
                    "async: C, the sites training at once, drawn with the seed from those idle (0: every connected "
                    "site)");
  serve->add_option("--staleness-weight", config.async.staleness_weight,
                    "async: constant | poly:A ((1+τ)^-A) | hinge:A,B (1 up to B versions stale, then 1/(A(τ-B)+1))");
  serve->add_option("--max-staleness", config.async.max_staleness,
                    "async: refuse an update more versions stale than this (-1: none)");
  serve->add_option("--clients-per-round", config.clients_per_round, "count (>= 1) or fraction (< 1) sampled per round");
  serve->add_option("--evaluate-every", config.evaluate_every,
                    "every N rounds (and after the last) the sites score the global model on their own held-out "
                    "examples: federated evaluation, in the round log (0: never)");
  serve->add_option("--evaluate-clients", config.evaluate_clients,
                    "sites asked to evaluate: count (>= 1) or fraction (< 1) of the connected sites that evaluate "
                    "(0: all)");
  serve->add_option("--min-clients", config.min_clients, "connected clients needed to start a round");
  serve->add_option("--min-updates", config.min_updates, "updates needed to aggregate at the deadline");
  serve->add_option("--round-deadline", config.round_deadline_s, "seconds a round collects updates");
  serve->add_option("--max-frame", config.max_frame_bytes, "largest frame accepted, bytes");
  serve->add_option("--chunk-bytes", config.chunk_bytes, "tensor chunk size, bytes");
  serve->add_option("--staging-slots", config.staging_slots, "uploads staged at once");
  serve->add_option("--staging-memory", config.staging_memory_bytes, "bytes per upload held in memory before spilling to disk");
  serve->add_option("--idle-timeout", config.idle_timeout_s, "seconds without a frame before a client is dropped");
  serve->add_option("--handshake-timeout", config.handshake_timeout_s, "seconds a TLS handshake may take");
  serve->add_option("--write-timeout", config.write_timeout_s,
                    "seconds a frame may wait to be written before the peer is dropped as one that does not read");
  serve->add_option("--download-slot-timeout", config.download_slot_timeout_s,
                    "seconds a model download may hold one of the two download places before the next starts "
                    "beside it");
  serve->add_option("--max-handshakes", config.max_handshakes,
                    "connections between accept and their hello, at once; more are closed at once");
  serve->add_option("--max-handshakes-per-address", config.max_handshakes_per_address,
                    "the same, from one peer address");
  serve->add_option("--frame-memory", config.frame_memory_bytes,
                    "bytes of frames being received and model chunks being sent, all connections together");
  serve->add_option("--io-threads", config.io_threads, "threads running the connections");
  serve->add_option("--event-interval", config.event_interval_s,
                    "seconds over which repeated events from one address are summarised in one log line and row");
  serve->add_flag("--exit-when-done", config.exit_when_done, "exit after the last round");
  serve->add_flag("--secagg", config.secagg.on,
                  "each round's FedAvg sum through SecAgg+ over the sites' connections: the server sees only the sum "
                  "(full updates; docs/SECAGG.md)");
  serve->add_option("--secagg-neighbours", config.secagg.neighbours,
                    "--secagg: neighbours k per site, even and < sites a round, or sites - 1 (0: about 3 log2 n)");
  serve->add_option("--secagg-threshold", config.secagg.threshold,
                    "--secagg: shares t that rebuild a secret, a strict majority of k (0: k/2 + 1)");
  serve->add_option("--secagg-bits", config.secagg.bits, "--secagg: the ring Z/2^bits the sum is taken in, 2..32");
  serve->add_option("--secagg-clip", config.secagg.clip,
                    "--secagg: L2 norm each site clips its update to before quantisation");
  serve->add_option("--dp", config.dp_mode,
                    "with --dp-noise-multiplier: central (DP-FedAvg noises the sum on the server) | distributed "
                    "(with --secagg: each site adds its share of discrete Gaussian noise before masking; "
                    "docs/PRIVACY.md)");
  serve->add_option("--dp-survivors", config.dp_survivors,
                    "--dp distributed: the fraction of a round's sites whose shares make the full noise; the server "
                    "unmasks no sum of fewer inputs");
  serve->add_option("--sample-rate", config.sample_rate,
                    "Poisson sampling: each connected site joins each round with probability Q, instead of "
                    "--clients-per-round (with DP: the accountant's q; the mean divides by Q x --total-sites, and "
                    "distributed DP plans its noise shares for them)");
  serve->add_option("--sample-seed", config.sample_seed,
                    "--sample-rate: draw from this seed instead of the server's CSPRNG (tests; 0: CSPRNG)");
  AddLogLevelFlag(*serve, &log_level);
  const std::vector<CLI::Option*> federation_flags = aggregation::AddFederationFlags(*serve, &config.federation);
  serve->add_option("--federation", federation_file,
                    "the whole federation (task, strategy, seed, base model) from a protobuf text file "
                    "(proto/federation.proto) instead of its flags");

  // rounds, clients, events, export: the operator's views of a round log
  std::string db;
  bool json = false;
  uint64_t round_number = 0;
  // A view of the round log at --db, in text or (--json) for machines.
  auto add_view = [&](CLI::App* parent, const std::string& name, const std::string& help) {
    auto* view = parent->add_subcommand(name, help);
    view->add_option("--db", db, "SQLite round log")->required();
    view->add_flag("--json", json, "machine-readable output");
    return view;
  };
  auto* rounds = app.add_subcommand("rounds", "inspect the round log");
  rounds->require_subcommand(1);
  auto* list = add_view(rounds, "list", "one line per round");
  auto* show = add_view(rounds, "show", "one round: participants, dropouts, metrics");
  show->add_option("round", round_number, "round number")->required();
  server::WatchOptions watch_options;
  auto* watch = rounds->add_subcommand("watch", "follow a live federation: the round running, its arrivals, the ETA");
  watch->add_option("--db", db, "SQLite round log")->required();
  watch->add_option("--interval", watch_options.interval_s, "seconds between refreshes")->check(CLI::PositiveNumber);
  watch->add_flag("--once", watch_options.once, "print the view once and exit");
  int event_limit = 50;
  auto* events = add_view(&app, "events", "refused handshakes, rejected frames, revoked certificates");
  events->add_option("--limit", event_limit, "the last N events");
  auto* clients = add_view(&app, "clients", "the client registry");
  std::string export_dir;
  auto* export_round = app.add_subcommand("export", "a committed round's model for other tools: a PEFT adapter, "
                                                    "its base and the merged model (lora), a Hugging Face model, or "
                                                    "model.safetensors (a federation of an --initial-model)");
  export_round->add_option("--db", db, "SQLite round log")->required();
  export_round->add_option("--round", round_number, "the round (default: the last committed)");
  export_round->add_option("--out", export_dir, "directory to write into")->required();

  if (auto exit = ParseCommandLine(app, argc, argv, "estuary-server")) return *exit;

  if (init->parsed()) {
    if (Status s = crypto::InitCa(cert_dir, ca_name); !s.ok()) return Fail(s);
    std::printf("created %s/ca.pem and %s/ca.key\n", cert_dir.c_str(), cert_dir.c_str());
    return 0;
  }
  if (issue->parsed()) {
    if (cert_days < 1) return Fail(InvalidArgument("certs issue: --days {}: a certificate is valid for 1 day or more", cert_days));
    crypto::CertOptions options;
    options.not_after = std::chrono::hours(24 * int64_t(cert_days));
    // "server" names the server in every script and README line since before
    // roles: it keeps meaning the server's certificate.
    const bool server_role = cert_role.empty() ? cert_name == "server" : cert_role == "server";
    if (!server_role && (!cert_dns.empty() || !cert_ips.empty())) {
      return Fail(InvalidArgument("certs issue: --dns and --ip name the server's hosts; a site's certificate (--role "
                                  "site) names none"));
    }
    options.role = server_role ? crypto::CertRole::kServer : crypto::CertRole::kSite;
    options.dns = cert_dns;
    options.ips = cert_ips;
    if (Status s = crypto::IssueCertificate(cert_dir, cert_name, options); !s.ok()) return Fail(s);
    std::vector<std::string> hosts = cert_dns;
    hosts.insert(hosts.end(), cert_ips.begin(), cert_ips.end());
    if (hosts.empty()) hosts = {"localhost", "127.0.0.1", "::1"};
    const std::string what = server_role ? fmt::format("the server's, for {}", fmt::join(hosts, ", ")) : "a site's";
    std::printf("issued %s/%s.pem and %s/%s.key: %s\n", cert_dir.c_str(), cert_name.c_str(), cert_dir.c_str(),
                cert_name.c_str(), what.c_str());
    return 0;
  }
  if (cert_list->parsed()) {
    std::string out;
    return Print(server::ListCertificates(cert_dir, certs_json, &out), out);
  }
  if (revoke->parsed() || crl->parsed()) {
    if (crl_days < 1) return Fail(InvalidArgument("certs: --days {}: a revocation list is valid for 1 day or more", crl_days));
    const crypto::CrlOptions options{.valid_for = std::chrono::hours(24 * int64_t(crl_days))};
    const std::filesystem::path dir(cert_dir), crl_path = dir / "crl.pem";
    bool changed = true;
    std::string serial;
    if (revoke->parsed()) {
      auto reason = crypto::ParseRevocationReason(revoke_reason);
      if (!reason.ok()) return Fail(reason.status());
      auto revoked = crypto::RevokeCertificate(dir, cert_name, *reason, options);
      if (!revoked.ok()) return Fail(revoked.status());
      changed = *revoked;
      if (auto read = crypto::CertificateSerial(dir / (cert_name + ".pem")); read.ok()) serial = *read;
    } else if (Status s = crypto::RenewCrl(dir, options); !s.ok()) {
      return Fail(s);
    }
    auto info = crypto::ReadCrl(crl_path, dir / "ca.pem");
    if (!info.ok()) return Fail(info.status());
    if (revoke->parsed() && !changed) {
      std::printf("%s (serial %s) was already revoked; %s unchanged\n", cert_name.c_str(), serial.c_str(),
                  crl_path.c_str());
      return 0;
    }
    if (revoke->parsed()) std::printf("revoked %s (serial %s, %s)\n", cert_name.c_str(), serial.c_str(), revoke_reason.c_str());
    std::printf("wrote %s: CRL number %llu, %zu revoked certificate(s), valid for %d days; a running server "
                "started with --crl applies it on SIGHUP\n",
                crl_path.c_str(), static_cast<unsigned long long>(info->number), info->revoked.size(), crl_days);
    return 0;
  }
  if (export_round->parsed()) {
    auto store = server::Store::OpenReadOnly(db);
    if (!store.ok()) return Fail(store.status());
    const auto round = round_number > 0 ? std::optional<uint64_t>(round_number) : std::nullopt;
    auto exported = server::ExportRound(**store, round, export_dir);
    if (!exported.ok()) return Fail(exported.status());
    std::printf("%s (sha256 %s)\n", exported->description.c_str(), exported->checksum.substr(0, 12).c_str());
    for (const auto& dir : exported->written) std::printf("  wrote %s\n", dir.c_str());
    return 0;
  }
  if (watch->parsed()) {
    watch_options.redraw = isatty(STDOUT_FILENO) != 0;
    if (Status watched = server::Watch(db, watch_options, stdout); !watched.ok()) return Fail(watched);
    return 0;
  }
  if (list->parsed() || show->parsed() || clients->parsed() || events->parsed()) {
    auto store = server::Store::OpenReadOnly(db);
    if (!store.ok()) return Fail(store.status());
    std::string out;
    if (list->parsed()) return Print(server::ListRounds(**store, json, &out), out);
    if (show->parsed()) return Print(server::ShowRound(**store, round_number, json, &out), out);
    if (events->parsed()) return Print(server::ListEvents(**store, event_limit, json, &out), out);
    return Print(server::ListClients(**store, json, &out), out);
  }

  // serve
  if (!config_file.empty()) {
    if (Status s = ApplyConfigFile(*serve, config_file); !s.ok()) return Fail(s);
  }
  if (config.tls.cert.empty() || config.tls.key.empty() || config.tls.ca.empty()) {
    return Fail(InvalidArgument("serve: --cert, --key and --ca are required (mutual TLS is not optional)"));
  }
  if (!federation_file.empty()) {
    for (const CLI::Option* flag : federation_flags) {
      if (flag->count() > 0) {
        return Fail(InvalidArgument("serve: {} with --federation {}: the file defines the whole federation",
                                    flag->get_name(), federation_file));
      }
    }
    auto federation = aggregation::ReadFederationFile(federation_file);
    if (!federation.ok()) return Fail(federation.status());
    config.federation = std::move(federation).value();
  }
  if (config.sample_rate > 0 && serve->get_option("--clients-per-round")->count() > 0) {
    return Fail(InvalidArgument("serve: --sample-rate and --clients-per-round both choose a round's sites: give one"));
  }
  if (config.secagg.on && serve->get_option("--max-norm-over-median")->count() == 0 &&
      (federation_file.empty() || !SetsMaxNormOverMedian(federation_file))) {
    // The server never sees an update's norm under secure aggregation; the
    // sites clip to --secagg-clip instead of the default relative bound.
    config.federation.mutable_limits()->set_max_norm_over_median(0);
  }
  StartLogging("estuary-server", log_level);
  auto server = server::Server::Create(std::move(config));
  if (!server.ok()) return Fail(server.status());
  if (Status s = (*server)->Run(); !s.ok()) return Fail(s);
  return 0;
}
