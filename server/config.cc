#include "server/config.h"

#include <cmath>

#include "aggregation/fedbuff.h"
#include "aggregation/robust_strategy.h"

namespace estuary::server {

Status ServerConfig::Finalize() {
  std::string host;
  uint16_t port;
  ESTUARY_RETURN_IF_ERROR(ParseHostPort(listen, &host, &port));
  if (checkpoint_dir.empty()) checkpoint_dir = db.string() + ".checkpoints";
  if (spill_dir.empty()) spill_dir = checkpoint_dir;
  if (mode != "sync" && mode != "async") return InvalidArgument("config: mode = '{}': expected sync or async", mode);
  if (rounds == 0) return InvalidArgument("config: rounds = 0: must be >= 1");
  if (!(clients_per_round > 0)) return InvalidArgument("config: clients_per_round = {}: must be > 0", clients_per_round);
  if (!(evaluate_clients >= 0) || !std::isfinite(evaluate_clients)) {
    return InvalidArgument("config: evaluate_clients = {}: must be >= 0 (0: every site that evaluates)",
                           evaluate_clients);
  }
  if (min_clients == 0) return InvalidArgument("config: min_clients = 0: must be >= 1");
  if (min_updates == 0) return InvalidArgument("config: min_updates = 0: must be >= 1");
  if (!(round_deadline_s > 0)) return InvalidArgument("config: round_deadline = {}: must be > 0", round_deadline_s);
  if (max_frame_bytes < 4096) return InvalidArgument("config: max_frame = {}: must be >= 4096", max_frame_bytes);
  if (chunk_bytes < 4 || chunk_bytes % 4 != 0 || chunk_bytes + 1024 > max_frame_bytes) {
    return InvalidArgument("config: chunk_bytes = {}: must be a multiple of 4 and fit in a frame of {}", chunk_bytes,
                           max_frame_bytes);
  }
  if (staging_slots == 0) return InvalidArgument("config: staging_slots = 0: must be >= 1");
  for (const auto& [key, seconds] : {std::pair{"handshake_timeout", handshake_timeout_s},
                                     {"idle_timeout", idle_timeout_s},
                                     {"write_timeout", write_timeout_s},
                                     {"download_slot_timeout", download_slot_timeout_s},
                                     {"event_interval", event_interval_s}}) {
    if (!(seconds > 0)) return InvalidArgument("config: {} = {}: must be > 0", key, seconds);
  }
  if (max_handshakes == 0) return InvalidArgument("config: max_handshakes = 0: must be >= 1");
  if (max_handshakes_per_address == 0) return InvalidArgument("config: max_handshakes_per_address = 0: must be >= 1");
  if (io_threads == 0) return InvalidArgument("config: io_threads = 0: must be >= 1");
  if (frame_memory_bytes < max_frame_bytes) {
    return InvalidArgument("config: frame_memory = {}: must hold one frame of max_frame = {}", frame_memory_bytes,
                           max_frame_bytes);
  }
  if (federation.strategy().name() == "scaffold" && federation.task().update_kind() == v1::UPDATE_LORA) {
    return InvalidArgument("config: strategy = scaffold with update kind lora: SCAFFOLD's control variates are over "
                           "the whole model's parameters, a lora site trains and uploads adapters");
  }
  ESTUARY_RETURN_IF_ERROR(aggregation::CheckFederation(federation));
  ESTUARY_RETURN_IF_ERROR(CheckAsync());
  ESTUARY_RETURN_IF_ERROR(CheckDp());
  return CheckSecAgg();
}

Status ServerConfig::CheckDp() const {
  const v1::DpConfig& dp = federation.dp();
  if (dp_mode != "central" && dp_mode != "distributed") {
    return InvalidArgument("config: dp = '{}': expected central or distributed", dp_mode);
  }
  if (!(dp_survivors > 0 && dp_survivors <= 1)) {
    return InvalidArgument("config: dp_survivors = {}: must be in (0, 1]", dp_survivors);
  }
  if (dp_survivors != 1 && !distributed_dp()) {
    return InvalidArgument("config: dp_survivors = {} without dp = distributed: only the sites' noise shares are "
                           "calibrated for survivors",
                           dp_survivors);
  }
  if (distributed_dp()) {
    if (!secagg.on) {
      return InvalidArgument("config: dp = distributed without secagg: the sites' noise shares add up to the full "
                             "noise only in secure aggregation's sum; alone, each update would reach the server with "
                             "its small share");
    }
    if (!(dp.noise_multiplier() > 0)) {
      return InvalidArgument("config: dp = distributed without dp_noise_multiplier: there is no noise to share");
    }
    if (dp.adaptive_clip()) {
      return InvalidArgument("config: dp = distributed with dp_adaptive_clip: the clip's quantile needs a noised count "
                             "of unclipped sites, which secure aggregation does not compute yet");
    }
  }
  const uint32_t total_sites = federation.strategy().total_sites();
  // Central or distributed: either way the mean divides by q · total_sites.
  const bool poisson_dp = sample_rate > 0 && dp.noise_multiplier() > 0;
  if (total_sites > 0 && federation.strategy().name() != "scaffold" && !poisson_dp) {
    return InvalidArgument("config: total_sites = {} with strategy {}: it is for scaffold, or for sample_rate with "
                           "dp_noise_multiplier (the mean divides by q · total_sites)",
                           total_sites, federation.strategy().name());
  }
  if (!(sample_rate >= 0 && sample_rate <= 1)) {
    return InvalidArgument("config: sample_rate = {}: must be in [0, 1] (0: clients_per_round)", sample_rate);
  }
  if (sample_seed != 0 && sample_rate == 0) return InvalidArgument("config: sample_seed without sample_rate");
  if (sample_rate > 0) {
    if (mode == "async") {
      return InvalidArgument("config: sample_rate with mode = async: asynchronous sites are not drawn by rounds");
    }
    if (dp.noise_multiplier() > 0 && federation.strategy().total_sites() == 0) {
      return InvalidArgument("config: sample_rate with dp_noise_multiplier needs total_sites: the mean divides by the "
                             "expected q · total_sites, a constant the operator declares, not by who is connected{}",
                             distributed_dp() ? ", and the sites' noise shares are planned for it" : "");
    }
  }
  return Status::Ok();
}

Status ServerConfig::CheckAsync() const {
  if (mode != "async") return Status::Ok();
  if (async.buffer == 0) return InvalidArgument("config: buffer = 0: must be >= 1 updates a version");
  auto weight = aggregation::ParseStalenessWeight(async.staleness_weight);
  if (!weight.ok()) return InvalidArgument("config: staleness_weight: {}", weight.status().message());
  if (async.max_staleness < -1) {
    return InvalidArgument("config: max_staleness = {}: must be >= 0 versions (-1: none refused)", async.max_staleness);
  }
  if (secagg.on) {
    return InvalidArgument("config: mode = async with secagg: secure aggregation masks one round's sum over the sites "
                           "sampled together, and asynchronous updates arrive one at a time from different versions");
  }
  if (evaluate_every > 0) {
    return InvalidArgument("config: mode = async with evaluate_every: an evaluation round asks the sites between two "
                           "rounds, and asynchronous sites never stop training (the server's --eval-data scores every "
                           "version)");
  }
  // The robust rules, SCAFFOLD, FedNova, the server optimizers, lora and DP-FedAvg, each with its reason.
  if (Status s = aggregation::CheckFedBuffFederation(federation); !s.ok()) {
    return InvalidArgument("config: mode = async: {}", s.message());
  }
  return Status::Ok();
}

// What secure aggregation cannot be combined with: whatever needs one site's update.
Status ServerConfig::CheckSecAgg() const {
  const SecAgg& s = secagg;
  if (!s.on) {
    if (s.neighbours || s.threshold) return InvalidArgument("config: secagg_neighbours and secagg_threshold need secagg");
    return Status::Ok();
  }
  if (s.neighbours < 0) return InvalidArgument("config: secagg_neighbours = {}: must be >= 0 (0: the default)", s.neighbours);
  if (s.threshold < 0) return InvalidArgument("config: secagg_threshold = {}: must be >= 0 (0: the default)", s.threshold);
  if (s.bits < 2 || s.bits > 32) return InvalidArgument("config: secagg_bits = {}: must be in [2, 32]", s.bits);
  if (!(std::isfinite(s.clip) && s.clip > 0)) return InvalidArgument("config: secagg_clip = {}: must be finite and > 0", s.clip);
  if (clients_per_round >= 1 && clients_per_round < 2) {
    return InvalidArgument("config: secagg with clients_per_round = {}: secure aggregation needs 2 sites a round",
                           clients_per_round);
  }
  const std::string& strategy = federation.strategy().name();
  if (aggregation::IsRobustStrategy(strategy)) {
    return InvalidArgument("config: secagg with strategy {}: a robust rule needs the individual updates, which secure "
                           "aggregation hides (fedavg, fedavgm and the fedopt family take the sum)",
                           strategy);
  }
  if (strategy == "scaffold") {
    return InvalidArgument("config: secagg with strategy scaffold: the server folds each site's control delta Δc_i "
                           "into c, and secure aggregation would have to hide it (it masks the delta only)");
  }
  if (strategy == "fednova") {
    return InvalidArgument("config: secagg with strategy fednova: FedNova divides each site's update by its own "
                           "local work, which a masked sum cannot");
  }
  if (federation.task().update_kind() == v1::UPDATE_LORA && federation.task().lora().merge() == "exact") {
    return InvalidArgument("config: secagg with update kind lora and lora_merge = exact: the exact merge needs each "
                           "site's A and B apart to multiply them (B_i A_i) before summing, which a masked sum of the "
                           "factors cannot give; naive and frozen-a need only sums");
  }
  if (federation.dp().noise_multiplier() > 0 && !distributed_dp()) {
    return InvalidArgument("config: secagg with dp_noise_multiplier: DP-FedAvg clips and counts individual updates on "
                           "the server, which secure aggregation hides (dp = distributed noises on the sites instead)");
  }
  if (federation.limits().max_norm() > 0 || federation.limits().max_norm_over_median() > 0) {
    return InvalidArgument("config: secagg with max_update_norm or max_norm_over_median: the server never sees an "
                           "update's norm; secagg_clip bounds it on the site");
  }
  return Status::Ok();
}

}  // namespace estuary::server
