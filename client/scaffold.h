// SiteControl: a SCAFFOLD site's control variate c_i (Karimireddy et al.
// 2020, Algorithm 1, option II; the server's half is aggregation/scaffold.h).
//
// Each round the site trains from the global model x with every local
// gradient corrected by (c - c_i), c the server's control variate sent with
// the round, and then
//   c_i⁺ = c_i - c + (x - y_i) / (K η)     Δc_i = c_i⁺ - c_i = -c - Δy_i / (K η)
// with y_i its trained model, Δy_i = y_i - x the update it uploads, K its
// optimizer steps and η the task's learning rate. Δc_i goes up beside Δy_i
// (Update::control_delta) and c_i⁺ is kept for the site's next round: in
// memory, or in a file of the client's state directory, replaced atomically
// after each round so a restarted site goes on from its last one. c_i
// starts at zero.
#pragma once

#include <filesystem>
#include <span>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "client/trainer.h"

namespace estuary::client {

class SiteControl {
 public:
  // In memory only.
  SiteControl() = default;
  // Kept in `file`: read when it exists (raw little-endian float32, one per
  // parameter), else starts at zero; errors name the file.
  static Result<SiteControl> Open(std::filesystem::path file);

  // c_i; empty until the first round (zero).
  std::span<const float> value() const { return value_; }

  // One SCAFFOLD round of `trainer` from `global` with the server's `control`
  // (c, global's size): returns its update with control_delta set, and keeps
  // c_i⁺. A failed round keeps c_i as it was.
  Result<Update> Train(Trainer& trainer, std::span<const float> global, const Manifest& manifest,
                       const v1::TaskConfig& task, uint64_t round, std::string_view client_name,
                       std::span<const float> control);

 private:
  std::filesystem::path file_;
  std::vector<float> value_;
};

}  // namespace estuary::client
