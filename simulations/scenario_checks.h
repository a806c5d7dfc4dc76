// What a scenario may not ask for, each refused in one line naming the flags:
// combinations that cannot work together (secure aggregation with whatever
// needs one site's update, distributed DP without secure aggregation, …) and
// values out of range. RunInproc and RunLoopback check before anything runs.
#pragma once

#include "base/status.h"
#include "simulations/runner.h"

namespace estuary::simulations {

Status CheckScenario(const Scenario& scenario);

}  // namespace estuary::simulations
