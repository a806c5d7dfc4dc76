// The Agent's SecAgg+ rounds (client/secagg_site.h): on the I/O thread but
// for the quantising and masking, which run on the training executor a
// chunk at a time as the masked input streams.
#include <spdlog/spdlog.h>

#include "client/agent.h"
#include "proto/frame.h"

namespace estuary::client {

namespace asio = boost::asio;

Status Agent::StartSecAgg(const v1::RoundStart& start) {
  secagg_.reset();
  secagg_update_.reset();
  secagg_upload_.reset();
  secagg_masking_ = false;
  secagg_drop_ = SecAggDrop::kNone;
  if (!start.has_secagg()) return Status::Ok();
  if (options_.secagg_drop) secagg_drop_ = options_.secagg_drop(start.round(), start.secagg().site(), start.secagg().sites());
  // A simulated dropout: the caller closes the connection with this line.
  if (secagg_drop_ == SecAggDrop::kBeforeAdvertise) return Aborted("secagg: dropping out before advertising its keys");
  v1::Envelope advertise;
  if (!stream_) return FailedPrecondition("round {}: secure aggregation without a connection", start.round());
  ESTUARY_ASSIGN_OR_RETURN(const SecAggIdentity identity, SecAggIdentity::FromConnection(stream_->native_handle()));
  ESTUARY_ASSIGN_OR_RETURN(std::unique_ptr<SecAggSite> site, SecAggSite::Start(start, identity, &advertise));
  secagg_ = std::move(site);
  spdlog::debug("{}: round {}: secagg site {} of {}", name_, start.round(), start.secagg().site(),
                start.secagg().sites());
  if (const v1::SecAggSetup& setup = start.secagg(); setup.dp_share_variance() > 0) {
    spdlog::info("{}: round {}: distributed DP: clipping to {:g} and adding a discrete Gaussian share of variance {} "
                 "(z {:g} over {} inputs) before masking",
                 name_, start.round(), setup.clip(), setup.dp_share_variance(), setup.dp_noise_multiplier(),
                 setup.dp_min_inputs());
  }
  Send(advertise);
  return Status::Ok();
}

void Agent::OnSecAgg(const v1::Envelope& envelope) {
  const uint64_t round = envelope.has_secagg_keys()       ? envelope.secagg_keys().round()
                         : envelope.has_secagg_inbox()    ? envelope.secagg_inbox().round()
                         : envelope.has_secagg_survivors() ? envelope.secagg_survivors().round()
                                                          : envelope.secagg_unmask().round();
  if (!secagg_ || secagg_->round() != round) {
    return Disconnected(fmt::format("{} for round {}, in which this site takes no part in secure aggregation",
                                    proto::BodyName(envelope), round));
  }
  // A simulated dropout closes the connection where the stage's message arrives.
  const SecAggDrop drop = envelope.has_secagg_keys()        ? SecAggDrop::kAfterAdvertise
                          : envelope.has_secagg_inbox()     ? SecAggDrop::kAfterShare
                          : envelope.has_secagg_survivors() ? SecAggDrop::kAfterMaskedInput
                                                            : SecAggDrop::kNone;
  if (drop != SecAggDrop::kNone && drop == secagg_drop_) {
    secagg_.reset();
    secagg_update_.reset();
    return Disconnected(fmt::format("round {}: secagg: dropping out {}", round,
                                    drop == SecAggDrop::kAfterAdvertise ? "after advertising its keys"
                                    : drop == SecAggDrop::kAfterShare   ? "after sharing its keys"
                                                                        : "after sending its masked input"));
  }
  Status status;
  if (envelope.has_secagg_keys()) {
    auto shares = secagg_->OnKeys(envelope.secagg_keys());
    if (shares.ok()) Send(*shares);
    status = shares.status();
  } else if (envelope.has_secagg_inbox()) {
    status = secagg_->OnInbox(envelope.secagg_inbox());
    if (status.ok()) MaybeSendMaskedInput();
  } else if (envelope.has_secagg_survivors()) {
    auto signed_survivors = secagg_->OnSurvivors(envelope.secagg_survivors());
    if (signed_survivors.ok()) Send(*signed_survivors);
    status = signed_survivors.status();
  } else {
    auto response = secagg_->OnUnmask(envelope.secagg_unmask());
    if (response.ok()) {
      spdlog::info("{}: round {}: secagg unmasking answered", name_, round);
      Send(*response);
    }
    status = response.status();
  }
  // The site's refusal ends its part in the round; the server sees it gone.
  if (!status.ok()) {
    spdlog::error("{}: {}", name_, status.message());
    secagg_.reset();
    Disconnected(fmt::format("round {}: secure aggregation refused: {}", round, status.message()));
  }
}

void Agent::SecAggTrained(Update update) {
  if (update.stream) {
    spdlog::error("{}: round {}: secure aggregation needs the whole update in this process (not a ZeRO-3 site's "
                  "stream); this site sits the round out",
                  name_, secagg_->round());
    Discard(update.stream);
    secagg_.reset();
    return;
  }
  if (update.kind == UpdateKind::kLora) {
    // What the protocol sums: how far the site moved the global adapter.
    Status moved = model_ ? SubtractGlobalTensors(update.manifest, manifest_, *model_, update.payload)
                          : FailedPrecondition("the global model is no longer held");
    if (!moved.ok()) {
      spdlog::error("{}: round {}: secagg: {}", name_, secagg_->round(), moved.message());
      secagg_.reset();
      return Disconnected(fmt::format("round {}: secure aggregation refused: {}", round_->round(), moved.message()));
    }
  }
  spdlog::info("{}: round {} trained on {} in {:.3f} s; masking for secure aggregation", name_, secagg_->round(),
               update.trained_on, update.seconds);
  secagg_update_ = std::move(update);
  MaybeSendMaskedInput();
}

void Agent::MaybeSendMaskedInput() {
  if (!secagg_ || !secagg_update_ || !secagg_->has_inbox() || secagg_masking_ || secagg_upload_) return;
  secagg_upload_ = std::make_shared<const Update>(std::move(*secagg_update_));
  secagg_update_.reset();
  secagg_upload_begun_ = false;
  // From here the server may answer only once every site's input is in.
  awaiting_answer_ = true;
  ArmRead();
  MaskNextSecAggFrame();
}

void Agent::MaskNextSecAggFrame() {
  // One frame at a time, masked on the training executor (1 + k AES-256-CTR
  // passes over it: off the I/O thread) while the frame before it is written;
  // the next only once the outbox holds fewer than two, so the site holds a
  // chunk or two of its masked input, never all of it.
  if (!secagg_ || !secagg_upload_ || secagg_masking_ || outbox_.size() >= 2) return;
  secagg_masking_ = true;
  const uint64_t chunk = std::max<uint32_t>(chunk_bytes_ / 4, 1);
  const bool first = !secagg_upload_begun_;
  secagg_upload_begun_ = true;
  asio::post(training_, [self = shared_from_this(), site = secagg_, update = secagg_upload_, chunk, first,
                         connection = connection_] {
    auto frame = first ? site->BeginMaskedInput(update->payload, self->options_.secagg_keep_dir)
                       : site->NextMaskedFrame(chunk, update->num_examples, update->train_loss, update->seconds);
    asio::post(self->io_, [self, site, connection, first, frame = std::move(frame)]() mutable {
      if (self->stopped_ || site != self->secagg_ || connection != self->connection_) return;
      self->secagg_masking_ = false;
      if (!frame.ok()) {
        spdlog::error("{}: {}", self->name_, frame.status().message());
        self->secagg_.reset();
        self->secagg_upload_.reset();
        return self->Disconnected(fmt::format("round {}: secure aggregation refused: {}", site->round(),
                                              frame.status().message()));
      }
      if (first && site->clipped()) {
        spdlog::warn("{}: round {}: secagg: the update was clipped to its norm bound", self->name_, site->round());
      }
      if (site->masked_input_sent()) self->secagg_upload_.reset();
      self->outbox_.push_back(std::make_shared<const proto::Frame>(proto::EncodeFrame(*frame)));
      self->MaskNextSecAggFrame();
      self->WriteNext();
    });
  });
}

}  // namespace estuary::client
