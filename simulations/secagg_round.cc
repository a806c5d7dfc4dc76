#include "simulations/secagg_round.h"

#include <chrono>
#include <cmath>
#include <map>
#include <random>

#include "aggregation/dp_fedavg.h"
#include "base/seed.h"
#include "privacy/distributed_dp.h"
#include "secagg/client.h"
#include "secagg/discrete_gaussian.h"
#include "secagg/neighbours.h"
#include "secagg/quantize.h"
#include "secagg/server.h"
#include "simulations/dropout_draw.h"

namespace estuary::simulations {
namespace {

using namespace estuary::secagg;

using Drop = SecAggDropStage;

// A key derived from the federation's seed: the graph's, a site's rounding.
Key32 DerivedKey(uint64_t seed) {
  Key32 key;
  for (size_t i = 0; i < key.size(); i += 8) {
    seed = SplitMix64(seed);
    for (size_t b = 0; b < 8; ++b) key[i + b] = uint8_t(seed >> (8 * b));
  }
  return key;
}

// The protocol's parameters for `sites` sites: the options' k and t, or the
// defaults for n.
Result<ProtocolConfig> ConfigFor(const SecAggOptions& options, uint32_t sites, uint64_t dimension, uint64_t seed,
                                 uint64_t round) {
  ProtocolConfig config =
      DefaultProtocolConfig(sites, dimension, round, DerivedKey(MixSeed(MixSeed(seed, round), "secagg graph")));
  if (options.neighbours > 0) config.degree = options.neighbours;
  config.threshold = options.threshold > 0 ? options.threshold : DefaultThreshold(config.degree);
  config.bits = options.bits;
  if (Status ok = CheckProtocolConfig(config); !ok.ok()) {
    return InvalidArgument("sim: --secagg with {} sites a round: {}", sites, ok.message());
  }
  return config;
}

}  // namespace

Key32 SiteRoundingKey(uint64_t seed, uint64_t round, uint32_t site) {
  return DerivedKey(MixSeed(MixSeed(seed, round), MixSeed(site, "secagg rounding")));
}

Key32 SiteNoiseKey(uint64_t seed, uint64_t round, uint32_t site) {
  return DerivedKey(MixSeed(MixSeed(seed, round), MixSeed(site, "secagg discrete gaussian")));
}

static_assert(privacy::kMaxShareVariance == kMaxDiscreteGaussianVariance);

Result<DistributedDpPlan> PlanDistributedDp(const DistributedDpOptions& dp, int bits, uint32_t sites,
                                            uint64_t dimension) {
  auto plan = privacy::PlanDistributedDpShares(dp, bits, sites, dimension);
  if (!plan.ok()) {
    return Status(plan.status().code(), fmt::format("sim: --dp distributed: {}", plan.status().message()));
  }
  return plan;
}

Result<privacy::Epsilon> DistributedDpPreview(const privacy::Accountant& accountant, const SecAggOptions& options,
                                              double q, uint32_t sites, uint64_t dimension) {
  ESTUARY_ASSIGN_OR_RETURN(const DistributedDpPlan plan, PlanDistributedDp(options.dp, options.bits, sites, dimension));
  ESTUARY_ASSIGN_OR_RETURN(const auto rdp, DistributedDpRoundRdp(plan, plan.min_included, q, accountant.orders()));
  return accountant.EpsilonAfterRdp(rdp);
}

Result<SecAggLoraReference> LoraReferenceOf(const aggregation::LoraStrategyOptions& lora,
                                            std::span<const float> global) {
  ESTUARY_ASSIGN_OR_RETURN(const aggregation::DpUploadReference reference, aggregation::LoraUploadReference(lora));
  SecAggLoraReference out;
  for (const auto& [offset, count] : reference.slices) {
    if (offset + count > global.size()) {
      return Internal("sim: --secagg: adapter tensor at {} + {} beyond the global model's {}", offset, count,
                      global.size());
    }
    out.values.insert(out.values.end(), global.begin() + offset, global.begin() + offset + count);
  }
  return out;
}

std::vector<SecAggDropStage> DrawSecAggDropouts(double dropout, uint32_t sites, uint64_t seed, uint64_t round) {
  std::vector<SecAggDropStage> drop;
  drop.reserve(sites);
  for (int stage : DrawDropStages(dropout, sites, kSecAggDropStages, seed, round, "secagg dropout", false)) {
    drop.push_back(SecAggDropStage(stage));
  }
  return drop;
}

Status CheckSecAggOptions(const SecAggOptions& o, uint32_t sites) {
  if (o.neighbours < 0) return InvalidArgument("sim: --secagg-neighbours {}: must be >= 0 (0: the default)", o.neighbours);
  if (o.threshold < 0) return InvalidArgument("sim: --secagg-threshold {}: must be >= 0 (0: the default)", o.threshold);
  if (o.bits < 2 || o.bits > 32) return InvalidArgument("sim: --secagg-bits {}: must be in [2, 32]", o.bits);
  if (!(std::isfinite(o.clip) && o.clip > 0)) return InvalidArgument("sim: --secagg-clip {}: must be finite and > 0", o.clip);
  if (!(o.dropout >= 0 && o.dropout < 1)) return InvalidArgument("sim: --dropout {}: must be in [0, 1)", o.dropout);
  if (o.dp.noise_multiplier > 0) {
    if (!(o.dp.survivors > 0 && o.dp.survivors <= 1)) {
      return InvalidArgument("sim: --dp-survivors {}: must be in (0, 1]", o.dp.survivors);
    }
    if (!(std::isfinite(o.dp.clip) && o.dp.clip > 0)) {
      return InvalidArgument("sim: --dp distributed: --dp-clip {}: must be finite and > 0", o.dp.clip);
    }
  }
  return ConfigFor(o, sites, 1, 0, 0).status();
}

Result<SecAggRoundResult> RunSecAggRound(const SecAggOptions& options, std::span<const SecAggSiteInput> inputs,
                                         uint64_t seed, uint64_t round) {
  const auto start = std::chrono::steady_clock::now();
  const uint32_t n = uint32_t(inputs.size());
  if (n < 2) return InvalidArgument("sim: --secagg: round {} samples {} site: secure aggregation needs 2", round, n);
  if (options.dp.noise_multiplier > 0 && !(options.dp.denominator > 0)) {
    return InvalidArgument("sim: --dp distributed: the mean's denominator {}: must be > 0", options.dp.denominator);
  }
  if (options.dp.noise_multiplier > 0 && options.dp.max_sites > 0 && n > options.dp.max_sites) {
    return FailedPrecondition("sim: round {}: Poisson sampling drew {} sites, more than the {} the ring was planned "
                              "for: refusing the round",
                              round, n, options.dp.max_sites);
  }
  ESTUARY_ASSIGN_OR_RETURN(const ProtocolConfig config, ConfigFor(options, n, inputs[0].update.size(), seed, round));

  // The scale: as fine as the ring allows for these weights.
  double total_weight = 0;
  for (const SecAggSiteInput& input : inputs) {
    if (input.update.size() != config.dimension) {
      return InvalidArgument("sim: --secagg: updates of {} and {} elements", input.update.size(), config.dimension);
    }
    total_weight += input.examples;
  }
  // Under distributed DP every site weighs 1 and the plan sets the scale.
  const bool dp = options.dp.noise_multiplier > 0;
  const double clip = dp ? options.dp.clip : options.clip;
  SecAggRoundResult result{.neighbours = config.degree, .threshold = config.threshold};
  double scale = std::floor((std::ldexp(1.0, options.bits - 1) - 1 - n) / (options.clip * total_weight));
  if (dp) {
    ESTUARY_ASSIGN_OR_RETURN(result.dp, PlanDistributedDp(options.dp, options.bits, n, config.dimension));
    scale = result.dp.scale;
  }
  if (!(scale >= 1)) {
    return InvalidArgument("sim: --secagg-bits {}: too narrow for {} sites of {} examples at clip {} (scale {} < 1)",
                           options.bits, n, total_weight, options.clip, scale);
  }
  const QuantizationConfig quantization{.bits = options.bits, .clip_norm = clip, .scale = scale};

  // Who stops where.
  const std::vector<Drop> drop = DrawSecAggDropouts(options.dropout, n, seed, round);
  for (Drop d : drop) {
    if (d == Drop::kNone) continue;
    ++result.dropouts;
    ++result.dropouts_by_stage[int(d) - 1];
  }

  ESTUARY_ASSIGN_OR_RETURN(SecAggServer server, SecAggServer::Create(config));
  std::vector<SecAggClient> clients;
  std::vector<uint64_t> bytes(n, 0);
  for (uint32_t u = 0; u < n; ++u) {
    ESTUARY_ASSIGN_OR_RETURN(SecAggClient client, SecAggClient::Create(config, u));
    clients.push_back(std::move(client));
  }
  for (uint32_t u = 0; u < n; ++u) {
    if (drop[u] == Drop::kBeforeAdvertise) continue;
    ESTUARY_ASSIGN_OR_RETURN(AdvertiseKeys keys, clients[u].Advertise());
    bytes[u] += WireBytes(keys);
    ESTUARY_RETURN_IF_ERROR(server.Receive(keys));
  }
  ESTUARY_ASSIGN_OR_RETURN(auto broadcasts, server.CloseAdvertise());
  for (auto& [u, broadcast] : broadcasts) {
    bytes[u] += WireBytes(broadcast);
    if (drop[u] == Drop::kAfterAdvertise) continue;
    ESTUARY_ASSIGN_OR_RETURN(ShareKeys shares, clients[u].Share(broadcast));
    bytes[u] += WireBytes(shares);
    ESTUARY_RETURN_IF_ERROR(server.Receive(shares));
  }
  ESTUARY_ASSIGN_OR_RETURN(auto inboxes, server.CloseShareKeys());
  for (auto& [u, inbox] : inboxes) {
    bytes[u] += WireBytes(inbox);
    if (drop[u] == Drop::kAfterShare) continue;
    const SecAggSiteInput& input = inputs[u];
    double squares = 0;
    for (float x : input.update) squares += double(x) * double(x);
    result.clipped += std::sqrt(squares) > clip;
    ESTUARY_ASSIGN_OR_RETURN(std::vector<uint32_t> quantized, Quantize(input.update, dp ? 1.0 : input.examples,
                                                                       quantization, SiteRoundingKey(seed, round, u)));
    // The site's share of the noise goes in before its masks.
    if (dp) {
      ESTUARY_RETURN_IF_ERROR(
          AddDiscreteGaussian(quantized, result.dp.site_variance, options.bits, SiteNoiseKey(seed, round, u)));
    }
    ESTUARY_ASSIGN_OR_RETURN(MaskedInput masked, clients[u].MaskInput(inbox, quantized));
    bytes[u] += WireBytes(masked);
    ESTUARY_RETURN_IF_ERROR(server.Receive(masked));
  }
  ESTUARY_ASSIGN_OR_RETURN(SurvivorSet survivors, server.CloseMaskedInput());
  if (dp && survivors.survived.size() < result.dp.min_included) {
    return FailedPrecondition("secagg round {}: distributed DP: {} of {} inputs arrived, fewer than the {} the noise is "
                              "calibrated for (--dp-survivors {}): refusing to unmask",
                              round, survivors.survived.size(), n, result.dp.min_included, options.dp.survivors);
  }
  // The consistency check, in one process: unsigned (secagg/client.h).
  for (uint32_t u : survivors.survived) {
    bytes[u] += WireBytes(survivors, n);
    if (drop[u] == Drop::kAfterMaskedInput) continue;
    ESTUARY_ASSIGN_OR_RETURN(std::string confirmed, clients[u].ConfirmSurvivors(survivors));
    const SurvivorsSigned signed_survivors{.site = u, .signature = UnauthenticatedSignature(confirmed)};
    bytes[u] += WireBytes(signed_survivors);
    ESTUARY_RETURN_IF_ERROR(server.Receive(signed_survivors));
  }
  ESTUARY_ASSIGN_OR_RETURN(auto requests, server.CloseConsistency());
  for (const auto& [u, request] : requests) {
    bytes[u] += WireBytes(request);
    ESTUARY_ASSIGN_OR_RETURN(UnmaskResponse response, clients[u].Unmask(request, UnauthenticatedSurvivorsCheck));
    bytes[u] += WireBytes(response);
    ESTUARY_RETURN_IF_ERROR(server.Receive(response));
  }
  ESTUARY_ASSIGN_OR_RETURN(AggregateOutput output, server.Finish());

  for (uint32_t u : output.included) {
    result.included.push_back(u);
    result.included_weight += inputs[u].examples;
  }
  // DP: the fixed denominator; the error bound is the rounding's alone (the noise is meant).
  const double denominator = dp ? options.dp.denominator : result.included_weight;
  ESTUARY_ASSIGN_OR_RETURN(std::vector<double> mean, Dequantize(output.sum, denominator, quantization));
  result.mean.assign(mean.begin(), mean.end());
  result.error_bound = DequantizationErrorBound(int(output.included.size()), denominator, quantization);
  result.sum = std::move(output.sum);
  uint64_t total_bytes = 0;
  for (uint64_t b : bytes) total_bytes += b;
  result.bytes_per_site = total_bytes / n;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace estuary::simulations
