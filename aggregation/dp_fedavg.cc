#include "aggregation/dp_fedavg.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace estuary::aggregation {

namespace {

constexpr const char* kClipKey = "dp/clip";

// An adaptive clip norm lives in float, as the checkpoint holds it; a fixed
// one is C exactly.
double StartingClip(const DpOptions& options) { return options.adaptive ? float(options.clip) : options.clip; }

}  // namespace

Result<DpUploadReference> LoraUploadReference(const LoraStrategyOptions& options) {
  DpUploadReference reference;
  reference.upload = ExpectedLoraUpload(options);
  for (const TensorSpec& spec : reference.upload.tensors) {
    const TensorSpec* global = options.layout.adapter.Find(spec.name);
    if (global == nullptr) return Internal("dp: upload tensor {} is not in the global adapter", spec.name);
    reference.slices.emplace_back(options.layout.adapter_offset() + global->offset, spec.numel());
  }
  return reference;
}

DpFedAvg::DpFedAvg(std::unique_ptr<Strategy> inner, DpOptions options, std::optional<DpUploadReference> reference)
    : inner_(std::move(inner)),
      options_(std::move(options)),
      reference_(std::move(reference)),
      name_(fmt::format("{}+dp", inner_->name())),
      clip_(StartingClip(options_)) {}

Result<double> DpFedAvg::SumNoiseMultiplier(const DpOptions& options, uint64_t sampled) {
  if (!options.adaptive) return options.noise_multiplier;
  const double count_stddev =
      options.clipped_count_stddev > 0 ? options.clipped_count_stddev : 0.05 * double(sampled);
  const double z = options.noise_multiplier;
  if (!(z < 2 * count_stddev)) {
    return FailedPrecondition("dp: noise multiplier {} with adaptive clipping needs dp_clipped_count_stddev above {} "
                              "(it is {}: {})",
                              z, z / 2, count_stddev,
                              options.clipped_count_stddev > 0 ? "as set" : fmt::format("0.05 × {} sampled", sampled));
  }
  return 1.0 / std::sqrt(1.0 / (z * z) - 1.0 / (4 * count_stddev * count_stddev));
}

Status DpFedAvg::Begin(uint64_t round, std::span<const float> global) {
  round_open_ = false;
  if (planned_ == 0) return FailedPrecondition("dp: round {}: no sampled sites planned before Begin", round);
  ESTUARY_RETURN_IF_ERROR(SumNoiseMultiplier(options_, planned_).status());
  ESTUARY_RETURN_IF_ERROR(inner_->Begin(round, global));
  size_t size = global.size();
  reference_values_.clear();
  if (reference_) {
    for (const auto& [offset, count] : reference_->slices) {
      if (offset + count > global.size()) {
        return InvalidArgument("dp: global model has {} values, the adapter needs {}", global.size(), offset + count);
      }
      reference_values_.insert(reference_values_.end(), global.begin() + offset, global.begin() + offset + count);
    }
    size = reference_values_.size();
  }
  if (options_.seed) {
    ESTUARY_ASSIGN_OR_RETURN(noise_, GaussianStream::Seeded(*options_.seed, round));
  } else {
    ESTUARY_ASSIGN_OR_RETURN(noise_, GaussianStream::Unpredictable());
  }
  sum_.assign(size, 0.0);
  round_ = round;
  sampled_ = planned_;
  denominator_ = planned_expected_ > 0 ? planned_expected_ : double(sampled_);
  planned_ = 0;
  planned_expected_ = 0;
  folded_ = unclipped_ = 0;
  round_open_ = true;
  return Status::Ok();
}

Status DpFedAvg::Accumulate(std::span<const float> x, std::string_view client) {
  if (!round_open_) return FailedPrecondition("dp: Fold outside a round (call Begin)");
  if (x.size() != sum_.size()) {
    return InvalidArgument("dp: round {}: update from {} has {} values, expected {}", round_, client, x.size(),
                           sum_.size());
  }
  if (folded_ == sampled_) {
    return FailedPrecondition("dp: round {}: update from {} is beyond the {} sites sampled", round_, client, sampled_);
  }
  double squares = 0;
  for (float v : x) squares += double(v) * double(v);
  const double norm = std::sqrt(squares);
  if (!std::isfinite(norm)) return InvalidArgument("dp: round {}: update from {} is not finite", round_, client);
  const double scale = norm > clip_ ? clip_ / norm : 1.0;
  for (size_t i = 0; i < x.size(); ++i) sum_[i] += scale * double(x[i]);
  if (norm <= clip_) ++unclipped_;
  ++folded_;
  return Status::Ok();
}

