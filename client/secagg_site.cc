#include "client/secagg_site.h"

#include <cmath>
#include <fstream>
#include <set>

#include "base/atomic_file.h"
#include "secagg/discrete_gaussian.h"
#include "secagg/quantize.h"
#include "secagg/wire.h"

namespace estuary::client {

Result<SecAggIdentity> SecAggIdentity::FromConnection(SSL* ssl) {
  ESTUARY_ASSIGN_OR_RETURN(crypto::SiteSigner signer, crypto::SiteSigner::FromConnection(ssl));
  ESTUARY_ASSIGN_OR_RETURN(crypto::SiteVerifier verifier, crypto::SiteVerifier::FromConnection(ssl));
  return SecAggIdentity{std::move(signer), std::move(verifier)};
}

Result<SecAggIdentity> SecAggIdentity::FromFiles(const crypto::TlsFiles& files) {
  ESTUARY_ASSIGN_OR_RETURN(crypto::SiteSigner signer, crypto::SiteSigner::FromFiles(files));
  ESTUARY_ASSIGN_OR_RETURN(crypto::SiteVerifier verifier, crypto::SiteVerifier::FromFiles(files));
  return SecAggIdentity{std::move(signer), std::move(verifier)};
}

Status SubtractGlobalTensors(const Manifest& upload, const Manifest& global_manifest, std::span<const float> global,
                             std::span<float> values) {
  if (values.size() != upload.total_elements) {
    return InvalidArgument("lora upload of {} values, its manifest has {}", values.size(), upload.total_elements);
  }
  for (const TensorSpec& spec : upload.tensors) {
    const TensorSpec* at = global_manifest.Find(spec.name);
    if (at == nullptr || at->numel() != spec.numel() || at->offset + at->numel() > global.size()) {
      return InvalidArgument("lora upload tensor {}: {} in the global model", spec.name,
                             at == nullptr ? "not" : "of another size");
    }
    const float* from = global.data() + at->offset;
    float* to = values.data() + spec.offset;
    for (uint64_t i = 0; i < spec.numel(); ++i) to[i] -= from[i];
  }
  return Status::Ok();
}

Result<std::unique_ptr<SecAggSite>> SecAggSite::Start(const v1::RoundStart& start, const SecAggIdentity& identity,
                                                      v1::Envelope* advertise) {
  const v1::SecAggSetup& setup = start.secagg();
  ESTUARY_ASSIGN_OR_RETURN(const secagg::ProtocolConfig config, secagg::ConfigFromProto(setup, start.round()));
  // A lora site sums its adapter's movement: fewer elements than the model.
  const bool lora = start.task().update_kind() == v1::UPDATE_LORA;
  if (lora ? config.dimension > start.manifest().total_elements()
           : config.dimension != start.manifest().total_elements()) {
    return InvalidArgument("secagg: setup of {} elements for a {}model of {}", config.dimension, lora ? "lora " : "",
                           start.manifest().total_elements());
  }
  const secagg::QuantizationConfig quantization{.bits = config.bits, .clip_norm = setup.clip(), .scale = setup.scale()};
  ESTUARY_RETURN_IF_ERROR(secagg::CheckQuantizationConfig(quantization));
  if (lora && start.task().lora().merge() != "naive" && start.task().lora().merge() != "frozen-a") {
    return InvalidArgument("secagg: a lora round merged '{}': secure aggregation gives only sums of factors (naive, "
                           "frozen-a)",
                           start.task().lora().merge());
  }
  // Distributed DP: the site's share of the noise, on equal weights.
  if (setup.dp_share_variance() > 0 &&
      (setup.dp_share_variance() > secagg::kMaxDiscreteGaussianVariance || setup.weight() != 1)) {
    return InvalidArgument("secagg: distributed DP with a share variance of {} and weight {}: the sampler takes 1 to "
                           "2^52, and every site weighs 1",
                           setup.dp_share_variance(), setup.weight());
  }
  ESTUARY_ASSIGN_OR_RETURN(secagg::SecAggClient client, secagg::SecAggClient::Create(config, setup.site()));
  std::unique_ptr<SecAggSite> site(new SecAggSite(std::move(client), config, setup, identity));
  ESTUARY_ASSIGN_OR_RETURN(const secagg::AdvertiseKeys keys, site->client_.Advertise());
  ESTUARY_ASSIGN_OR_RETURN(std::string signature,
                           identity.signer.Sign(secagg::AdvertisementToSign(config, keys)));
  v1::SecAggAdvertise& message = *advertise->mutable_secagg_advertise();
  message = secagg::ToProto(keys, start.round());
  message.set_signature(std::move(signature));
  message.set_certificate(identity.signer.certificate());
  return site;
}

Status SecAggSite::CheckSigned(const v1::SecAggKeys& keys, const secagg::KeysBroadcast& broadcast) const {
  const std::string& own = identity_.signer.common_name();
  std::set<std::string> holders = {own};
  for (int i = 0; i < keys.neighbours_size(); ++i) {
    const v1::SecAggPeerKeys& peer = keys.neighbours(i);
    if (peer.signature().empty() || peer.certificate().empty()) {
      return InvalidArgument("secagg round {}: site {}'s keys come unsigned; a site takes only keys its neighbour "
                             "signed",
                             round_, peer.site());
    }
    auto holder = identity_.verifier.Verify(
        peer.certificate(), secagg::AdvertisementToSign(config_, broadcast.neighbours[size_t(i)]), peer.signature());
    if (!holder.ok()) return InvalidArgument("secagg round {}: site {}'s keys: {}", round_, peer.site(),
                                             holder.status().message());
    if (!holders.insert(*holder).second) {
      return InvalidArgument("secagg round {}: site {}'s keys are signed by '{}', {}", round_, peer.site(), *holder,
                             *holder == own ? "this site's own certificate" : "who signed another neighbour's too");
    }
  }
  return Status::Ok();
}

Result<v1::Envelope> SecAggSite::OnKeys(const v1::SecAggKeys& keys) {
  ESTUARY_ASSIGN_OR_RETURN(const secagg::KeysBroadcast broadcast, secagg::FromProto(keys));
  ESTUARY_RETURN_IF_ERROR(CheckSigned(keys, broadcast));
  ESTUARY_ASSIGN_OR_RETURN(const secagg::ShareKeys shares, client_.Share(broadcast));
  for (const v1::SecAggPeerKeys& peer : keys.neighbours()) certificates_[peer.site()] = peer.certificate();
  v1::Envelope envelope;
  *envelope.mutable_secagg_shares() = secagg::ToProto(shares, round_);
  return envelope;
}

Status SecAggSite::OnInbox(const v1::SecAggInbox& inbox) {
  if (inbox_) return FailedPrecondition("secagg round {}: a second share inbox", round_);
  ESTUARY_ASSIGN_OR_RETURN(inbox_, secagg::FromProto(inbox));
  return Status::Ok();
}

Result<std::vector<v1::Envelope>> SecAggSite::MaskedInput(std::span<const float> update, uint64_t chunk_elements,
                                                          uint64_t num_examples, double train_loss,
                                                          double train_seconds, const std::filesystem::path& keep_dir) {
  std::vector<v1::Envelope> frames;
  ESTUARY_ASSIGN_OR_RETURN(v1::Envelope begin, BeginMaskedInput(update, keep_dir));
  frames.push_back(std::move(begin));
  while (!masked_done_) {
    ESTUARY_ASSIGN_OR_RETURN(v1::Envelope frame, NextMaskedFrame(chunk_elements, num_examples, train_loss, train_seconds));
    frames.push_back(std::move(frame));
  }
  return frames;
}

Result<v1::Envelope> SecAggSite::BeginMaskedInput(std::span<const float> update, const std::filesystem::path& keep_dir) {
  if (!inbox_) return FailedPrecondition("secagg round {}: masked input before the share inbox", round_);
  if (update.size() != config_.dimension) {
    return InvalidArgument("secagg round {}: an update of {} elements, the setup's dimension is {}", round_,
                           update.size(), config_.dimension);
  }
  ESTUARY_ASSIGN_OR_RETURN(clip_factor_, secagg::ClipFactor(update, setup_.clip()));
  clipped_ = clip_factor_ < 1;
  ESTUARY_ASSIGN_OR_RETURN(rounding_, secagg::RandomKey());
  ESTUARY_RETURN_IF_ERROR(client_.BeginMaskedInput(*inbox_));
  update_ = update;
  masked_next_ = 0;
  masked_done_ = false;
  keep_dir_ = keep_dir;
  kept_.clear();
  kept_noise_.clear();
  return secagg::MaskedBeginMessage(round_);
}

Result<v1::Envelope> SecAggSite::NextMaskedFrame(uint64_t chunk_elements, uint64_t num_examples, double train_loss,
                                                 double train_seconds) {
  if (masked_done_ || update_.size() != config_.dimension || config_.dimension == 0) {
    return FailedPrecondition("secagg round {}: no masked input being streamed", round_);
  }
  if (masked_next_ == update_.size()) {
    ESTUARY_RETURN_IF_ERROR(client_.FinishMaskedInput());
    if (!keep_dir_.empty()) {
      const auto keep = [&](const std::vector<uint32_t>& values, std::string_view suffix) {
        const std::string bytes(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(uint32_t));
        return WriteFileAtomically(
            keep_dir_ / fmt::format("round-{}.site-{}.w-{}{}.u32", round_, client_.site(), setup_.weight(), suffix),
            bytes);
      };
      ESTUARY_RETURN_IF_ERROR(keep(kept_, ""));
      if (setup_.dp_share_variance() > 0) ESTUARY_RETURN_IF_ERROR(keep(kept_noise_, ".noise"));
      kept_ = {};
      kept_noise_ = {};
    }
    masked_done_ = true;
    update_ = {};
    v1::Envelope done;
    done.mutable_secagg_masked_done()->set_round(round_);
    done.mutable_secagg_masked_done()->set_num_examples(num_examples);
    done.mutable_secagg_masked_done()->set_train_loss(train_loss);
    done.mutable_secagg_masked_done()->set_train_seconds(train_seconds);
    return done;
  }
  const secagg::QuantizationConfig quantization{
      .bits = int(setup_.bits()), .clip_norm = setup_.clip(), .scale = setup_.scale()};
  const uint64_t n = std::min<uint64_t>(std::max<uint64_t>(chunk_elements, 1), update_.size() - masked_next_);
  std::vector<uint32_t> values(n);
  ESTUARY_RETURN_IF_ERROR(secagg::QuantizeChunk(update_.subspan(masked_next_, n), masked_next_,
                                                double(setup_.weight()), clip_factor_, quantization, rounding_,
                                                values));
  // Distributed DP: the share goes in before the masks, from a key nobody
  // else holds (RAND_bytes, a fresh one each chunk), so neither the server
  // nor a reader of any seed can subtract it.
  if (setup_.dp_share_variance() > 0) {
    std::vector<uint32_t> clean;
    if (!keep_dir_.empty()) clean = values;
    ESTUARY_ASSIGN_OR_RETURN(const secagg::Key32 noise_key, secagg::RandomKey());
    ESTUARY_RETURN_IF_ERROR(
        secagg::AddDiscreteGaussian(values, setup_.dp_share_variance(), int(setup_.bits()), noise_key));
    // What was added, mod 2^b: the noised input less the clean one.
    for (size_t i = 0; i < clean.size(); ++i) kept_noise_.push_back(values[i] - clean[i]);
  }
  if (!keep_dir_.empty()) kept_.insert(kept_.end(), values.begin(), values.end());
  ESTUARY_RETURN_IF_ERROR(client_.MaskChunk(masked_next_, values));
  v1::Envelope frame = secagg::MaskedChunkMessage(round_, masked_next_, values);
  masked_next_ += n;
  return frame;
}

Result<v1::Envelope> SecAggSite::OnSurvivors(const v1::SecAggSurvivors& survivors) {
  auto told = secagg::FromProto(survivors, config_.sites);
  if (!told.ok()) {
    return ProtocolError("secagg site {}: round {}: consistency check: {}", client_.site(), round_,
                         told.status().message());
  }
  ESTUARY_ASSIGN_OR_RETURN(const std::string message, client_.ConfirmSurvivors(*told));
  ESTUARY_ASSIGN_OR_RETURN(std::string signature, identity_.signer.Sign(message));
  v1::Envelope envelope;
  *envelope.mutable_secagg_survivors_signed() = secagg::ToProto(
      secagg::SurvivorsSigned{.site = client_.site(), .signature = std::move(signature)}, round_);
  return envelope;
}

Result<v1::Envelope> SecAggSite::OnUnmask(const v1::SecAggUnmask& request) {
  ESTUARY_ASSIGN_OR_RETURN(const secagg::UnmaskRequest parsed, secagg::FromProto(request));
  // A neighbour's signature counts under the certificate its keys were signed
  // with, and no other: the server cannot bring in a signer of its own.
  const secagg::SignatureCheck check = [this](uint32_t signer, const secagg::ConfirmedSurvivors& confirmed,
                                              std::string_view signature) -> Status {
    const auto it = certificates_.find(signer);
    if (it == certificates_.end()) return InvalidArgument("this site never took site {}'s keys", signer);
    return identity_.verifier.Verify(it->second, confirmed.message, signature, confirmed.sha256).status();
  };
  ESTUARY_ASSIGN_OR_RETURN(const secagg::UnmaskResponse response, client_.Unmask(parsed, check));
  v1::Envelope envelope;
  *envelope.mutable_secagg_unmask_response() = secagg::ToProto(response, round_);
  return envelope;
}

}  // namespace estuary::client
