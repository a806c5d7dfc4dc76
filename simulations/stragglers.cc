#include "simulations/stragglers.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>

#include "base/seed.h"

namespace estuary::simulations {

Result<Stragglers> ParseStragglers(double fraction, std::string_view work) {
  if (!(fraction >= 0 && fraction <= 1)) return InvalidArgument("sim: --stragglers {}: expected a fraction in [0, 1]", fraction);
  Stragglers s;
  s.fraction = fraction;
  const size_t colon = work.find(':');
  const std::string min(work.substr(0, colon)), max(colon == std::string_view::npos ? "" : work.substr(colon + 1));
  char *end_min = nullptr, *end_max = nullptr;
  s.min_work = std::strtod(min.c_str(), &end_min);
  s.max_work = std::strtod(max.c_str(), &end_max);
  if (colon == std::string_view::npos || min.empty() || max.empty() || *end_min != '\0' || *end_max != '\0' ||
      !(s.min_work > 0) || !(s.min_work <= s.max_work) || !(s.max_work <= 1)) {
    return InvalidArgument("sim: --straggler-work '{}': expected MIN:MAX with 0 < MIN <= MAX <= 1 (fractions of the "
                           "full local steps)",
                           work);
  }
  return s;
}

uint64_t FullLocalSteps(const v1::TaskConfig& task, uint64_t examples) {
  const uint64_t batch = std::max<uint64_t>(task.batch_size(), 1);
  const uint64_t full = uint64_t(task.epochs()) * ((examples + batch - 1) / batch);
  return task.max_local_steps() > 0 ? std::min<uint64_t>(full, task.max_local_steps()) : full;
}

double StragglerWork(const Stragglers& s, uint64_t seed, uint64_t round, uint32_t site) {
  std::mt19937_64 rng(MixSeed(MixSeed(MixSeed(seed, std::string_view("stragglers")), round), site));
  const double u = double(rng() >> 11) * 0x1.0p-53;  // [0, 1), the same bits everywhere
  return s.min_work + (s.max_work - s.min_work) * u;
}

double SiteSpeed(const Stragglers& s, bool straggler, uint64_t seed, uint64_t round, uint32_t site) {
  return straggler ? StragglerWork(s, seed, round, site) : 1.0;
}

uint64_t StragglerSteps(const Stragglers& s, const v1::TaskConfig& task, uint64_t examples, uint64_t seed,
                        uint64_t round, uint32_t site) {
  const double work = StragglerWork(s, seed, round, site);
  const uint64_t full = FullLocalSteps(task, examples);
  return std::clamp<uint64_t>(uint64_t(std::floor(work * double(full))), 1, std::max<uint64_t>(full, 1));
}

namespace {

class StragglingTrainer final : public client::Trainer {
 public:
  StragglingTrainer(std::unique_ptr<client::Trainer> honest, Stragglers s, uint64_t seed, uint32_t site)
      : honest_(std::move(honest)), stragglers_(s), seed_(seed), site_(site) {}
  uint64_t num_examples() const override { return honest_->num_examples(); }
  Result<client::Update> Train(std::span<const float> global, const Manifest& manifest, const v1::TaskConfig& task,
                               uint64_t round, std::string_view client_name) override {
    return honest_->Train(global, manifest, Slower(task, round), round, client_name);
  }
  // SCAFFOLD's site (client/scaffold.h) forms Δc from the steps the round took: a straggler's.
  Result<client::Update> TrainControlled(std::span<const float> global, const Manifest& manifest,
                                         const v1::TaskConfig& task, uint64_t round, std::string_view client_name,
                                         std::span<const float> control,
                                         std::span<const float> site_control) override {
    return honest_->TrainControlled(global, manifest, Slower(task, round), round, client_name, control, site_control);
  }

 private:
  v1::TaskConfig Slower(const v1::TaskConfig& task, uint64_t round) const {
    v1::TaskConfig slower = task;
    slower.set_max_local_steps(StragglerSteps(stragglers_, task, honest_->num_examples(), seed_, round, site_));
    return slower;
  }

  std::unique_ptr<client::Trainer> honest_;
  Stragglers stragglers_;
  uint64_t seed_;
  uint32_t site_;
};

}  // namespace

std::unique_ptr<client::Trainer> MakeStraggler(std::unique_ptr<client::Trainer> honest, const Stragglers& s,
                                               uint64_t seed, uint32_t site) {
  return std::make_unique<StragglingTrainer>(std::move(honest), s, seed, site);
}

}  // namespace estuary::simulations
