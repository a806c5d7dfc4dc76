// Asynchronous rounds in process (estuary-sim --async): FedBuff
// (aggregation/fedbuff.h) over the scenario's sites.
//
// C sites (--concurrency) train at once, each on the model version current
// when it started; each arrival is folded, and every K-th (--buffer) makes a
// new version, which is scored. A site that arrives goes idle and a site
// drawn uniformly from the idle ones starts on the newest version. The run
// makes `rounds` versions; its report has one row per version.
//
// Arrivals are ordered by a simulated clock, never by the threads: a site
// runs one local step per unit of time, a straggler w of one
// (stragglers.h, w drawn per job from --straggler-work), and under --async
// a straggler runs its full local steps, so its job takes 1/w as long. A job
// that starts at t on a site of F full steps arrives at t + F / w; ties go to
// the job started first, and every arrival of an instant is folded before
// the sites that arrived start again. The sites drawn, the data each job shuffles (from
// the job's number) and the model it starts from depend only on the seed, so
// a run is bit-for-bit reproducible whatever --threads is: the threads only
// train the jobs in flight ahead of their arrival.
#pragma once

#include "base/status.h"
#include "simulations/runner.h"

namespace estuary::simulations {

// The combinations --async refuses, in one line each: secagg, attacks,
// Poisson sampling, stragglers in loopback (the server keeps no simulated
// clock), and the federations CheckFedBuffFederation refuses; a concurrency
// outside [1, clients] or a bad staleness weight. In loopback the server runs
// the versions (serve --mode async) and RunLoopback reports them.
Status CheckAsyncScenario(const Scenario& scenario);

Result<Report> RunAsync(const Scenario& scenario, const RoundCallback& on_round,
                        std::vector<float>* final_global = nullptr);

}  // namespace estuary::simulations
