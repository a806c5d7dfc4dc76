#include "server/distribution.h"

#include <algorithm>
#include <cstring>

#include <spdlog/spdlog.h>

#include "crypto/sha256.h"
#include "crypto/transfer_digest.h"

namespace estuary::server {

void ModelDistribution::Reset(Manifest manifest, GlobalModel current) {
  manifest_ = std::move(manifest);
  current_ = std::move(current);
  previous_ = {};
  patch_ = {};
  factors_.reset();
  FindChangesFromBase();
}

void ModelDistribution::FindChangesFromBase() {
  base_patch_ = {};
  if (!held_base_ || !current_.values || held_base_->size() != current_.values->size()) return;
  const auto& held = *held_base_;
  const auto& current = *current_.values;
  auto& ranges = base_patch_.ranges;
  for (const TensorSpec& spec : manifest_.tensors) {
    if (std::memcmp(held.data() + spec.offset, current.data() + spec.offset, spec.numel() * sizeof(float)) == 0) {
      continue;
    }
    if (!ranges.empty() && ranges.back().first + ranges.back().second == spec.offset) {
      ranges.back().second += spec.numel();
    } else {
      ranges.emplace_back(spec.offset, spec.numel());
    }
  }
  // An empty patch would read as "the whole model"; a model equal to the
  // base (a full federation's round 1) sends its smallest tensor.
  if (ranges.empty() && !manifest_.tensors.empty()) {
    const TensorSpec& smallest = *std::min_element(
        manifest_.tensors.begin(), manifest_.tensors.end(),
        [](const TensorSpec& a, const TensorSpec& b) { return a.numel() < b.numel(); });
    ranges.emplace_back(smallest.offset, smallest.numel());
  }
}

void ModelDistribution::Publish(GlobalModel next, std::vector<aggregation::LowRankChange> low_rank) {
  previous_ = std::move(current_);
  current_ = std::move(next);
  patch_ = {};
  auto factors = std::make_shared<std::vector<float>>();
  for (const aggregation::LowRankChange& change : low_rank) {
    factors->insert(factors->end(), change.delta.u.begin(), change.delta.u.end());
    factors->insert(factors->end(), change.delta.v.begin(), change.delta.v.end());
    patch_.low_rank.push_back(
        {.offset = change.offset, .rows = change.delta.rows, .cols = change.delta.cols, .rank = change.delta.rank});
  }
  factors_ = std::move(factors);
  FindChangedRanges();
  FindChangesFromBase();
}

void ModelDistribution::SetControl(std::shared_ptr<const std::vector<float>> control) {
  control_ = std::move(control);
  control_digest_ = control_ ? crypto::TransferDigestHex(control_->data(), control_->size() * sizeof(float)) : "";
}

void ModelDistribution::FindChangedRanges() {
  const auto& previous = previous_.values;
  const auto& current = current_.values;
  if (!previous || previous->size() != current->size()) return;
  std::set<uint64_t> as_factors;
  for (const proto::LowRankPatch& change : patch_.low_rank) as_factors.insert(change.offset);
  auto& ranges = patch_.ranges;
  uint64_t changed = 0;
  for (const TensorSpec& spec : manifest_.tensors) {
    if (as_factors.contains(spec.offset)) continue;  // sent as its factors
    const size_t bytes = spec.numel() * sizeof(float);
    if (std::memcmp(previous->data() + spec.offset, current->data() + spec.offset, bytes) == 0) continue;
    if (!ranges.empty() && ranges.back().first + ranges.back().second == spec.offset) {
      ranges.back().second += spec.numel();  // adjacent tensors: one range
    } else {
      ranges.emplace_back(spec.offset, spec.numel());
    }
    changed += spec.numel();
  }
  // Everything changed (a full delta's round): a patch would be the whole model.
  if (changed == manifest_.total_elements) ranges.clear();
}

void ModelDistribution::OnHello(const std::string& name, const v1::Hello& hello) {
  held_[name] = {hello.model_version_held(), hello.model_checksum_held()};
  if (hello.keeps_model()) {
    keeps_model_.insert(name);
  } else {
    keeps_model_.erase(name);
  }
}

void ModelDistribution::BeginRound(uint64_t round) {
  round_ = round;
  queue_.clear();
  streams_.clear();  // their timers with them; their on_sent finds nothing
  streaming_ = 0;
  offered_.clear();
}

uint64_t ModelDistribution::Offer(const std::shared_ptr<ClientSession>& session, v1::RoundStart* start) {
  const std::string& name = session->name();
  const Held& held = held_[name];
  const uint64_t version = current_.version;
  const bool holds_model = held.version == version && crypto::SameHexDigest(held.checksum, current_.checksum);
  const bool patch = !holds_model && !patch_.empty() && keeps_model_.contains(name) && version > 0 &&
                     held.version == version - 1 && crypto::SameHexDigest(held.checksum, previous_.checksum);
  // On a Hugging Face base every site holds the base: whatever it lacks is
  // a patch on it, never the whole model (a patch on the previous version
  // where that is smaller).
  const bool on_base = !holds_model && held_base_ &&
                       (!patch || base_patch_.range_elements() <= patch_.range_elements() + patch_.factor_count());
  const Send send = on_base ? Send::kPatchOnBase : patch ? Send::kPatch : Send::kWhole;
  start->set_model_follows(!holds_model);
  start->set_model_digest(holds_model ? "" : current_.digest);
  proto::WriteModelPatch(send == Send::kPatch ? patch_ : send == Send::kPatchOnBase ? base_patch_ : proto::ModelPatch{},
                         start);
  start->set_patch_base_version(send == Send::kPatch ? version - 1 : 0);
  start->set_patch_on_base(send == Send::kPatchOnBase);
  offered_[name] = {version, current_.checksum};
  // An evaluation round scores the model alone: no site trains, so no c.
  const bool control = control_ && !start->evaluate_only();
  start->set_control_follows(control);
  start->set_control_digest(control ? control_digest_ : "");
  const uint64_t control_bytes = control ? control_->size() * sizeof(float) : 0;
  if (holds_model && !control) return 0;
  const Send what = holds_model ? Send::kNone : send;
  Download download{.session = session, .round = start->round(), .values = current_.values};
  if (what == Send::kPatch) {
    download.bytes = patch_.ByteRanges(manifest_.total_elements);
    if (!patch_.low_rank.empty()) download.tail = factors_;
  } else if (what == Send::kPatchOnBase) {
    download.bytes = base_patch_.ByteRanges(manifest_.total_elements);
  }
  if (control) {  // c past the model's end, in a range of its own (no low-rank tail beside it)
    const uint64_t model_bytes = manifest_.byte_size();
    if (what == Send::kWhole) download.bytes = {{0, model_bytes}};
    if (what == Send::kNone) download.bytes.clear();
    download.bytes.emplace_back(model_bytes, model_bytes + control_->size() * sizeof(float));
    download.tail = control_;
  }
  queue_.push_back(std::move(download));
  if (holds_model) return control_bytes;
  switch (send) {
    case Send::kPatch: return (patch_.range_elements() + patch_.factor_count()) * sizeof(float) + control_bytes;
    case Send::kPatchOnBase: return base_patch_.range_elements() * sizeof(float) + control_bytes;
    default: return manifest_.byte_size() + control_bytes;
  }
}

void ModelDistribution::Confirm(const std::string& name) {
  auto it = offered_.find(name);
  if (it == offered_.end()) return;
  // A site that does not keep its models drops this one once trained.
  if (keeps_model_.contains(name)) {
    held_[name] = it->second;
  } else {
    held_[name] = {};
  }
  offered_.erase(it);
}

void ModelDistribution::StreamQueued() {
  while (streaming_ < kConcurrentDownloads && !queue_.empty()) {
    Download next = std::move(queue_.front());
    queue_.pop_front();
    auto session = next.session.lock();
    if (!session || session->closed()) continue;
    const uint64_t id = next_stream_++;
    Stream& stream = streams_[id];
    stream.name = session->name();
    stream.slot_timer = clock_.MakeTimer();
    ++streaming_;
    stream.slot_timer->Arm(slot_timeout_, [this, id] {
      auto it = streams_.find(id);
      if (it == streams_.end() || !it->second.holds_place) return;
      spdlog::info("round {}: {}'s download still streams after {:.0f} s; the next starts beside it", round_,
                   it->second.name, std::chrono::duration<double>(slot_timeout_).count());
      FreeSlot(id);
    });
    // A session that closes mid-stream calls back too, so its place frees
    // either way; a stream of an earlier attempt is no longer in streams_.
    session->SendModel(
        next.round, std::move(next.values),
        [this, id] {
          auto it = streams_.find(id);
          if (it == streams_.end()) return;
          const bool holds_place = it->second.holds_place;
          streams_.erase(it);
          if (holds_place) {
            --streaming_;
            StreamQueued();
          }
        },
        std::move(next.bytes), std::move(next.tail));
  }
}

void ModelDistribution::FreeSlot(uint64_t id) {
  auto it = streams_.find(id);
  if (it == streams_.end() || !it->second.holds_place) return;
  it->second.holds_place = false;
  --streaming_;
  StreamQueued();
}

}  // namespace estuary::server
