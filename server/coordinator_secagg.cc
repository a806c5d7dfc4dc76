// The Coordinator's SecAgg+ rounds (server/secagg_state.h): the protocol's
// five stages relayed over the selected sites' sessions, on the same strand
// as the rest of the round, so nothing here is locked.
#include <spdlog/spdlog.h>

#include <cmath>
#include <cstring>

#include "crypto/site_signature.h"
#include "privacy/poisson_plan.h"
#include "proto/frame.h"
#include "secagg/neighbours.h"
#include "secagg/wire.h"
#include "server/coordinator.h"
#include "server/recover.h"

namespace estuary::server {

namespace asio = boost::asio;

namespace {

uint64_t FrameBytes(const v1::Envelope& envelope) { return envelope.ByteSizeLong() + 4; }

secagg::Key32 RandomSeed() {
  auto key = secagg::RandomKey();
  // RAND_bytes refusing is OpenSSL broken: nothing secure can run.
  if (!key.ok()) {
    spdlog::critical("secagg: {}", key.status().ToString());
    std::abort();
  }
  return *key;
}

SecAggState::Stage StageOf(v1::Envelope::BodyCase body) {
  switch (body) {
    case v1::Envelope::kSecaggAdvertise: return SecAggState::kAdvertise;
    case v1::Envelope::kSecaggShares: return SecAggState::kShare;
    case v1::Envelope::kSecaggMaskedChunk:
    case v1::Envelope::kSecaggMaskedDone: return SecAggState::kMasked;
    case v1::Envelope::kSecaggSurvivorsSigned: return SecAggState::kConsistency;
    default: return SecAggState::kUnmask;
  }
}

uint64_t RoundOf(const v1::Envelope& e) {
  switch (e.body_case()) {
    case v1::Envelope::kSecaggAdvertise: return e.secagg_advertise().round();
    case v1::Envelope::kSecaggShares: return e.secagg_shares().round();
    case v1::Envelope::kSecaggMaskedChunk: return e.secagg_masked_chunk().round();
    case v1::Envelope::kSecaggMaskedDone: return e.secagg_masked_done().round();
    case v1::Envelope::kSecaggSurvivorsSigned: return e.secagg_survivors_signed().round();
    default: return e.secagg_unmask_response().round();
  }
}

// The site's keys come signed with the certificate it authenticated with.
// Its neighbours check the signature (client/secagg_site.h); this catches a
// site that would have them refuse the round, at its first message.
Status CheckAdvertiser(const v1::SecAggAdvertise& advertise, const std::string& name) {
  if (advertise.signature().empty() || advertise.certificate().empty()) {
    return InvalidArgument("secagg: {}'s keys come unsigned", name);
  }
  auto holder = crypto::CertificateCommonName(advertise.certificate());
  if (!holder.ok()) return InvalidArgument("secagg: {}'s keys: {}", name, holder.status().message());
  if (*holder != name) return InvalidArgument("secagg: {}'s keys come with the certificate of '{}'", name, *holder);
  return Status::Ok();
}

// The global adapter's tensors in the upload layout (all factors, or the B
// tensors under frozen-a): what a site's movement is measured from.
Result<std::vector<float>> LoraReferenceOf(const aggregation::LoraStrategyOptions& lora,
                                           const std::vector<float>& global) {
  const Manifest upload = aggregation::ExpectedLoraUpload(lora);
  std::vector<float> out;
  out.reserve(upload.total_elements);
  for (const TensorSpec& spec : upload.tensors) {
    const TensorSpec* at = lora.layout.adapter.Find(spec.name);
    const uint64_t offset = at ? lora.layout.adapter_offset() + at->offset : 0;
    if (at == nullptr || offset + spec.numel() > global.size()) {
      return Internal("secagg: lora upload tensor {} is not in the global model", spec.name);
    }
    out.insert(out.end(), global.begin() + int64_t(offset), global.begin() + int64_t(offset + spec.numel()));
  }
  return out;
}

}  // namespace

Result<privacy::DistributedDpPlan> DistributedDpPlanFor(const ServerConfig& config, uint32_t sites,
                                                        uint64_t dimension) {
  const v1::DpConfig& dp = config.federation.dp();
  privacy::DistributedDpOptions options{.noise_multiplier = dp.noise_multiplier(),
                                        .clip = dp.clip(),
                                        .survivors = config.dp_survivors,
                                        .denominator = double(sites)};
  if (config.sample_rate > 0) {
    // Poisson sampling: the run's plan, not the draw's (as estuary-sim's).
    const uint32_t population = config.federation.strategy().total_sites();
    options.denominator = options.expected_sites = config.sample_rate * double(population);
    options.max_sites = privacy::PoissonPlannedMaximum(population, config.sample_rate);
  }
  auto plan = privacy::PlanDistributedDpShares(options, config.secagg.bits, sites, dimension);
  if (!plan.ok()) return Status(plan.status().code(), fmt::format("distributed DP: {}", plan.status().message()));
  return plan;
}

double DistributedDpDenominator(const ServerConfig& config, uint32_t sites) {
  return config.sample_rate > 0 ? config.sample_rate * double(config.federation.strategy().total_sites())
                                : double(sites);
}

Status DistributedDpDrawFits(const ServerConfig& config, uint64_t round, uint32_t sites,
                             const privacy::DistributedDpPlan& plan) {
  if (config.sample_rate <= 0) return Status::Ok();
  const uint32_t population = config.federation.strategy().total_sites();
  const uint32_t most = privacy::PoissonPlannedMaximum(population, config.sample_rate);
  if (sites > most) {
    return FailedPrecondition("secagg round {}: distributed DP: Poisson sampling drew {} sites, more than the {} the "
                              "ring was planned for (q {:g} of total_sites {}): refusing the round",
                              round, sites, most, config.sample_rate, population);
  }
  if (sites < plan.min_included) {
    return FailedPrecondition("secagg round {}: distributed DP: Poisson sampling drew {} sites, fewer than the {} inputs "
                              "the noise is calibrated for (q {:g} of total_sites {}, --dp-survivors {}): refusing the "
                              "round",
                              round, sites, plan.min_included, config.sample_rate, population, config.dp_survivors);
  }
  return Status::Ok();
}

Status Coordinator::StartSecAgg(const std::vector<std::string>& selected) {
  const auto& s = config_.secagg;
  const uint32_t n = uint32_t(selected.size());
  if (n < 2) return FailedPrecondition("secagg round {}: {} site selected: secure aggregation needs 2", round_, n);
  // A lora federation (naive, frozen-a) sums how far each site moved the
  // adapter's factors: its upload less the global adapter's same tensors.
  std::vector<float> lora_reference;
  if (lora_) {
    ESTUARY_ASSIGN_OR_RETURN(lora_reference, LoraReferenceOf(*lora_, *distribution_.current().values));
  }
  const uint64_t dimension = lora_ ? lora_reference.size() : manifest_.total_elements;
  secagg::ProtocolConfig config = secagg::DefaultProtocolConfig(n, dimension, round_, RandomSeed());
  if (s.neighbours > 0) config.degree = s.neighbours;
  config.threshold = s.threshold > 0 ? s.threshold : secagg::DefaultThreshold(config.degree);
  config.bits = s.bits;
  if (Status ok = secagg::CheckProtocolConfig(config); !ok.ok()) {
    return InvalidArgument("secagg round {} with {} sites: {}", round_, n, ok.message());
  }
  // Each site weighs its update by the examples its Hello claimed (at most
  // max_examples), and the scale is as fine as the ring allows for their total.
  std::vector<uint64_t> weights;
  double total = 0;
  const uint64_t cap = config_.federation.limits().max_examples();
  for (const std::string& name : selected) {
    const uint64_t claimed = hello_examples_[name];
    weights.push_back(std::max<uint64_t>(1, cap > 0 ? std::min(claimed, cap) : claimed));
    total += double(weights.back());
  }
  double scale = std::floor((std::ldexp(1.0, s.bits - 1) - 1 - n) / (s.clip * total));
  double clip = s.clip;
  // Distributed DP: every site weighs 1 (DP-FedAvg's equal weights), clips
  // to the DP clip, and the plan sets the scale and each share's variance.
  std::optional<privacy::DistributedDpPlan> dp;
  const std::vector<uint64_t> examples = weights;
  if (config_.distributed_dp()) {
    auto plan = DistributedDpPlanFor(config_, n, dimension);
    if (!plan.ok()) return InvalidArgument("secagg round {}: {}", round_, plan.status().message());
    dp = *plan;
    // Poisson sampling: the shares are planned for the expected q · total_sites,
    // so a draw must fit the ring and hold the noise the plan promises.
    if (Status fits = DistributedDpDrawFits(config_, round_, n, *dp); !fits.ok()) return fits;
    std::fill(weights.begin(), weights.end(), 1);
    scale = dp->scale;
    clip = config_.federation.dp().clip();
  }
  if (!(scale >= 1)) {
    return InvalidArgument("secagg round {}: secagg_bits {} too narrow for {} sites of {} examples at clip {} (scale "
                           "{} < 1)",
                           round_, s.bits, n, total, s.clip, scale);
  }
  ESTUARY_ASSIGN_OR_RETURN(secagg::SecAggServer server, secagg::SecAggServer::Create(config));
  secagg_ = std::make_unique<SecAggState>(std::move(server));
  SecAggState& st = *secagg_;
  st.quantization = {.bits = s.bits, .clip_norm = clip, .scale = scale};
  st.lora_reference = std::move(lora_reference);
  st.weights = std::move(weights);
  st.examples = examples;
  st.dp = dp;
  for (uint32_t u = 0; u < n; ++u) {
    st.ids[selected[u]] = u;
    st.names.push_back(selected[u]);
    st.waiting.insert(u);
  }
  st.record = {.stage = RoundSecAgg::kStages[0], .sites = n, .neighbours = uint32_t(config.degree),
               .threshold = uint32_t(config.threshold), .bits = uint32_t(s.bits), .clip = clip, .scale = scale};
  spdlog::info("round {}: secagg over {} sites, k {}, t {}, {} bits, clip {:g}, scale {:g}{}", round_, n, config.degree,
               config.threshold, s.bits, clip, scale,
               dp ? fmt::format("; distributed DP: each site adds N_Z(0, {}), the sum needs {} inputs",
                                dp->site_variance, dp->min_included)
                  : std::string());
  return Status::Ok();
}

void Coordinator::OnSecAgg(const std::shared_ptr<ClientSession>& session, const v1::Envelope& envelope) {
  const std::string& name = session->name();
  const std::string_view body = proto::BodyName(envelope);
  auto id = secagg_ ? secagg_->ids.find(name) : decltype(secagg_->ids.find(name)){};
  auto p = participants_.find(name);
  if (!round_running_ || !secagg_ || state_ != RoundState::kCollecting || RoundOf(envelope) != round_ ||
      id == secagg_->ids.end() || p == participants_.end() || p->second.session.lock() != session) {
    return Reject(session, v1::Error::ROUND_NOT_OPEN,
                  fmt::format("{} for round {}, which has no secure aggregation waiting for {}", body,
                              RoundOf(envelope), name));
  }
  SecAggState& st = *secagg_;
  const uint32_t u = id->second;
  const SecAggState::Stage stage = StageOf(envelope.body_case());
  if (stage != st.stage || !st.waiting.contains(u)) {
    return Reject(session, v1::Error::BAD_MESSAGE,
                  fmt::format("secagg round {}: {} from {} (site {}) while the round is at {}{}", round_, body, name, u,
                              st.stage < SecAggState::kDone ? RoundSecAgg::kStages[st.stage] : "its end",
                              stage == st.stage ? ", which it already answered or was not asked" : ""));
  }
  st.record.bytes_up[stage] += FrameBytes(envelope);
  p->second.record.bytes_up += FrameBytes(envelope);
  Status received;
  switch (envelope.body_case()) {
    case v1::Envelope::kSecaggAdvertise: {
      const v1::SecAggAdvertise& advertise = envelope.secagg_advertise();
      auto keys = secagg::FromProto(advertise, u);
      received = keys.ok() ? CheckAdvertiser(advertise, name) : keys.status();
      if (received.ok()) received = st.server.Receive(*keys);
      if (received.ok()) st.signed_keys[u] = {advertise.signature(), advertise.certificate()};
      break;
    }
    case v1::Envelope::kSecaggShares: {
      auto shares = secagg::FromProto(envelope.secagg_shares(), u);
      received = shares.ok() ? st.server.Receive(*shares) : shares.status();
      break;
    }
    case v1::Envelope::kSecaggMaskedChunk: {
      const v1::SecAggMaskedChunk& chunk = envelope.secagg_masked_chunk();
      if (secagg::IsMaskedBegin(chunk) && !st.begun.contains(u)) {
        // Its input goes into the sum as it streams, holding a staging slot
        // (and the copy to undo it by) until it is complete: while none is
        // free, the session is paused and its chunks wait in the socket.
        st.begun.insert(u);
        received = slots_.BeginJournal(session, st.server.config().dimension * sizeof(uint32_t));
        if (received.ok()) return;  // its chunks follow
        break;
      }
      SpillBuffer* journal = slots_.Journal(name);
      if (journal == nullptr) {
        received = InvalidArgument("secagg: a masked input chunk before the one that opens it (element 0, no data)");
        break;
      }
      const uint64_t at = chunk.offset();
      received = secagg::DecodeMaskedChunk(chunk, at, st.server.config().dimension, st.chunk);
      if (received.ok()) received = st.server.ReceiveMaskedChunk(u, at, st.chunk);
      if (!received.ok()) break;
      // What was added, kept to subtract again should the site stop partway.
      // Kept only once the sum took it: a refused chunk must not overwrite
      // the copy of one that was added.
      if (Status kept = journal->Write(at * sizeof(uint32_t), st.chunk.data(), st.chunk.size() * sizeof(uint32_t));
          !kept.ok()) {
        return FailRound(fmt::format("secagg: {}'s masked input cannot be kept to undo it: {}", name, kept.message()));
      }
      return;  // more follows
    }
    case v1::Envelope::kSecaggMaskedDone: {
      if (slots_.Journal(name) == nullptr) {
        received = InvalidArgument("secagg: secagg_masked_done before its masked input was opened");
        break;
      }
      received = st.server.FinishMaskedInput(u);
      if (!received.ok()) break;
      slots_.Release(name);  // complete: nothing to undo; the slot goes to the next site below
      const v1::SecAggMaskedDone& done = envelope.secagg_masked_done();
      Participation& record = p->second.record;
      record.examples = st.examples[u];
      record.train_loss = std::isfinite(done.train_loss()) ? done.train_loss() : 0;
      record.seconds = SecondsSince(p->second.started);
      break;
    }
    case v1::Envelope::kSecaggSurvivorsSigned: {
      auto signed_survivors = secagg::FromProto(envelope.secagg_survivors_signed(), u);
      received = signed_survivors.ok() ? st.server.Receive(*signed_survivors) : signed_survivors.status();
      break;
    }
    default: {
      auto response = secagg::FromProto(envelope.secagg_unmask_response(), u);
      received = response.ok() ? st.server.Receive(*response) : response.status();
      break;
    }
  }
  if (!received.ok()) return Reject(session, v1::Error::BAD_MESSAGE, received.message());
  st.waiting.erase(u);
  ++st.record.answered[stage];
  if (stage == SecAggState::kMasked) GrantSlots();  // may end a site, which closes the stage itself
  MaybeCloseSecAggStage(false);
}

void Coordinator::SecAggGone(const std::string& name) {
  if (!secagg_) return;
  SecAggState& st = *secagg_;
  auto id = st.ids.find(name);
  if (id == st.ids.end() || !st.gone.insert(id->second).second) return;
  ReleaseSecAggSlot(id->second);
  if (!secagg_) return;  // the withdrawal failed the round
  if (st.stage < SecAggState::kDone && st.waiting.erase(id->second)) ++st.record.dropouts[st.stage];
  MaybeCloseSecAggStage(false);
}

void Coordinator::ReleaseSlot(const std::string& name) {
  auto id = secagg_ ? secagg_->ids.find(name) : decltype(secagg_->ids.find(name)){};
  if (secagg_ && id != secagg_->ids.end()) return ReleaseSecAggSlot(id->second);
  slots_.Release(name);
}

void Coordinator::ReleaseSecAggSlot(uint32_t u) {
  SecAggState& st = *secagg_;
  const std::string& name = st.names[u];
  if (st.stage == SecAggState::kMasked && st.server.PartlyReceived(u)) {
    // Stopped partway: its chunks are in the sum; the slot's copy takes them out again.
    const SpillBuffer* journal = slots_.Journal(name);
    Status withdrawn =
        journal == nullptr
            ? Internal("secagg: site {}'s input is partly in the sum without a copy to undo it", u)
            : st.server.WithdrawMaskedInput(u, [journal](uint64_t offset, std::span<uint32_t> values) {
                return journal->Read(offset * sizeof(uint32_t), values.data(), values.size() * sizeof(uint32_t));
              });
    slots_.Release(name);
    if (!withdrawn.ok()) return FailRound(withdrawn.message());
    spdlog::info("round {}: secagg: {} (site {}) stopped partway through its masked input; withdrawn from the sum",
                 round_, name, u);
    return;
  }
  slots_.Release(name);
}

void Coordinator::MaybeCloseSecAggStage(bool deadline) {
  if (!secagg_ || secagg_->stage == SecAggState::kDone) return;
  SecAggState& st = *secagg_;
  if (!deadline && !st.waiting.empty()) return;
  for (uint32_t u : std::set<uint32_t>(st.waiting)) {  // silent at the deadline: they drop out of this stage
    ++st.record.dropouts[st.stage];
    st.gone.insert(u);
    ReleaseSecAggSlot(u);
    if (!secagg_) return;  // the withdrawal failed the round
    Participant& p = participants_.at(st.names[u]);
    if (auto session = p.session.lock(); session && !session->closed()) session->Resume();  // if it was queued
    if (p.record.status != "selected") continue;
    p.record.status = "late";
    p.record.detail = fmt::format("no answer in secagg stage {} before its deadline", RoundSecAgg::kStages[st.stage]);
    p.record.seconds = SecondsSince(p.started);
    LogIfError(store_.UpsertParticipation(p.record), "store");
  }
  st.waiting.clear();
  CloseSecAggStage();
}

void Coordinator::CloseSecAggStage() {
  SecAggState& st = *secagg_;
  std::map<uint32_t, v1::Envelope> messages;
  switch (st.stage) {
    case SecAggState::kAdvertise: {
      auto keys = st.server.CloseAdvertise();
      if (!keys.ok()) return FailRound(keys.status().message());
      for (const auto& [u, broadcast] : *keys) {
        v1::SecAggKeys& relayed = *messages[u].mutable_secagg_keys() = secagg::ToProto(broadcast, round_);
        for (v1::SecAggPeerKeys& peer : *relayed.mutable_neighbours()) {
          const auto& [signature, certificate] = st.signed_keys.at(peer.site());
          peer.set_signature(signature);
          peer.set_certificate(certificate);
        }
      }
      return OpenSecAggStage(SecAggState::kShare, std::move(messages));
    }
    case SecAggState::kShare: {
      auto inboxes = st.server.CloseShareKeys();
      if (!inboxes.ok()) return FailRound(inboxes.status().message());
      for (const auto& [u, inbox] : *inboxes) *messages[u].mutable_secagg_inbox() = secagg::ToProto(inbox, round_);
      return OpenSecAggStage(SecAggState::kMasked, std::move(messages));
    }
    case SecAggState::kMasked: {
      auto survivors = st.server.CloseMaskedInput();
      if (!survivors.ok()) return FailRound(survivors.status().message());
      // Fewer inputs than the shares were calibrated for would hold less
      // noise than promised: nothing of it is unmasked.
      if (st.dp && survivors->survived.size() < st.dp->min_included) {
        return FailRound(fmt::format("secagg round {}: distributed DP: {} of {} inputs arrived, fewer than the {} the "
                                     "noise is calibrated for (--dp-survivors {}): refusing to unmask",
                                     round_, survivors->survived.size(), st.record.sites, st.dp->min_included,
                                     config_.dp_survivors));
      }
      v1::Envelope envelope;
      *envelope.mutable_secagg_survivors() = secagg::ToProto(*survivors, round_, st.server.config().sites);
      for (uint32_t u : survivors->survived) messages[u] = envelope;
      return OpenSecAggStage(SecAggState::kConsistency, std::move(messages));
    }
    case SecAggState::kConsistency: {
      auto requests = st.server.CloseConsistency();
      if (!requests.ok()) return FailRound(requests.status().message());
      for (const auto& [u, request] : *requests) *messages[u].mutable_secagg_unmask() = secagg::ToProto(request, round_);
      return OpenSecAggStage(SecAggState::kUnmask, std::move(messages));
    }
    case SecAggState::kUnmask: return FinishSecAgg();
    case SecAggState::kDone: return;
  }
}

void Coordinator::OpenSecAggStage(SecAggState::Stage stage, std::map<uint32_t, v1::Envelope> messages) {
  SecAggState& st = *secagg_;
  st.stage = stage;
  st.record.stage = RoundSecAgg::kStages[stage];
  st.waiting.clear();
  for (const auto& [u, envelope] : messages) {
    // The message answers the stage before: its bytes are that stage's.
    st.record.bytes_down[stage - 1] += FrameBytes(envelope);
    auto session = participants_.at(st.names[u]).session.lock();
    if (st.gone.contains(u) || !session || session->closed()) {
      ++st.record.dropouts[stage];
      continue;
    }
    st.waiting.insert(u);
    session->Send(envelope);
  }
  Transition(RoundState::kCollecting, fmt::format("secagg: {}: waiting for {} of {} sites", st.record.stage,
                                                  st.waiting.size(), st.record.sites));
  ArmSecAggDeadline();
  MaybeCloseSecAggStage(false);
}

void Coordinator::ArmSecAggDeadline() {
  // Each stage after the first gets the round's deadline again: the first
  // includes the download and training, the others only the protocol.
  deadline_->Arm(std::chrono::milliseconds(int64_t(config_.round_deadline_s * 1000)), [this, round = round_] {
    if (round_running_ && round_ == round && state_ == RoundState::kCollecting) OnDeadline();
  });
}

void Coordinator::FinishSecAgg() {
  SecAggState& st = *secagg_;
  auto output = st.server.Finish();
  if (!output.ok()) return FailRound(output.status().message());
  st.stage = SecAggState::kDone;
  st.record.stage = "done";
  double weight = 0;
  for (uint32_t u : output->included) {
    weight += double(st.weights[u]);
    Participant& p = participants_.at(st.names[u]);
    p.record.status = "committed";
    p.record.detail = st.gone.contains(u) ? "in the sum; gone before unmasking" : "";
    ++record_.updates_received;
    loss_sum_ += p.record.train_loss * double(p.record.examples);
    examples_sum_ += double(p.record.examples);
    LogIfError(store_.UpsertParticipation(p.record), "store");
  }
  for (uint64_t bytes : st.record.bytes_up) record_.bytes_up += bytes;
  st.included = uint32_t(output->included.size());
  // Distributed DP: the fixed denominator, the sites sampled or under Poisson
  // sampling the expected q · total_sites (as DP-FedAvg's).
  const double denominator = st.dp ? DistributedDpDenominator(config_, st.record.sites) : weight;
  auto mean = secagg::Dequantize(output->sum, denominator, st.quantization);
  if (!mean.ok()) return FailRound(fmt::format("secagg round {}: {}", round_, mean.status().message()));
  spdlog::info("round {}: secagg sum of {} sites unmasked ({} dropped after sharing keys); error bound {:.3g} per "
               "element",
               round_, output->included.size(), output->dropped.size(),
               secagg::DequantizationErrorBound(int(output->included.size()), denominator, st.quantization));
  auto values = std::make_shared<std::vector<float>>(mean->begin(), mean->end());
  // lora: the mean upload is the global adapter's tensors plus the mean movement.
  for (size_t j = 0; j < st.lora_reference.size(); ++j) (*values)[j] += st.lora_reference[j];
  ++folds_in_flight_;
  asio::post(worker_, [this, values, weight] {
    Status folded = aggregator_->FoldMean(*values, weight);
    asio::post(io_, [this, folded] {
      --folds_in_flight_;
      if (!folded.ok()) return FailRound(fmt::format("secagg round {}: fold: {}", round_, folded.ToString()));
      Aggregate();
    });
  });
}

}  // namespace estuary::server
