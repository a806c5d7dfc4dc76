#include "secagg/client.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <algorithm>
#include <set>

#include "secagg/envelope.h"
#include "secagg/masking.h"
#include "secagg/prg.h"
#include "secagg/shamir.h"

namespace estuary::secagg {
namespace {

const char* StageName(int stage) {
  static const char* const kNames[] = {"advertise keys",    "share keys", "masked input", "masked input (streaming)",
                                      "consistency check", "unmasking",  "done"};
  return kNames[stage];
}

}  // namespace

Result<SecAggClient> SecAggClient::Create(const ProtocolConfig& config, uint32_t site) {
  ESTUARY_RETURN_IF_ERROR(CheckProtocolConfig(config));
  if (site >= config.sites) return InvalidArgument("secagg site {}: not among the {} sites", site, config.sites);
  ESTUARY_ASSIGN_OR_RETURN(SiteNeighbours neighbours,
                           SiteNeighbours::Of(site, int(config.sites), config.degree, config.graph_seed));
  SecAggClient client(config, site, std::move(neighbours));
  ESTUARY_ASSIGN_OR_RETURN(client.mask_keys_, GenerateX25519KeyPair());
  ESTUARY_ASSIGN_OR_RETURN(client.share_keys_, GenerateX25519KeyPair());
  ESTUARY_ASSIGN_OR_RETURN(client.self_seed_, RandomKey());
  return client;
}

SecAggClient::~SecAggClient() {
  OPENSSL_cleanse(mask_keys_.private_key.data(), mask_keys_.private_key.size());
  OPENSSL_cleanse(share_keys_.private_key.data(), share_keys_.private_key.size());
  OPENSSL_cleanse(self_seed_.data(), self_seed_.size());
  for (auto& [peer, key] : share_key_with_) OPENSSL_cleanse(key.data(), key.size());
  for (auto& [peer, held] : held_) {
    OPENSSL_cleanse(held.seed.data(), held.seed.size());
    OPENSSL_cleanse(held.key.data(), held.key.size());
  }
  for (PairwiseKey& pair : pairwise_) OPENSSL_cleanse(pair.key.data(), pair.key.size());
}

Status SecAggClient::Expect(Stage stage, std::string_view call) {
  if (stage_ == stage) return Status::Ok();
  return FailedPrecondition("secagg site {}: round {}: {} called in stage {}", site_, config_.round, call,
                            StageName(int(stage_)));
}

Status SecAggClient::Refuse(Status status) {
  stage_ = Stage::kDone;
  return status;
}

Result<AdvertiseKeys> SecAggClient::Advertise() {
  ESTUARY_RETURN_IF_ERROR(Expect(Stage::kAdvertise, "advertise keys"));
  stage_ = Stage::kShare;
  return AdvertiseKeys{.site = site_,
                       .mask_public_key = mask_keys_.public_key,
                       .share_public_key = share_keys_.public_key};
}

Result<ShareKeys> SecAggClient::Share(const KeysBroadcast& keys) {
  ESTUARY_RETURN_IF_ERROR(Expect(Stage::kShare, "share keys"));
  const std::string where = fmt::format("secagg site {}: round {}: share keys", site_, config_.round);
  for (const AdvertiseKeys& peer : keys.neighbours) {
    if (peer.site >= config_.sites) {
      return Refuse(ProtocolError("{}: keys of site {}, not among the {} sites", where, peer.site, config_.sites));
    }
    if (peer.site == site_) return Refuse(ProtocolError("{}: keys of this site itself", where));
    if (!neighbours_.Contains(peer.site)) {
      return Refuse(ProtocolError("{}: keys of site {}, not a neighbour", where, peer.site));
    }
    if (!peers_.emplace(peer.site, peer).second) {
      return Refuse(ProtocolError("{}: keys of site {} listed twice", where, peer.site));
    }
  }
  if (int(peers_.size()) < config_.threshold) {
    return Refuse(FailedPrecondition("{}: {} of {} neighbours advertised keys, fewer than the threshold {}", where,
                                     peers_.size(), config_.degree, config_.threshold));
  }
  std::vector<uint32_t> xs;
  for (const auto& [peer, keys_of] : peers_) xs.push_back(peer + 1);  // x = holder + 1, never 0
  auto seed_shares = Split(self_seed_, config_.threshold, xs);
  if (!seed_shares.ok()) return Refuse(seed_shares.status());
  auto key_shares = Split(mask_keys_.private_key, config_.threshold, xs);
  if (!key_shares.ok()) return Refuse(key_shares.status());
  ShareKeys out{.site = site_,
                .seed_commitment = seed_shares->commitment,
                .key_commitment = key_shares->commitment};
  size_t i = 0;
  for (const auto& [peer, keys_of] : peers_) {
    auto key = AgreeRoundKey(share_keys_.private_key, keys_of.share_public_key, kShareKeyLabel, config_.round);
    if (!key.ok()) return Refuse(ProtocolError("{}: share key with site {}: {}", where, peer, key.status().message()));
    std::vector<uint8_t> plaintext(seed_shares->shares[i].y.begin(), seed_shares->shares[i].y.end());
    plaintext.insert(plaintext.end(), key_shares->shares[i].y.begin(), key_shares->shares[i].y.end());
    auto sealed = Seal(*key, {.sender = site_, .receiver = peer, .round = config_.round}, plaintext);
    OPENSSL_cleanse(plaintext.data(), plaintext.size());
    share_key_with_[peer] = *key;
    OPENSSL_cleanse(key->data(), key->size());
    if (!sealed.ok()) return Refuse(sealed.status());
    out.envelopes.push_back({.peer = peer, .envelope = std::move(*sealed)});
    ++i;
  }
  stage_ = Stage::kMask;
  return out;
}

Result<MaskedInput> SecAggClient::MaskInput(const ShareInbox& inbox, std::span<const uint32_t> quantized) {
  ESTUARY_RETURN_IF_ERROR(Expect(Stage::kMask, "masked input"));
  if (quantized.size() != config_.dimension) {
    return Refuse(InvalidArgument("secagg site {}: round {}: masked input: input of {} elements, expected {}", site_,
                                  config_.round, quantized.size(), config_.dimension));
  }
  ESTUARY_RETURN_IF_ERROR(BeginMaskedInput(inbox));
  MaskedInput out{.site = site_, .values = std::vector<uint32_t>(quantized.begin(), quantized.end())};
  ESTUARY_RETURN_IF_ERROR(MaskChunk(0, out.values));
  ESTUARY_RETURN_IF_ERROR(FinishMaskedInput());
  return out;
}

Status SecAggClient::BeginMaskedInput(const ShareInbox& inbox) {
  ESTUARY_RETURN_IF_ERROR(Expect(Stage::kMask, "masked input"));
  const std::string where = fmt::format("secagg site {}: round {}: masked input", site_, config_.round);
  for (const SealedShare& sealed : inbox.envelopes) {
    auto peer = peers_.find(sealed.peer);
    if (peer == peers_.end()) {
      return Refuse(ProtocolError("{}: envelope from site {}, not a neighbour that advertised keys", where,
                                  sealed.peer));
    }
    if (held_.contains(sealed.peer)) {
      return Refuse(ProtocolError("{}: two envelopes from site {}", where, sealed.peer));
    }
    if (sealed.envelope.size() != kShareEnvelopeBytes) {
      return Refuse(ProtocolError("{}: envelope from site {} of {} bytes, expected {}", where, sealed.peer,
                                  sealed.envelope.size(), kShareEnvelopeBytes));
    }
    const auto agreed = share_key_with_.find(sealed.peer);
    Key32 key;
    if (agreed != share_key_with_.end()) {
      key = agreed->second;
    } else {
      ESTUARY_ASSIGN_OR_RETURN(key, AgreeRoundKey(share_keys_.private_key, peer->second.share_public_key,
                                                  kShareKeyLabel, config_.round));
    }
    auto plaintext = Open(key, {.sender = sealed.peer, .receiver = site_, .round = config_.round}, sealed.envelope);
    OPENSSL_cleanse(key.data(), key.size());
    if (!plaintext.ok()) {
      return Refuse(ProtocolError("{}: envelope from site {} refused: {}", where, sealed.peer,
                                  plaintext.status().message()));
    }
    HeldShares& held = held_[sealed.peer];
    std::copy_n(plaintext->begin(), kShareValueBytes, held.seed.begin());
    std::copy_n(plaintext->begin() + kShareValueBytes, kShareValueBytes, held.key.begin());
    OPENSSL_cleanse(plaintext->data(), plaintext->size());
  }
  for (auto& [peer, key] : share_key_with_) OPENSSL_cleanse(key.data(), key.size());
  share_key_with_.clear();
  // The senders hold this site's shares too (the graph is symmetric): fewer
  // than t of them and b_u could never be reconstructed.
  if (int(held_.size()) < config_.threshold) {
    return Refuse(FailedPrecondition("{}: {} of {} neighbours shared keys, fewer than the threshold {}", where,
                                     held_.size(), config_.degree, config_.threshold));
  }
  std::vector<PeerPublicKey> survivors;
  for (const auto& [peer, held] : held_) survivors.push_back({peer, peers_.at(peer).mask_public_key});
  auto pairwise = PairwiseMaskKeys(site_, mask_keys_.private_key, survivors, config_.round);
  if (!pairwise.ok()) return Refuse(pairwise.status());
  pairwise_ = std::move(*pairwise);
  masked_ = 0;
  stage_ = Stage::kMasking;
  return Status::Ok();
}

Status SecAggClient::MaskChunk(uint64_t offset, std::span<uint32_t> values) {
  ESTUARY_RETURN_IF_ERROR(Expect(Stage::kMasking, "masking a chunk"));
  const std::string where = fmt::format("secagg site {}: round {}: masked input", site_, config_.round);
  if (offset != masked_ || values.size() > config_.dimension - masked_) {
    return Refuse(InvalidArgument("{}: a chunk of {} elements at element {}, expected the next of {} at {}", where,
                                  values.size(), offset, config_.dimension, masked_));
  }
  const uint32_t ring = RingMask(config_.bits);
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i] > ring) {
      return Refuse(InvalidArgument("{}: input element {} = {} is outside the {}-bit ring", where, offset + i,
                                    values[i], config_.bits));
    }
  }
  const Status masked = secagg::MaskChunk(site_, self_seed_, pairwise_, config_.bits, offset, values);
  if (!masked.ok()) return Refuse(masked);
  masked_ += values.size();
  return Status::Ok();
}

