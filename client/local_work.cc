#include "client/local_work.h"

namespace estuary::client {

double FedNovaNormalizer(const TaskConfig& task, uint64_t steps) {
  if (task.optimizer != OptimizerKind::kSgd) return double(steps);
  const double rho = task.momentum;
  const double eta = task.learning_rate;
  const double decay = double(task.proximal_mu) + double(task.weight_decay);
  if (rho == 0 && decay == 0) return double(steps);
  // One unit gradient at the first step, then none: x is the displacement it
  // has caused after m steps (in units of -η), v the momentum buffer. A
  // gradient at step k of τ contributes x after τ - k steps, so ‖a‖₁ is the
  // sum of x over m = 1..τ. O(τ), in double.
  double x = 0, v = 0, sum = 0;
  for (uint64_t m = 0; m < steps; ++m) {
    v = rho * v + (m == 0 ? 1.0 : 0.0) - decay * eta * x;  // the decay's gradient d·w, w = -η x
    x += v;
    sum += x;
  }
  return sum;
}

}  // namespace estuary::client
