#include "simulations/attack.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

#include "base/seed.h"

namespace estuary::simulations {

Result<Attack> ParseAttack(std::string_view text) {
  Attack attack;
  if (text.empty()) return attack;
  const size_t colon = text.find(':');
  const std::string_view kind = text.substr(0, colon);
  const bool has_parameter = colon != std::string_view::npos;
  if (has_parameter) {
    const std::string number(text.substr(colon + 1));
    char* end = nullptr;
    attack.parameter = std::strtod(number.c_str(), &end);
    if (number.empty() || *end != '\0' || !std::isfinite(attack.parameter)) {
      return InvalidArgument("sim: --attack {}: '{}' is not a finite number", text, number);
    }
  }
  if (kind == "sign-flip") {
    attack.kind = Attack::Kind::kSignFlip;
  } else if (kind == "scale" && has_parameter) {
    attack.kind = Attack::Kind::kScale;
  } else if (kind == "gaussian" && has_parameter) {
    if (!(attack.parameter > 0)) return InvalidArgument("sim: --attack {}: the stddev S must be > 0", text);
    attack.kind = Attack::Kind::kGaussian;
  } else if (kind == "nan" && !has_parameter) {
    attack.kind = Attack::Kind::kNan;
  } else if (kind == "label-flip" && !has_parameter) {
    attack.kind = Attack::Kind::kLabelFlip;
  } else {
    return InvalidArgument("sim: --attack '{}': expected sign-flip[:L], scale:L, gaussian:S, nan or label-flip", text);
  }
  return attack;
}

std::vector<bool> ChooseAttackers(uint32_t clients, double fraction, uint64_t seed) {
  return ChooseSites(clients, fraction, seed, "attackers");
}

std::vector<bool> ChooseSites(uint32_t clients, double fraction, uint64_t seed, std::string_view purpose) {
  std::vector<uint32_t> order(clients);
  std::iota(order.begin(), order.end(), 0u);
  std::mt19937_64 rng(MixSeed(seed, purpose));
  // Fisher-Yates with the seed's own draws, so every standard library picks the same sites.
  for (uint32_t i = clients; i > 1; --i) std::swap(order[i - 1], order[UniformBelow(rng, i)]);
  const auto count = size_t(std::llround(std::clamp(fraction, 0.0, 1.0) * double(clients)));
  std::vector<bool> malicious(clients, false);
  for (size_t i = 0; i < count; ++i) malicious[order[i]] = true;
  return malicious;
}

void ApplyAttack(const Attack& attack, std::span<float> delta, uint64_t seed, uint64_t round, uint32_t site) {
  switch (attack.kind) {
    case Attack::Kind::kNone:
    case Attack::Kind::kLabelFlip:
      return;
    case Attack::Kind::kSignFlip:
      for (float& v : delta) v = float(-attack.parameter * v);
      return;
    case Attack::Kind::kScale:
      for (float& v : delta) v = float(attack.parameter * v);
      return;
    case Attack::Kind::kGaussian: {
      std::mt19937_64 rng(MixSeed(MixSeed(MixSeed(seed, std::string_view("attack")), round), site));
      std::normal_distribution<double> noise(0, attack.parameter);
      for (float& v : delta) v = float(noise(rng));
      return;
    }
    case Attack::Kind::kNan:
      std::fill(delta.begin(), delta.end(), std::numeric_limits<float>::quiet_NaN());
      return;
  }
}

}  // namespace estuary::simulations