Status SecAggClient::FinishMaskedInput() {
  ESTUARY_RETURN_IF_ERROR(Expect(Stage::kMasking, "finishing the masked input"));
  if (masked_ != config_.dimension) {
    return Refuse(InvalidArgument("secagg site {}: round {}: masked input: {} of {} elements masked", site_,
                                  config_.round, masked_, config_.dimension));
  }
  for (PairwiseKey& pair : pairwise_) OPENSSL_cleanse(pair.key.data(), pair.key.size());
  pairwise_.clear();
  stage_ = Stage::kConsistency;
  return Status::Ok();
}

std::string UnauthenticatedSignature(std::string_view message) {
  std::string digest(32, '\0');
  unsigned int length = 0;
  // SHA-256 refusing is OpenSSL broken: an empty digest then matches nothing.
  if (EVP_Digest(message.data(), message.size(), reinterpret_cast<unsigned char*>(digest.data()), &length,
                 EVP_sha256(), nullptr) != 1 || length != digest.size()) {
    return {};
  }
  return digest;
}

Status UnauthenticatedSurvivorsCheck(uint32_t signer, const ConfirmedSurvivors& confirmed,
                                     std::string_view signature) {
  if (!signature.empty() && signature == confirmed.sha256) return Status::Ok();
  return InvalidArgument("site {} confirmed another survivor set", signer);
}