Status DpFedAvg::Fold(std::span<const float> delta, double weight) {
  if (reference_) return InvalidArgument("dp: a LoRA federation's updates fold with their layout (FoldUpdate)");
  return Accumulate(delta, "a site");
}

Status DpFedAvg::FoldUpdate(std::string_view client, const Manifest& layout, std::span<const float> values,
                            double weight) {
  if (!reference_) return Accumulate(values, client);
  if (!(layout == reference_->upload)) {
    return InvalidArgument("dp: round {}: upload from {} is not in the federation's adapter layout", round_, client);
  }
  if (values.size() != reference_values_.size()) {
    return InvalidArgument("dp: round {}: upload from {} has {} values, expected {}", round_, client, values.size(),
                           reference_values_.size());
  }
  std::vector<float> moved(values.size());
  for (size_t i = 0; i < values.size(); ++i) moved[i] = values[i] - reference_values_[i];
  return Accumulate(moved, client);
}

Status DpFedAvg::Finish(std::span<float> global) {
  if (!round_open_) return FailedPrecondition("dp: Finish outside a round (call Begin)");
  if (folded_ == 0) return FailedPrecondition("dp: round {} has no folded update", round_);
  ESTUARY_ASSIGN_OR_RETURN(const double z_sum, SumNoiseMultiplier(options_, sampled_));
  DpRound facts{.clip = clip_,
                .noise_stddev = z_sum * clip_,
                .sampled = sampled_,
                .denominator = denominator_,
                .clipped = folded_ - unclipped_};
  noise_->AddNoise(sum_, facts.noise_stddev);
  std::vector<float> mean(sum_.size());
  for (size_t i = 0; i < sum_.size(); ++i) {
    mean[i] = float(sum_[i] / denominator_ + (reference_ ? double(reference_values_[i]) : 0.0));
  }
  if (reference_) {
    ESTUARY_RETURN_IF_ERROR(inner_->FoldUpdate("the noised mean", reference_->upload, mean, 1.0));
  } else {
    ESTUARY_RETURN_IF_ERROR(inner_->Fold(mean, 1.0));
  }
  ESTUARY_RETURN_IF_ERROR(inner_->Finish(global));
  if (options_.adaptive) {
    const double count_stddev =
        options_.clipped_count_stddev > 0 ? options_.clipped_count_stddev : 0.05 * double(sampled_);
    const double centred = double(unclipped_) - 0.5 * double(folded_) + count_stddev * noise_->NextNormal();
    facts.unclipped_estimate = std::clamp(centred / denominator_ + 0.5, 0.0, 1.0);
    clip_ = float(clip_ * std::exp(-options_.clip_lr * (facts.unclipped_estimate - options_.target_quantile)));
  }
  last_ = facts;
  round_open_ = false;
  return Status::Ok();
}

std::map<std::string, std::vector<float>> DpFedAvg::SaveState() const {
  auto state = inner_->SaveState();
  if (options_.adaptive) state[kClipKey] = {float(clip_)};
  return state;
}

Status DpFedAvg::LoadState(const std::map<std::string, std::vector<float>>& state) {
  std::map<std::string, std::vector<float>> inner;
  clip_ = StartingClip(options_);
  for (const auto& [name, values] : state) {
    if (name != kClipKey) {
      inner[name] = values;
      continue;
    }
    if (values.size() != 1 || !std::isfinite(values[0]) || !(values[0] > 0)) {
      return InvalidArgument("dp: saved state '{}' is not one positive finite clip norm", kClipKey);
    }
    if (options_.adaptive) clip_ = values[0];
  }
  return inner_->LoadState(inner);
}

}  // namespace estuary::aggregation
