// A site's side of one SecAgg+ round over its connection to the server
// (docs/SECAGG.md): the protocol's SecAggClient (secagg/client.h) and what the
// agent hands it — the round's setup from RoundStart, the server's stage
// messages, and the trained update — turned into the site's answers.
//
//   auto site = SecAggSite::Start(round_start);   // its SecAggAdvertise to send
//   site->OnKeys(keys)                            // -> SecAggShares
//   site->OnInbox(inbox)                          // kept until the update is trained
//   site->MaskedInput(update, chunk_elements)     // -> chunks, then SecAggMaskedDone
//   site->OnUnmask(request)                       // -> SecAggUnmaskResponse
//
// The update is clipped to the setup's C, weighted by its w, quantised by
// stochastic rounding (uniforms from RAND_bytes) into Z/2^b with its s and
// masked (secagg/quantize.h, secagg/masking.h). Any refusal ends the site's
// part in the round. Nothing here is thread-safe; the stages come in order,
// so the agent may run MaskedInput off its I/O thread.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <vector>

#include "base/status.h"
#include "estuary.pb.h"
#include "secagg/client.h"

namespace estuary::client {

class SecAggSite {
 public:
  // The setup of `start` (which has one), and the site's first message.
  static Result<std::unique_ptr<SecAggSite>> Start(const v1::RoundStart& start, v1::Envelope* advertise);

  uint64_t round() const { return round_; }
  uint32_t site() const { return client_.site(); }

  Result<v1::Envelope> OnKeys(const v1::SecAggKeys& keys);
  Status OnInbox(const v1::SecAggInbox& inbox);
  bool has_inbox() const { return inbox_.has_value(); }
  // The masked input of `update` (the round's full delta) as frames of at
  // most `chunk_elements` elements, then SecAggMaskedDone carrying
  // `num_examples`, `train_loss` and `train_seconds`. With `keep_dir`, the
  // quantised input before masking is also written to
  // keep_dir/round-R.site-U.w-W.u32 (little-endian ring elements): the site's
  // own record of what it contributed.
  Result<std::vector<v1::Envelope>> MaskedInput(std::span<const float> update, uint64_t chunk_elements,
                                                uint64_t num_examples, double train_loss, double train_seconds,
                                                const std::filesystem::path& keep_dir);
  Result<v1::Envelope> OnUnmask(const v1::SecAggUnmask& request);
  // Updates whose norm exceeded the clip this round (0 or 1).
  bool clipped() const { return clipped_; }

 private:
  SecAggSite(secagg::SecAggClient client, uint64_t round, const v1::SecAggSetup& setup)
      : client_(std::move(client)), round_(round), setup_(setup) {}

  secagg::SecAggClient client_;
  uint64_t round_;
  v1::SecAggSetup setup_;
  std::optional<secagg::ShareInbox> inbox_;
  bool clipped_ = false;
};

}  // namespace estuary::client
