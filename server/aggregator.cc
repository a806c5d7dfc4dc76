#include "server/aggregator.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <future>
#include <utility>

#include "crypto/sha256.h"

namespace estuary::server {

using SteadyClock = std::chrono::steady_clock;

static double Millis(SteadyClock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

Aggregator::Aggregator(std::unique_ptr<aggregation::Strategy> strategy, std::unique_ptr<models::Evaluator> evaluator,
                       Checkpointer checkpointer, Manifest manifest)
    : strategy_(std::move(strategy)),
      evaluator_(std::move(evaluator)),
      checkpointer_(std::move(checkpointer)),
      manifest_(std::move(manifest)) {}

Result<std::vector<float>> Aggregator::Restore(const std::filesystem::path& path, const std::string& logged_checksum) {
  return checkpointer_.Load(path, manifest_, logged_checksum, *strategy_);
}

Status Aggregator::Begin(uint64_t round, std::span<const float> global) { return strategy_->Begin(round, global); }

Status Aggregator::Fold(std::string_view client, const Manifest& layout, std::span<const float> values,
                        double weight) {
  return strategy_->FoldUpdate(client, layout, values, weight);
}

Aggregator::Finished Aggregator::Finish(uint64_t round, const GlobalModel& previous) {
  const auto start = SteadyClock::now();
  Finished result;
  auto global = std::make_shared<std::vector<float>>(*previous.values);
  result.status = strategy_->Finish(*global);
  if (!result.status.ok()) return result;
  result.changed_bytes = strategy_->changed_bytes();
  result.low_rank = strategy_->low_rank_changes();
  result.model.checksum = crypto::Sha256Hex(global->data(), global->size() * sizeof(float));
  const auto finished = SteadyClock::now();
  // The checkpoint mostly waits for fsync while evaluation computes: side by side,
  // the round is ready to commit when the longer of the two is done.
  auto checkpointed = std::async(std::launch::async, [&] {
    auto written = checkpointer_.Write(round, manifest_, *global, result.model.checksum, *strategy_);
    return std::make_pair(std::move(written), SteadyClock::now());
  });
  if (evaluator_) {
    auto scored = evaluator_->Evaluate(*global);
    if (scored.ok()) {
      result.eval = *scored;
    } else {
      spdlog::error("round {}: evaluation failed: {}", round, scored.status().ToString());
    }
  }
  const auto evaluated = SteadyClock::now();
  auto [written, written_at] = checkpointed.get();
  spdlog::debug("round {}: finished in {:.2f} ms, then evaluated in {:.2f} ms and checkpointed in {:.2f} ms", round,
                Millis(finished - start), Millis(evaluated - finished), Millis(written_at - finished));
  if (written.ok()) {
    result.checkpoint = std::move(written).value();
  } else {
    result.status = written.status();
  }
  result.model.values = std::move(global);
  return result;
}

}  // namespace estuary::server
