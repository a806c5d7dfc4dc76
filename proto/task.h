// The checks every task must pass, whichever end holds it: the server before
// it runs a federation, a site before it trains what a RoundStart asks. Only
// the task's own fields, with no model known (the model-aware checks are the
// federation's and the trainer's). Errors name the field as the flags and
// config files spell it: "task: epochs = 0: must be in [1, 1000]".
#pragma once

#include "base/status.h"
#include "estuary.pb.h"

namespace estuary::proto {

Status CheckTask(const v1::TaskConfig& task);

}  // namespace estuary::proto
