// Attacks for the simulator: a seeded fraction of the sites is malicious and
// replaces the delta it uploads (full updates, inproc mode), so that a run
// shows what a strategy does under Byzantine sites.
//
//   sign-flip[:L]  -L·Δ (L = 1 by default): the update pulls the model back
//   scale:L        L·Δ
//   gaussian:S     a vector of N(0, S²) noise in place of Δ
//   nan            every value NaN: the federation must refuse the update
//                  (UpdateBound: "update is not finite") and the round go on
//   label-flip     the site trains on labels l -> C - 1 - l (C classes) and
//                  uploads what it trained (image models; Tolpegin et al. 2020)
//
// Which sites attack is drawn once from the task's seed; gaussian's noise
// from the seed, the round and the site, so a run reproduces.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace estuary::simulations {

struct Attack {
  enum class Kind { kNone, kSignFlip, kScale, kGaussian, kNan, kLabelFlip };
  Kind kind = Kind::kNone;
  double parameter = 1;  // sign-flip and scale: L; gaussian: S
};

// "" is no attack; anything unknown or a parameter that is not a finite
// number (> 0 for gaussian) is InvalidArgument naming it.
Result<Attack> ParseAttack(std::string_view text);

// llround(fraction · clients) of `clients` sites, drawn from `seed` mixed
// with `purpose` (each purpose its own draw). fraction must be in [0, 1].
std::vector<bool> ChooseSites(uint32_t clients, double fraction, uint64_t seed, std::string_view purpose);
// Which sites are malicious: ChooseSites(..., "attackers").
std::vector<bool> ChooseAttackers(uint32_t clients, double fraction, uint64_t seed);

// Replaces `delta` in place by what a malicious site uploads (label-flip:
// leaves it, the site having trained on flipped labels).
void ApplyAttack(const Attack& attack, std::span<float> delta, uint64_t seed, uint64_t round, uint32_t site);

}  // namespace estuary::simulations
