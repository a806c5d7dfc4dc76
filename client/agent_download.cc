// The Agent's downloads (agent.h): the round's model, whole or as a patch
// on the model held (its low-rank changes added once their factors are in),
// checked against the RoundStart's checksum; and under SCAFFOLD the
// server's control variate c after it, past the model's end, checked against
// its own checksum, before the round trains.
#include <spdlog/spdlog.h>

#include <cstring>

#include "client/agent.h"

namespace estuary::client {

std::string Agent::RefusalOfControl(const v1::RoundStart& start, const std::string& site) const {
  if (!start.control_follows()) return "";
  const auto refuse = [&](std::string_view why) {
    return fmt::format("{}: round {} sends SCAFFOLD's control variate, but {}", site, start.round(), why);
  };
  if (!options_.scaffold) return refuse("this site keeps no control variate of its own (c_i)");
  // What the server refuses too: a site told otherwise is not talking to a server it can train for.
  if (start.has_secagg()) return refuse("secure aggregation would hide the Δc_i the server must fold");
  if (start.task().update_kind() == v1::UPDATE_LORA) return refuse("a lora site trains adapters, not the model c is over");
  if (start.low_rank_size() > 0 || start.evaluate_only()) return refuse("it comes with low-rank factors or to score");
  return "";
}

void Agent::ExpectControl(const v1::RoundStart& start) {
  control_.reset();
  control_received_ = 0;
  if (!start.model_follows()) incoming_.clear();  // what an earlier stream left: c's chunks are not its
  if (!start.control_follows()) {
    control_digest_.reset();
    incoming_control_.clear();
    return;
  }
  incoming_control_.assign(manifest_.total_elements, 0.0f);
  control_digest_ = std::make_unique<crypto::TransferDigest>();
}

void Agent::OnModelChunk(const v1::ModelChunk& chunk) {
  if (!round_ || chunk.round() != round_->round()) return;  // a stale stream; ignore
  if (!incoming_.empty()) return OnModelBytes(chunk);
  if (control_digest_) return OnControlBytes(chunk);
}

void Agent::OnControlBytes(const v1::ModelChunk& chunk) {
  const uint64_t begin = manifest_.total_elements * sizeof(float);
  const uint64_t total = incoming_control_.size() * sizeof(float);
  if (chunk.offset() != begin + control_received_ || chunk.data().size() > total - control_received_) {
    return Disconnected(fmt::format("round {}: control variate chunk at {} (+{}) does not continue at {}",
                                    round_->round(), chunk.offset(), chunk.data().size(), begin + control_received_));
  }
  char* bytes = reinterpret_cast<char*>(incoming_control_.data()) + control_received_;
  std::memcpy(bytes, chunk.data().data(), chunk.data().size());
  control_digest_->Update(bytes, chunk.data().size());
  control_received_ += chunk.data().size();
  if (control_received_ < total) return;
  const std::string digest = control_digest_->FinalHex();
  control_digest_.reset();
  if (!crypto::SameHexDigest(digest, round_->control_digest())) {
    return Disconnected(fmt::format("round {}: control variate digest {} != announced {}", round_->round(), digest,
                                    round_->control_digest()));
  }
  control_ = std::make_shared<const std::vector<float>>(std::move(incoming_control_));
  incoming_control_.clear();
  Train();
}

void Agent::ApplyLowRank() {
  const float* at = incoming_factors_.data();
  for (auto& [offset, change] : incoming_low_rank_) {
    change.u.assign(at, at + change.rows * change.rank);
    at += change.u.size();
    change.v.assign(at, at + change.rank * change.cols);
    at += change.v.size();
    change.AddTo(std::span<float>(incoming_).subspan(offset, change.rows * change.cols));
  }
  incoming_low_rank_.clear();
  incoming_factors_.clear();
}

void Agent::OnModelBytes(const v1::ModelChunk& chunk) {
  const uint64_t total = incoming_.size() * sizeof(float);
  const uint64_t range_end = incoming_ranges_[incoming_range_].second;
  if (chunk.offset() != incoming_offset_ || chunk.data().size() > range_end - incoming_offset_) {
    return Disconnected(fmt::format("model chunk at {} (+{}) does not continue at {} within its range", chunk.offset(),
                                    chunk.data().size(), incoming_offset_));
  }
  const bool digest_as_it_comes = incoming_low_rank_.empty();
  char* bytes = reinterpret_cast<char*>(incoming_.data());
  if (incoming_offset_ >= total) {  // a low-rank change's factors
    std::memcpy(reinterpret_cast<char*>(incoming_factors_.data()) + (incoming_offset_ - total), chunk.data().data(),
                chunk.data().size());
  } else {
    std::memcpy(bytes + incoming_offset_, chunk.data().data(), chunk.data().size());
    // Digested chunk by chunk while the bytes are still in cache.
    if (digest_as_it_comes) download_digest_->Update(bytes + incoming_offset_, chunk.data().size());
  }
  incoming_offset_ += chunk.data().size();
  if (incoming_offset_ < range_end) return;
  // The held bytes up to the next range (or the end) count in the digest too.
  const uint64_t next = ++incoming_range_ < incoming_ranges_.size() ? incoming_ranges_[incoming_range_].first : total;
  if (digest_as_it_comes) download_digest_->Update(bytes + incoming_offset_, next - incoming_offset_);
  incoming_offset_ = next;
  if (incoming_range_ < incoming_ranges_.size()) return;
  if (!digest_as_it_comes) {
    ApplyLowRank();
    download_digest_->Update(incoming_.data(), total);
  }
  const std::string digest = download_digest_->FinalHex();
  download_digest_.reset();
  if (!crypto::SameHexDigest(digest, round_->model_digest())) {
    return Disconnected(fmt::format("round {}: model digest {} != announced {}", round_->round(), digest,
                                    round_->model_digest()));
  }
  spdlog::debug("{}: round {} model received", name_, round_->round());
  model_ = std::make_shared<const std::vector<float>>(std::move(incoming_));
  incoming_.clear();
  model_version_ = round_->model_version();
  model_checksum_ = round_->model_checksum();  // the version's name; its bytes were checked by their digest
  if (!control_digest_) Train();  // else once c is in
}

}  // namespace estuary::client
