// Stragglers: simulated sites that do less than the task's local work, as
// slower hardware or a time cap makes a real site do. A fixed share of the
// sites straggles (llround(fraction x clients), drawn once from the seed, as
// attackers are); in each round each straggler runs a fraction w of its full
// local steps, w uniform in [min_work, max_work] from (seed, round, site), at
// least one step. The partial work reaches the strategy as a real site's
// would, in either mode: FedAvg weighs it by the site's examples as if it
// were complete, FedNova by the steps it took.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "client/trainer.h"
#include "estuary.pb.h"

namespace estuary::simulations {

struct Stragglers {
  double fraction = 0;  // of the sites; 0: none
  double min_work = 0.1, max_work = 0.5;
};

// `work` is "MIN:MAX" with 0 < MIN <= MAX <= 1; fraction in [0, 1]. A bad
// value is one line naming the flag.
Result<Stragglers> ParseStragglers(double fraction, std::string_view work);

// A site's full local steps under `task`: epochs x ceil(examples / batch),
// at most task.max_local_steps when that is set.
uint64_t FullLocalSteps(const v1::TaskConfig& task, uint64_t examples);

// The share w of its full local steps straggler `site` runs in `round`,
// uniform in [min_work, max_work] from (seed, round, site).
double StragglerWork(const Stragglers& s, uint64_t seed, uint64_t round, uint32_t site);

// The simulated clock (RoundReport::sim_time): a full-speed site runs one
// local step per unit of time, a straggler w of one: in a synchronous round
// its w·full steps end when the others' full ones do (the deadline the
// partial work stands for); under --async, where it runs its full steps, it
// takes 1/w as long.
double SiteSpeed(const Stragglers& s, bool straggler, uint64_t seed, uint64_t round, uint32_t site);

// What straggler `site` runs in `round`: floor(w · full), between 1 and the full steps.
uint64_t StragglerSteps(const Stragglers& s, const v1::TaskConfig& task, uint64_t examples, uint64_t seed,
                        uint64_t round, uint32_t site);

// `honest` given the task with max_local_steps = StragglerSteps(...).
std::unique_ptr<client::Trainer> MakeStraggler(std::unique_ptr<client::Trainer> honest, const Stragglers& s,
                                               uint64_t seed, uint32_t site);

}  // namespace estuary::simulations
