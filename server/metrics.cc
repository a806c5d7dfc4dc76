#include "server/metrics.h"

#include <fmt/format.h>

#include <bit>
#include <cmath>
#include <cctype>

namespace estuary::server {

void Metrics::AtomicDouble::Add(double v) {
  uint64_t old = bits.load(std::memory_order_relaxed);
  while (!bits.compare_exchange_weak(old, std::bit_cast<uint64_t>(std::bit_cast<double>(old) + v),
                                     std::memory_order_relaxed)) {
  }
}
void Metrics::AtomicDouble::Set(double v) { bits.store(std::bit_cast<uint64_t>(v), std::memory_order_relaxed); }
double Metrics::AtomicDouble::Get() const { return std::bit_cast<double>(bits.load(std::memory_order_relaxed)); }

void Metrics::RoundEnded(RoundState state, double seconds) {
  (state == RoundState::kCommitted ? committed_ : failed_).fetch_add(1, std::memory_order_relaxed);
  for (size_t i = 0; i < kRoundSecondsBuckets.size(); ++i) {
    if (seconds <= kRoundSecondsBuckets[i]) round_buckets_[i].fetch_add(1, std::memory_order_relaxed);
  }
  round_count_.fetch_add(1, std::memory_order_relaxed);
  round_seconds_sum_.Add(seconds);
}

void Metrics::UploadRejected(v1::Error::Code code) {
  const size_t at = size_t(code) < rejected_.size() ? size_t(code) : 0;
  rejected_[at].fetch_add(1, std::memory_order_relaxed);
}

void Metrics::Folded(uint64_t bytes, double seconds) {
  folds_.fetch_add(1, std::memory_order_relaxed);
  folded_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  fold_seconds_.Add(seconds);
}

void Metrics::SetEpsilon(double epsilon, double delta) {
  epsilon_.Set(epsilon);
  delta_.Set(delta);
  dp_.store(true, std::memory_order_relaxed);
}

namespace {

// Prometheus's float format: +Inf, -Inf and NaN spelled its way.
std::string Number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);
}

void Family(std::string& out, const char* name, const char* type, const char* help) {
  fmt::format_to(std::back_inserter(out), "# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

// v1::Error::Code's name as a label value: BAD_CHUNK -> bad_chunk.
std::string ReasonLabel(int code) {
  std::string name = v1::Error::Code_IsValid(code) ? v1::Error::Code_Name(v1::Error::Code(code)) : "unspecified";
  for (char& c : name) c = char(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

}  // namespace

std::string Metrics::Render() const {
  auto get = [](const std::atomic<uint64_t>& v) { return v.load(std::memory_order_relaxed); };
  std::string out;
  auto line = [&out](const std::string& sample, const std::string& value) {
    out += sample;
    out += ' ';
    out += value;
    out += '\n';
  };

  Family(out, "estuary_rounds_total", "counter", "Rounds that ended, by how they ended.");
  line(R"(estuary_rounds_total{state="committed"})", fmt::format("{}", get(committed_)));
  line(R"(estuary_rounds_total{state="failed"})", fmt::format("{}", get(failed_)));

  Family(out, "estuary_round_duration_seconds", "histogram", "Seconds from a round's opening to its end.");
  for (size_t i = 0; i < kRoundSecondsBuckets.size(); ++i) {
    line(fmt::format(R"(estuary_round_duration_seconds_bucket{{le="{}"}})", Number(kRoundSecondsBuckets[i])),
         fmt::format("{}", get(round_buckets_[i])));
  }
  line(R"(estuary_round_duration_seconds_bucket{le="+Inf"})", fmt::format("{}", get(round_count_)));
  line("estuary_round_duration_seconds_sum", Number(round_seconds_sum_.Get()));
  line("estuary_round_duration_seconds_count", fmt::format("{}", get(round_count_)));

  Family(out, "estuary_round", "gauge", "The round open or last opened.");
  line("estuary_round", fmt::format("{}", get(round_)));
  Family(out, "estuary_connected_sites", "gauge", "Sites connected and identified.");
  line("estuary_connected_sites", fmt::format("{}", get(connected_)));
  Family(out, "estuary_selected_sites", "gauge", "Sites selected for the round open or last opened.");
  line("estuary_selected_sites", fmt::format("{}", get(selected_)));

  Family(out, "estuary_received_bytes_total", "counter", "Frame bytes read from sites.");
  line("estuary_received_bytes_total", fmt::format("{}", get(received_)));
  Family(out, "estuary_sent_bytes_total", "counter", "Frame bytes written to sites.");
  line("estuary_sent_bytes_total", fmt::format("{}", get(sent_)));

  Family(out, "estuary_uploads_rejected_total", "counter", "Uploads rejected, by the error the site was sent.");
  for (size_t code = 0; code < rejected_.size(); ++code) {
    if (code != 0 && !v1::Error::Code_IsValid(int(code))) continue;
    line(fmt::format(R"(estuary_uploads_rejected_total{{reason="{}"}})", ReasonLabel(int(code))),
         fmt::format("{}", get(rejected_[code])));
  }

  Family(out, "estuary_folds_total", "counter", "Updates folded into the aggregate.");
  line("estuary_folds_total", fmt::format("{}", get(folds_)));
  Family(out, "estuary_folded_bytes_total", "counter", "Bytes of the updates folded.");
  line("estuary_folded_bytes_total", fmt::format("{}", get(folded_bytes_)));
  Family(out, "estuary_fold_seconds_total", "counter",
         "Seconds the worker spent folding (folded bytes over this: the fold throughput).");
  line("estuary_fold_seconds_total", Number(fold_seconds_.Get()));

  Family(out, "estuary_handshakes_refused_total", "counter", "TLS handshakes refused (certificate, protocol, name).");
  line("estuary_handshakes_refused_total", fmt::format("{}", get(handshakes_refused_)));

  if (dp_.load(std::memory_order_relaxed)) {
    Family(out, "estuary_dp_epsilon", "gauge", "Differential privacy: epsilon spent after the last committed round.");
    line(fmt::format(R"(estuary_dp_epsilon{{delta="{}"}})", Number(delta_.Get())), Number(epsilon_.Get()));
  }
  return out;
}

}  // namespace estuary::server
