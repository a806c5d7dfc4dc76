// The local work behind a site's update, as FedNova (Wang et al. 2020,
// aggregation/fednova.h) normalises by it.
//
// A site's delta is -η Σ_k a_k g_k over its τ local gradients g_k; FedNova
// divides it by ‖a‖₁ = Σ_k a_k, so sites that stepped more do not count for
// more. Treating the linear parts of the update as the paper does (its
// Section 4 and Appendix), a_k is the scalar impulse response of the site's
// optimizer to a unit gradient at step k:
//   plain SGD                   a_k = 1                 ‖a‖₁ = τ
//   momentum ρ (torch's SGD)    a_k = (1 - ρ^(τ-k))/(1-ρ)
//   proximal μ, decay λ         a_k = (1 - η(μ+λ))^(τ-1-k)
// and both at once, by the same recurrence (weight decay enters the
// gradient as λw, FedProx's term as μ(w - w₀): both feed the displacement
// back with coefficient μ + λ). AdamW has no such vector: its per-coordinate
// step depends on the gradients themselves, so it reports ‖a‖₁ = τ, the
// count of steps, which is the normalisation FedNova's authors use for
// adaptive local solvers (and which makes equal-τ rounds FedAvg's).
#pragma once

#include <cstdint>

#include "client/task.h"

namespace estuary::client {

// ‖a‖₁ for `steps` optimizer steps of `task` (0 for 0 steps).
double FedNovaNormalizer(const TaskConfig& task, uint64_t steps);

}  // namespace estuary::client