Result<std::string> SecAggClient::ConfirmSurvivors(const SurvivorSet& survivors) {
  ESTUARY_RETURN_IF_ERROR(Expect(Stage::kConsistency, "consistency check"));
  const std::string where = fmt::format("secagg site {}: round {}: consistency check", site_, config_.round);
  // A bitmap by id, not a tree: a site's whole check is O(n), and an
  // in-process run of n sites O(n^2) with a small constant.
  std::vector<bool> survived(config_.sites, false);
  for (uint32_t u : survivors.survived) {
    if (u >= config_.sites) {
      return Refuse(ProtocolError("{}: survived site {} is not among the {} sites", where, u, config_.sites));
    }
    if (survived[u]) return Refuse(ProtocolError("{}: survived site {} listed twice", where, u));
    survived[u] = true;
  }
  if (!survived[site_]) {
    return Refuse(ProtocolError("{}: this site sent its masked input but is not listed as survived", where));
  }
  if (int(survivors.survived.size()) < config_.threshold) {
    return Refuse(FailedPrecondition("{}: {} sites survived, fewer than the threshold {}", where,
                                     survivors.survived.size(), config_.threshold));
  }
  std::vector<uint32_t> ascending;
  ascending.reserve(survivors.survived.size());
  for (uint32_t u = 0; u < config_.sites; ++u) {
    if (survived[u]) ascending.push_back(u);
  }
  survivors_ = std::move(survived);
  confirmed_ = SurvivorsToSign(config_, ascending);
  confirmed_sha256_ = UnauthenticatedSignature(confirmed_);
  stage_ = Stage::kUnmask;
  return confirmed_;
}

