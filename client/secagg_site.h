// A site's side of one SecAgg+ round over its connection to the server
// (docs/SECAGG.md): the protocol's SecAggClient (secagg/client.h) and what the
// agent hands it — the round's setup from RoundStart, the server's stage
// messages, and the trained update — turned into the site's answers.
//
//   auto site = SecAggSite::Start(round_start, identity);   // its SecAggAdvertise to send
//   site->OnKeys(keys)                            // -> SecAggShares
//   site->OnInbox(inbox)                          // kept until the update is trained
//   site->MaskedInput(update, chunk_elements)     // -> chunks, then SecAggMaskedDone
//   site->OnSurvivors(survivors)                  // -> SecAggSurvivorsSigned
//   site->OnUnmask(request)                       // -> SecAggUnmaskResponse
//
// The update — a full delta, or a lora site's movement of the adapter's
// factors (SubtractGlobalTensors) — is clipped to the setup's C, weighted by its w, quantised by
// stochastic rounding (uniforms from RAND_bytes) into Z/2^b with its s and
// masked (secagg/quantize.h, secagg/masking.h). The site signs the keys it
// advertises with its certificate's key, and takes its neighbours' keys only
// signed by distinct site certificates of the federation, none its own: a
// server relaying keys of its own in a neighbour's place is refused (the key
// substitution of docs/SECAGG.md's threat model). It signs the survivor set
// U3 it is told with the same key, and reveals its shares only when the
// unmasking request carries valid signatures over the same U3 from at least t
// of its neighbours in U3, each verified under the certificate that signed
// that neighbour's keys (the consistency check: a server telling different
// sites different survivor sets is refused). Any refusal ends the site's
// part in the round. Nothing here is thread-safe; the stages come in order,
// so the agent may run MaskedInput off its I/O thread.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "base/manifest.h"
#include "base/status.h"
#include "crypto/site_signature.h"
#include "estuary.pb.h"
#include "secagg/client.h"

namespace estuary::client {

// Who a site is to its neighbours: the key it signs with, and the trust it
// checks their signatures against. A connected site's come from its TLS
// connection (FromConnection), a scripted one's from the same files.
struct SecAggIdentity {
  crypto::SiteSigner signer;
  crypto::SiteVerifier verifier;

  static Result<SecAggIdentity> FromConnection(SSL* ssl);
  static Result<SecAggIdentity> FromFiles(const crypto::TlsFiles& files);
};

// A lora site's movement, what secure aggregation sums for it (naive and
// frozen-a merges): `values` (laid out by `upload`) less the tensors of the
// same names in the global model, in place. Fails, naming the tensor, when
// the global model lacks one or its size differs.
Status SubtractGlobalTensors(const Manifest& upload, const Manifest& global_manifest, std::span<const float> global,
                             std::span<float> values);

class SecAggSite {
 public:
  // The setup of `start` (which has one), and the site's first message.
  static Result<std::unique_ptr<SecAggSite>> Start(const v1::RoundStart& start, const SecAggIdentity& identity,
                                                   v1::Envelope* advertise);

  uint64_t round() const { return round_; }
  uint32_t site() const { return client_.site(); }

  Result<v1::Envelope> OnKeys(const v1::SecAggKeys& keys);
  Status OnInbox(const v1::SecAggInbox& inbox);
  bool has_inbox() const { return inbox_.has_value(); }
  // The masked input of `update` (the round's full delta, or a lora site's
  // movement: the setup's dimension either way) as frames of at
  // most `chunk_elements` elements, then SecAggMaskedDone carrying
  // `num_examples`, `train_loss` and `train_seconds`. With `keep_dir`, the
  // quantised input before masking is also written to
  // keep_dir/round-R.site-U.w-W.u32 (little-endian ring elements): the site's
  // own record of what it contributed. Under distributed DP (the setup's
  // dp_share_variance V > 0) the site adds its share N_Z(0, V), drawn with a
  // key from RAND_bytes, to the quantised input before masking; what it keeps
  // is then the noised input, and the share alone (mod 2^b) beside it as
  // round-R.site-U.w-W.noise.u32.
  // Every frame at once: the opening chunk, the chunks, SecAggMaskedDone
  // (BeginMaskedInput and NextMaskedFrame to the end).
  Result<std::vector<v1::Envelope>> MaskedInput(std::span<const float> update, uint64_t chunk_elements,
                                                uint64_t num_examples, double train_loss, double train_seconds,
                                                const std::filesystem::path& keep_dir);
  // The same as it streams, so that the site holds one chunk of its masked
  // input at a time, never all of it: BeginMaskedInput takes the norm of
  // `update` (one pass; it must outlive the stream), draws the rounding seed
  // and returns the opening chunk (secagg::MaskedBeginMessage); each NextMaskedFrame clips, weights,
  // quantises and masks the next `chunk_elements` elements and returns their
  // SecAggMaskedChunk, and after the last, SecAggMaskedDone. With
  // `keep_dir`, the quantised input is also gathered, and written at the end.
  Result<v1::Envelope> BeginMaskedInput(std::span<const float> update, const std::filesystem::path& keep_dir);
  Result<v1::Envelope> NextMaskedFrame(uint64_t chunk_elements, uint64_t num_examples, double train_loss,
                                       double train_seconds);
  // SecAggMaskedDone has been returned.
  bool masked_input_sent() const { return masked_done_; }
  Result<v1::Envelope> OnSurvivors(const v1::SecAggSurvivors& survivors);
  Result<v1::Envelope> OnUnmask(const v1::SecAggUnmask& request);
  // Updates whose norm exceeded the clip this round (0 or 1).
  bool clipped() const { return clipped_; }

 private:
  SecAggSite(secagg::SecAggClient client, const secagg::ProtocolConfig& config, const v1::SecAggSetup& setup,
             const SecAggIdentity& identity)
      : client_(std::move(client)), round_(config.round), config_(config), setup_(setup), identity_(identity) {}
  // Every neighbour's keys signed by a distinct site of the federation, not this one.
  Status CheckSigned(const v1::SecAggKeys& keys, const secagg::KeysBroadcast& broadcast) const;

  secagg::SecAggClient client_;
  uint64_t round_;
  secagg::ProtocolConfig config_;
  v1::SecAggSetup setup_;
  SecAggIdentity identity_;
  std::map<uint32_t, std::string> certificates_;  // DER, by neighbour: what signed the keys it took
  std::optional<secagg::ShareInbox> inbox_;
  bool clipped_ = false;
  // The masked input being streamed.
  std::span<const float> update_;
  double clip_factor_ = 1;
  secagg::Key32 rounding_{};
  uint64_t masked_next_ = 0;  // elements
  bool masked_done_ = false;
  std::filesystem::path keep_dir_;
  std::vector<uint32_t> kept_;  // with keep_dir_: the quantised input so far
  std::vector<uint32_t> kept_noise_;  // with keep_dir_ under distributed DP: the noise shares so far
};

}  // namespace estuary::client
