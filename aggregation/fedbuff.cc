#include "aggregation/fedbuff.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>

namespace estuary::aggregation {
namespace {

// One finite number >= 0, the whole of `text`.
bool ParseNonNegative(std::string_view text, double* out) {
  const std::string s(text);
  char* end = nullptr;
  *out = std::strtod(s.c_str(), &end);
  return !s.empty() && *end == '\0' && std::isfinite(*out) && *out >= 0;
}

}  // namespace

double StalenessWeight::operator()(uint64_t staleness) const {
  const double tau = double(staleness);
  switch (kind) {
    case Kind::kPoly:
      return std::pow(1.0 + tau, -a);
    case Kind::kHinge:
      return tau <= b ? 1.0 : 1.0 / (a * (tau - b) + 1.0);
    case Kind::kConstant:
      break;
  }
  return 1.0;
}

std::string StalenessWeight::ToString() const {
  switch (kind) {
    case Kind::kPoly:
      return fmt::format("poly:{}", a);
    case Kind::kHinge:
      return fmt::format("hinge:{},{}", a, b);
    case Kind::kConstant:
      break;
  }
  return "constant";
}

Result<StalenessWeight> ParseStalenessWeight(std::string_view text) {
  StalenessWeight w;
  auto bad = [&] {
    return InvalidArgument("staleness weight '{}': expected constant, poly:A or hinge:A,B (A, B finite and >= 0)",
                           text);
  };
  if (text == "constant") return w;
  if (text.starts_with("poly:")) {
    w.kind = StalenessWeight::Kind::kPoly;
    if (!ParseNonNegative(text.substr(5), &w.a)) return bad();
    return w;
  }
  if (text.starts_with("hinge:")) {
    w.kind = StalenessWeight::Kind::kHinge;
    const std::string_view rest = text.substr(6);
    const size_t comma = rest.find(',');
    if (comma == std::string_view::npos || !ParseNonNegative(rest.substr(0, comma), &w.a) ||
        !ParseNonNegative(rest.substr(comma + 1), &w.b)) {
      return bad();
    }
    return w;
  }
  return bad();
}

Status ValidateFedBuffOptions(const FedBuffOptions& o) {
  if (o.buffer < 1) return InvalidArgument("fedbuff: buffer {}: expected K >= 1 updates a version", o.buffer);
  if (!std::isfinite(o.server_lr) || o.server_lr <= 0) {
    return InvalidArgument("fedbuff: server lr {}: expected finite and > 0", o.server_lr);
  }
  if (!std::isfinite(o.weight.a) || o.weight.a < 0 || !std::isfinite(o.weight.b) || o.weight.b < 0) {
    return InvalidArgument("fedbuff: staleness weight {}: A and B must be finite and >= 0", o.weight.ToString());
  }
  return Status::Ok();
}

Status CheckFedBuffFederation(const v1::FederationConfig& f) {
  const std::string& name = f.strategy().name();
  if (!name.empty() && name != "fedavg") {
    const char* why = name == "scaffold"  ? "its control variates are updated over a round's sites"
                      : name == "fednova" ? "its normalisation is over a round's sites"
                      : name == "fedavgm" || name == "fedadam" || name == "fedyogi" || name == "fedadagrad"
                          ? "FedBuff steps the buffered mean with the server lr alone"
                          : "a robust rule needs a whole round's updates at once";
    return InvalidArgument("fedbuff: strategy {} cannot run asynchronous rounds: {}; use fedavg", name, why);
  }
  if (f.task().update_kind() == v1::UPDATE_LORA) {
    return InvalidArgument("fedbuff: a lora federation cannot run asynchronous rounds: its merge is not a mean of "
                           "deltas");
  }
  if (f.dp().noise_multiplier() > 0) {
    return InvalidArgument("fedbuff: DP-FedAvg cannot run asynchronous rounds: its noise and accountant are per "
                           "sampled round");
  }
  return Status::Ok();
}

FedBuff::FedBuff(const FedBuffOptions& options, size_t size, uint64_t version) : options_(options), version_(version) {
  sum_.Reset(size);
}

Result<FedBuff> FedBuff::Create(const FedBuffOptions& options, size_t size, uint64_t version) {
  ESTUARY_RETURN_IF_ERROR(ValidateFedBuffOptions(options));
  if (size == 0) return InvalidArgument("fedbuff: the model is empty");
  return FedBuff(options, size, version);
}

Result<FedBuff::Folded> FedBuff::Fold(std::span<const float> delta, uint64_t trained_from) {
  if (trained_from > version_) {
    return InvalidArgument("fedbuff: update trained from version {}, but the server is at version {}", trained_from,
                           version_);
  }
  if (sum_.count() >= options_.buffer) {
    return FailedPrecondition("fedbuff: the buffer holds K = {} updates; step the model first", options_.buffer);
  }
  const uint64_t staleness = version_ - trained_from;
  if (staleness > options_.max_staleness) {
    return FailedPrecondition("fedbuff: update from version {} is {} versions stale, beyond --max-staleness {}",
                              trained_from, staleness, options_.max_staleness);
  }
  const double weight = options_.weight(staleness);
  if (Status added = sum_.Add(delta, weight); !added.ok()) {
    return Status(added.code(), fmt::format("fedbuff: {} (version {})", added.message(), version_));
  }
  return Folded{.staleness = staleness, .weight = weight, .full = sum_.count() == options_.buffer};
}

Status FedBuff::Step(std::span<float> global) {
  if (sum_.count() != options_.buffer) {
    return FailedPrecondition("fedbuff: {} of K = {} updates buffered", sum_.count(), options_.buffer);
  }
  if (global.size() != sum_.size()) {
    return InvalidArgument("fedbuff: model has {} values but the buffer {}", global.size(), sum_.size());
  }
  const double scale = options_.server_lr / double(options_.buffer);
  auto next = [&](size_t i) { return static_cast<float>(double(global[i]) + scale * sum_.Sum(i)); };
  // Checked before anything is written: a failed step leaves the model and the buffer.
  for (size_t i = 0; i < global.size(); ++i) {
    if (!std::isfinite(next(i))) {
      return FailedPrecondition("fedbuff: version {}: parameter {} leaves float's range", version_ + 1, i);
    }
  }
  for (size_t i = 0; i < global.size(); ++i) global[i] = next(i);
  sum_.Reset(sum_.size());
  ++version_;
  return Status::Ok();
}

}  // namespace estuary::aggregation