Result<UnmaskResponse> SecAggClient::Unmask(const UnmaskRequest& request, const SignatureCheck& check) {
  ESTUARY_RETURN_IF_ERROR(Expect(Stage::kUnmask, "unmasking"));
  stage_ = Stage::kDone;  // one answer, whatever it is
  const std::string where = fmt::format("secagg site {}: round {}: unmasking", site_, config_.round);
  if (confirmed_sha256_.size() != 32) return Internal("{}: the survivor set's digest is missing", where);
  // The consistency check: t neighbours in U3 confirmed the same U3 as this
  // site — the bytes it signed, the only set it will unmask by.
  const ConfirmedSurvivors confirmed{.message = confirmed_, .sha256 = confirmed_sha256_};
  std::set<uint32_t> signers;
  for (const SurvivorsSigned& signature : request.signatures) {
    const uint32_t v = signature.site;
    if (v >= config_.sites || v == site_ || !neighbours_.Contains(v) || !survivors_[v]) {
      return ProtocolError("{}: a signature of site {}, not a neighbour in the survivor set", where, v);
    }
    if (!signers.insert(v).second) return ProtocolError("{}: two signatures of site {}", where, v);
    if (Status valid = check(v, confirmed, signature.signature); !valid.ok()) {
      return ProtocolError("{}: site {}'s signature on the survivor set refused: {}", where, v, valid.message());
    }
  }
  if (int(signers.size()) < config_.threshold) {
    return FailedPrecondition("{}: {} of its neighbours signed the survivor set, fewer than the threshold {}: refusing "
                              "to reveal its shares",
                              where, signers.size(), config_.threshold);
  }
  // One secret per peer, chosen by the signed U3 alone: never both.
  UnmaskResponse out{.site = site_};
  for (const auto& [peer, held] : held_) {
    if (survivors_[peer]) out.seed_shares.push_back({.peer = peer, .y = held.seed});
    else out.key_shares.push_back({.peer = peer, .y = held.key});
  }
  return out;
}

}  // namespace estuary::secagg
