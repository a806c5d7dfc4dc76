#include "secagg/quantize.h"

#include <cmath>

#include "secagg/prg.h"

namespace estuary::secagg {
namespace {

// 2^(b−1) − 1: the largest magnitude a b-bit two's-complement sum may reach
// (the symmetric range; −2^(b−1) is left unused).
double SignedLimit(int bits) { return std::ldexp(1.0, bits - 1) - 1; }

double MaxAbsQuantized(double weight, const QuantizationConfig& config) {
  return weight * config.clip_norm * config.scale + 1;
}

}  // namespace

Status CheckQuantizationConfig(const QuantizationConfig& config) {
  ESTUARY_RETURN_IF_ERROR(CheckRingBits(config.bits));
  if (config.bits < 2) return InvalidArgument("secagg: quantisation bits = 1: a signed ring needs at least 2");
  if (!(std::isfinite(config.clip_norm) && config.clip_norm > 0)) {
    return InvalidArgument("secagg: quantisation clip_norm = {}: must be finite and > 0", config.clip_norm);
  }
  if (!(std::isfinite(config.scale) && config.scale > 0)) {
    return InvalidArgument("secagg: quantisation scale = {}: must be finite and > 0", config.scale);
  }
  return Status::Ok();
}

Result<double> ClipFactor(std::span<const float> update, double clip_norm) {
  double squares = 0;
  for (size_t i = 0; i < update.size(); ++i) {
    if (!std::isfinite(update[i])) return InvalidArgument("secagg: update[{}] = {}: not finite", i, update[i]);
    squares += double(update[i]) * double(update[i]);
  }
  const double norm = std::sqrt(squares);
  return norm > clip_norm ? clip_norm / norm : 1.0;
}

Result<std::vector<double>> ClipToNorm(std::span<const float> update, double clip_norm) {
  ESTUARY_ASSIGN_OR_RETURN(const double factor, ClipFactor(update, clip_norm));
  std::vector<double> clipped(update.size());
  for (size_t i = 0; i < update.size(); ++i) clipped[i] = double(update[i]) * factor;
  return clipped;
}

namespace {

Status CheckWeight(double weight, const QuantizationConfig& config) {
  if (!(std::isfinite(weight) && weight >= 0)) {
    return InvalidArgument("secagg: quantisation weight = {}: must be finite and >= 0", weight);
  }
  if (MaxAbsQuantized(weight, config) > SignedLimit(config.bits)) {
    return InvalidArgument("secagg: weight {} · clip {} · scale {} overflows a {}-bit ring on its own", weight,
                           config.clip_norm, config.scale, config.bits);
  }
  return Status::Ok();
}

}  // namespace

Status QuantizeChunk(std::span<const float> chunk, uint64_t offset, double weight, double clip_factor,
                     const QuantizationConfig& config, const Key32& rounding_seed, std::span<uint32_t> out) {
  ESTUARY_RETURN_IF_ERROR(CheckQuantizationConfig(config));
  ESTUARY_RETURN_IF_ERROR(CheckWeight(weight, config));
  if (!(std::isfinite(clip_factor) && clip_factor > 0 && clip_factor <= 1)) {
    return InvalidArgument("secagg: clip factor {}: must be in (0, 1]", clip_factor);
  }
  if (out.size() != chunk.size()) {
    return InvalidArgument("secagg: quantising {} elements into {}", chunk.size(), out.size());
  }
  // The rounding uniforms land in `out` first, then each is replaced by its element.
  ESTUARY_RETURN_IF_ERROR(ExpandMask(rounding_seed, offset, 32, out));
  const uint32_t mask = RingMask(config.bits);
  const double factor = weight * config.scale;
  for (size_t i = 0; i < chunk.size(); ++i) {
    if (!std::isfinite(chunk[i])) {
      return InvalidArgument("secagg: update[{}] = {}: not finite", offset + i, chunk[i]);
    }
    const double y = double(chunk[i]) * clip_factor * factor;
    const double below = std::floor(y);
    // Uniform on [0, 1), 2^-32 grid; scaling by a power of two is exact, as
    // std::ldexp would be, without its call per element.
    const double u = double(out[i]) * 0x1p-32;
    const int64_t q = static_cast<int64_t>(below) + (u < y - below ? 1 : 0);
    // Two's complement: a negative q wraps to 2^b + q.
    out[i] = static_cast<uint32_t>(static_cast<uint64_t>(q)) & mask;
  }
  return Status::Ok();
}

Result<std::vector<uint32_t>> Quantize(std::span<const float> update, double weight, const QuantizationConfig& config,
                                       const Key32& rounding_seed) {
  ESTUARY_RETURN_IF_ERROR(CheckQuantizationConfig(config));
  ESTUARY_RETURN_IF_ERROR(CheckWeight(weight, config));
  ESTUARY_ASSIGN_OR_RETURN(const double clip_factor, ClipFactor(update, config.clip_norm));
  std::vector<uint32_t> quantized(update.size());
  ESTUARY_RETURN_IF_ERROR(QuantizeChunk(update, 0, weight, clip_factor, config, rounding_seed, quantized));
  return quantized;
}

Status CheckNoOverflow(std::span<const double> weights, const QuantizationConfig& config) {
  ESTUARY_RETURN_IF_ERROR(CheckQuantizationConfig(config));
  double total = 0;
  for (double weight : weights) {
    if (!(std::isfinite(weight) && weight >= 0)) {
      return InvalidArgument("secagg: quantisation weight = {}: must be finite and >= 0", weight);
    }
    total += MaxAbsQuantized(weight, config);
  }
  if (total > SignedLimit(config.bits)) {
    return InvalidArgument("secagg: {} sites can reach |sum| = {} > 2^{} - 1: the {}-bit ring would wrap; lower the "
                           "scale or widen the ring",
                           weights.size(), total, config.bits - 1, config.bits);
  }
  return Status::Ok();
}

Result<std::vector<double>> Dequantize(std::span<const uint32_t> sum, double total_weight,
                                       const QuantizationConfig& config) {
  ESTUARY_RETURN_IF_ERROR(CheckQuantizationConfig(config));
  if (!(std::isfinite(total_weight) && total_weight > 0)) {
    return InvalidArgument("secagg: total weight = {}: must be finite and > 0", total_weight);
  }
  const uint32_t mask = RingMask(config.bits);
  const int64_t modulus = int64_t{1} << config.bits;
  const int64_t half = modulus / 2;
  const double divisor = config.scale * total_weight;
  std::vector<double> out(sum.size());
  for (size_t i = 0; i < sum.size(); ++i) {
    const int64_t value = sum[i] & mask;
    out[i] = double(value >= half ? value - modulus : value) / divisor;
  }
  return out;
}

double DequantizationErrorBound(int sites, double total_weight, const QuantizationConfig& config) {
  return double(sites) / (config.scale * total_weight);
}

}  // namespace estuary::secagg
