#include "server/aggregator.h"

#include "aggregation/dp_fedavg.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <future>
#include <utility>

#include "aggregation/scaffold.h"
#include "crypto/sha256.h"
#include "crypto/transfer_digest.h"

namespace estuary::server {

using SteadyClock = std::chrono::steady_clock;

static double Millis(SteadyClock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

Aggregator::Aggregator(std::unique_ptr<aggregation::Strategy> strategy, aggregation::UpdateBound bound,
                       std::unique_ptr<models::Evaluator> evaluator, Checkpointer checkpointer, Manifest manifest)
    : strategy_(std::move(strategy)),
      bound_(std::move(bound)),
      evaluator_(std::move(evaluator)),
      checkpointer_(std::move(checkpointer)),
      manifest_(std::move(manifest)) {}

namespace {

// The bound's state rides beside the strategy's, under its own prefix.
constexpr std::string_view kBoundPrefix = "update_bound/";

}  // namespace

Result<std::vector<float>> Aggregator::Restore(const std::filesystem::path& path, const std::string& logged_checksum) {
  ESTUARY_ASSIGN_OR_RETURN(Checkpointer::Loaded loaded, checkpointer_.Load(path, manifest_, logged_checksum));
  Checkpointer::State strategy_state, bound_state;
  for (auto& [name, values] : loaded.state) {
    (name.starts_with(kBoundPrefix) ? bound_state : strategy_state)[name] = std::move(values);
  }
  ESTUARY_RETURN_IF_ERROR(strategy_->LoadState(strategy_state));
  ESTUARY_RETURN_IF_ERROR(bound_.LoadState(bound_state));
  return std::move(loaded.values);
}

Status Aggregator::Begin(uint64_t round, std::span<const float> global, uint64_t sampled, double expected) {
  bound_.BeginRound();
  strategy_->PlanRound(sampled);
  if (auto* dp = dynamic_cast<aggregation::DpFedAvg*>(strategy_.get())) dp->PlanExpected(expected);
  return strategy_->Begin(round, global);
}

namespace {

// An update as the bound admitted it, with what keeps its values alive: the
// staged update, or (scaled to the bound) the Admitted's own copy.
struct AdmittedUpdate {
  std::shared_ptr<const void> staged;
  aggregation::UpdateBound::Admitted admitted;
};

}  // namespace

Result<std::string> Aggregator::Fold(std::string_view client, const Manifest& layout, std::shared_ptr<const void> owner,
                                     std::span<const float> values, uint64_t examples,
                                     const aggregation::LocalWork& work, std::span<const float> control_delta) {
  auto* scaffold = dynamic_cast<aggregation::Scaffold*>(strategy_.get());
  if (!control_delta.empty() && !scaffold) {
    return InvalidArgument("server: the update from {} carries a control delta, which {} does not take", client,
                           strategy_->name());
  }
  ESTUARY_ASSIGN_OR_RETURN(aggregation::UpdateBound::Admitted admitted, bound_.Admit(values, examples));
  if (scaffold) {  // it copies both into its sums: nothing is kept
    ESTUARY_RETURN_IF_ERROR(scaffold->FoldControl(client, admitted.values(), control_delta, double(examples)));
    return admitted.note();
  }
  if (admitted.scale() != 1) owner.reset();  // the values are the Admitted's scaled copy now
  auto held = std::make_shared<const AdmittedUpdate>(AdmittedUpdate{std::move(owner), std::move(admitted)});
  ESTUARY_RETURN_IF_ERROR(strategy_->FoldWork(client, layout, held, held->admitted.values(), double(examples), work));
  return held->admitted.note();
}

Aggregator::Finished Aggregator::Finish(uint64_t round, const GlobalModel& previous) {
  const auto start = SteadyClock::now();
  Finished result;
  auto global = std::make_shared<std::vector<float>>(*previous.values);
  result.status = strategy_->Finish(*global);
  if (!result.status.ok()) return result;
  bound_.CommitRound();  // before the checkpoint, which saves the median it now holds
  result.changed_bytes = strategy_->changed_bytes();
  result.low_rank = strategy_->low_rank_changes();
  if (const auto* dp = dynamic_cast<const aggregation::DpFedAvg*>(strategy_.get())) result.dp = dp->last_round();
  spdlog::debug("round {}: finished in {:.2f} ms", round, Millis(SteadyClock::now() - start));
  Seal(round, std::move(global), strategy_->name(), result);
  if (result.status.ok()) {
    auto control = Control();
    if (control.ok()) {
      result.control = std::move(control).value();
    } else {
      result.status = control.status();
    }
  }
  return result;
}

void Aggregator::Seal(uint64_t round, std::shared_ptr<std::vector<float>> global, std::string_view strategy,
                      Finished& result) {
  const auto finished = SteadyClock::now();
  result.model.checksum = crypto::Sha256Hex(global->data(), global->size() * sizeof(float));
  result.model.digest = crypto::TransferDigestHex(global->data(), global->size() * sizeof(float));
  // The checkpoint mostly waits for fsync while evaluation computes: side by side,
  // the round is ready to commit when the longer of the two is done.
  auto checkpointed = std::async(std::launch::async, [&] {
    Checkpointer::State state = strategy_->SaveState();
    state.merge(bound_.SaveState());
    auto written = checkpointer_.Write(round, manifest_, *global, result.model.checksum, strategy, state);
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
  spdlog::debug("round {}: evaluated in {:.2f} ms and checkpointed in {:.2f} ms", round,
                Millis(evaluated - finished), Millis(written_at - finished));
  if (written.ok()) {
    result.checkpoint = std::move(written).value();
  } else {
    result.status = written.status();
  }
  result.model.values = std::move(global);
}

Status Aggregator::BeginAsync(const aggregation::FedBuffOptions& options, uint64_t version,
                              std::shared_ptr<const std::vector<float>> global, uint64_t last) {
  if (!global || global->size() != manifest_.total_elements) {
    return InvalidArgument("fedbuff: the model has {} values, its layout {}", global ? global->size() : 0,
                           manifest_.total_elements);
  }
  ESTUARY_ASSIGN_OR_RETURN(aggregation::FedBuff fedbuff, aggregation::FedBuff::Create(options, global->size(), version));
  fedbuff_.emplace(std::move(fedbuff));
  async_global_ = std::move(global);
  async_last_ = last;
  bound_.BeginRound();
  return Status::Ok();
}

Aggregator::AsyncFolded Aggregator::FoldAsync(std::span<const float> values, uint64_t examples,
                                              uint64_t trained_from) {
  AsyncFolded out;
  if (!fedbuff_) {
    out.status = FailedPrecondition("fedbuff: asynchronous rounds were not begun");
    return out;
  }
  out.version = fedbuff_->version();
  if (out.version >= async_last_) {
    out.status = FailedPrecondition("the federation completed at version {}", out.version);
    return out;
  }
  if (trained_from > out.version) {
    out.status = InvalidArgument("update trained from version {}, but the server is at version {}", trained_from,
                                 out.version);
    return out;
  }
  out.staleness = out.version - trained_from;
  if (out.staleness > fedbuff_->options().max_staleness) {
    out.stale = true;
    out.status = FailedPrecondition("{} versions stale (trained from version {}, the server at {}), beyond "
                                    "max_staleness {}",
                                    out.staleness, trained_from, out.version, fedbuff_->options().max_staleness);
    return out;
  }
  auto admitted = bound_.Admit(values, examples);
  if (!admitted.ok()) {
    out.status = admitted.status();
    return out;
  }
  out.note = admitted->note();
  auto folded = fedbuff_->Fold(admitted->values(), trained_from);
  if (!folded.ok()) {
    out.status = folded.status();
    return out;
  }
  out.weight = folded->weight;
  if (!folded->full) return out;
  const auto start = SteadyClock::now();
  auto global = std::make_shared<std::vector<float>>(*async_global_);
  out.step = Finished{};  // assigned whole: clang will not emplace a type that is complete only after Aggregator
  Finished& step = *out.step;
  step.status = fedbuff_->Step(*global);
  if (!step.status.ok()) return out;
  bound_.CommitRound();  // before the checkpoint, which saves the median it now holds
  async_global_ = global;
  spdlog::debug("version {}: stepped in {:.2f} ms", fedbuff_->version(), Millis(SteadyClock::now() - start));
  Seal(fedbuff_->version(), std::move(global), "fedbuff", step);
  bound_.BeginRound();
  return out;
}

Result<std::shared_ptr<const std::vector<float>>> Aggregator::Control() const {
  const auto* scaffold = dynamic_cast<const aggregation::Scaffold*>(strategy_.get());
  if (!scaffold) return std::shared_ptr<const std::vector<float>>();
  ESTUARY_ASSIGN_OR_RETURN(std::vector<float> control, scaffold->Control(manifest_.total_elements));
  return std::make_shared<const std::vector<float>>(std::move(control));
}

}  // namespace estuary::server
