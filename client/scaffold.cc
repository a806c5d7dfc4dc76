#include "client/scaffold.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>

#include "base/atomic_file.h"

namespace estuary::client {

static_assert(std::endian::native == std::endian::little, "SiteControl's file is little-endian float32");

Result<SiteControl> SiteControl::Open(std::filesystem::path file) {
  SiteControl control;
  control.file_ = std::move(file);
  std::error_code error;
  if (!std::filesystem::exists(control.file_, error)) return control;
  std::ifstream in(control.file_, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof()) return IoError("scaffold: cannot read {}", control.file_.string());
  if (bytes.empty() || bytes.size() % sizeof(float) != 0) {
    return InvalidArgument("scaffold: {}: {} bytes is not a control variate of float32 values",
                           control.file_.string(), bytes.size());
  }
  control.value_.resize(bytes.size() / sizeof(float));
  std::memcpy(control.value_.data(), bytes.data(), bytes.size());
  for (size_t i = 0; i < control.value_.size(); ++i) {
    if (!std::isfinite(control.value_[i])) {
      return InvalidArgument("scaffold: {}: value [{}] is {}", control.file_.string(), i, control.value_[i]);
    }
  }
  return control;
}

Result<Update> SiteControl::Train(Trainer& trainer, std::span<const float> global, const Manifest& manifest,
                                  const v1::TaskConfig& task, uint64_t round, std::string_view client_name,
                                  std::span<const float> control) {
  if (control.size() != global.size()) {
    return InvalidArgument("scaffold: the server's control variate has {} values, the model {}", control.size(),
                           global.size());
  }
  if (!value_.empty() && value_.size() != global.size()) {
    return FailedPrecondition("scaffold: the site's control variate{} has {} values, the model {}",
                              file_.empty() ? "" : " in " + file_.string(), value_.size(), global.size());
  }
  std::vector<float> site = value_.empty() ? std::vector<float>(global.size(), 0.0f) : value_;
  ESTUARY_ASSIGN_OR_RETURN(Update update,
                           trainer.TrainControlled(global, manifest, task, round, client_name, control, site));
  if (update.payload.size() != global.size()) {
    return FailedPrecondition("scaffold: the round's update has {} values, the model {}", update.payload.size(),
                              global.size());
  }
  if (update.local_steps == 0) return FailedPrecondition("scaffold: the round took no optimizer step");
  // Option II: Δc_i = -c + (x - y_i) / (K η) = -c - Δy_i / (K η).
  const double per_step = 1.0 / (double(update.local_steps) * double(task.learning_rate()));
  update.control_delta.resize(global.size());
  for (size_t i = 0; i < global.size(); ++i) {
    const float delta = static_cast<float>(-double(control[i]) - double(update.payload[i]) * per_step);
    update.control_delta[i] = delta;
    site[i] = static_cast<float>(double(site[i]) + double(delta));
  }
  for (size_t i = 0; i < site.size(); ++i) {
    if (!std::isfinite(site[i]) || !std::isfinite(update.control_delta[i])) {
      return FailedPrecondition("scaffold: round {}: the site's control variate [{}] overflows float", round, i);
    }
  }
  if (!file_.empty()) {
    ESTUARY_RETURN_IF_ERROR(WriteFileAtomically(
        file_, std::string_view(reinterpret_cast<const char*>(site.data()), site.size() * sizeof(float))));
  }
  value_ = std::move(site);
  return update;
}

}  // namespace estuary::client
