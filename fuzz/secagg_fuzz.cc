// SecAgg+'s messages as a hostile peer sends them: secagg/wire.h's checks,
// then the state machines of secagg/client.h and secagg/server.h. The input is
// an Envelope. Five honest sites and the server run the protocol, and the
// decoded message takes the place of one honest message:
// - a site's (advertise, shares, masked chunk, signed survivor set, unmask
//   response) is site 4's, at its stage, to the server; the real site 4 then
//   says nothing more;
// - the server's (keys, inbox, survivor set, unmask request) is what site 0
//   receives at its stage; a RoundStart's SecAggSetup is what a site builds its round from.
// Whatever it is, every refusal is one line, a site never reveals both shares
// of one peer nor any share without t distinct neighbours' signatures over
// the survivor set it confirmed, nor a share that set does not imply (b_v of a
// v outside it, sk_v of a v in it), and a protocol that completes yields
// exactly the sum of the included sites' inputs.
#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "estuary.pb.h"
#include "fuzz/fuzz_util.h"
#include "fuzz/quiet_protobuf.h"
#include "secagg/client.h"
#include "secagg/masking.h"
#include "secagg/server.h"
#include "secagg/wire.h"

namespace {

using namespace estuary;
using namespace estuary::secagg;

constexpr uint32_t kSites = 5;
constexpr uint32_t kAdversary = 4;  // the site whose messages the input replaces
constexpr uint32_t kVictim = 0;     // the site that receives the server's
constexpr uint64_t kDimension = 6;
constexpr int kBits = 16;

ProtocolConfig Config() {
  Key32 seed{};
  for (size_t i = 0; i < seed.size(); ++i) seed[i] = uint8_t(i * 7 + 1);
  return {.round = 7, .sites = kSites, .degree = 4, .threshold = 3, .bits = kBits, .dimension = kDimension,
          .graph_seed = seed};
}

std::vector<uint32_t> InputOf(uint32_t u) {
  std::vector<uint32_t> input(kDimension);
  for (uint64_t i = 0; i < kDimension; ++i) input[i] = uint32_t((u * 7919 + i * 104729 + 1) % (1u << kBits));
  return input;
}

// A message the input replaced: refused in one line, or accepted.
template <typename T>
std::optional<T> Accepted(Result<T> result) {
  if (!result.ok()) {
    fuzz::CheckError(result.status());
    return std::nullopt;
  }
  return std::move(*result);
}

bool Accepted(const Status& status) {
  if (!status.ok()) fuzz::CheckError(status);
  return status.ok();
}

void CheckNeverBothShares(const UnmaskResponse& response) {
  for (const PeerShare& seed : response.seed_shares) {
    for (const PeerShare& key : response.key_shares) {
      FUZZ_CHECK(seed.peer != key.peer, "site %u revealed both secrets of site %u", response.site, seed.peer);
    }
  }
}

// A site's setup as a server sent it: a site must be able to afford the round it accepts.
void SetupFromServer(const v1::RoundStart& start) {
  if (!start.has_secagg()) return;
  auto config = Accepted(ConfigFromProto(start.secagg(), start.round()));
  if (!config) return;
  FUZZ_CHECK(config->sites >= 2 && uint64_t(config->sites) * uint64_t(config->degree) <= (uint64_t{1} << 24));
  auto client = Accepted(SecAggClient::Create(*config, start.secagg().site()));
  if (client) Accepted(client->Advertise());
}

void RunProtocol(const v1::Envelope& hostile) {
  const ProtocolConfig config = Config();
  auto server = SecAggServer::Create(config);
  FUZZ_CHECK(server.ok());
  std::map<uint32_t, SecAggClient> clients;
  for (uint32_t u = 0; u < kSites; ++u) {
    auto client = SecAggClient::Create(config, u);
    FUZZ_CHECK(client.ok());
    clients.emplace(u, std::move(*client));
  }
  const auto kind = hostile.body_case();
  std::set<uint32_t> silent;  // sites that stopped: the adversary's twin, or a site that refused
  bool unknown_input = false;  // the adversary's masked input is in the sum

  // A site's honest step: refused (one line) silences it.
  auto honest = [&](uint32_t u, auto result, auto&& send) {
    if (!result.ok()) {
      fuzz::CheckError(result.status());
      silent.insert(u);
      return;
    }
    if (!Accepted(server->Receive(*result))) silent.insert(u);
    send(*result);
  };
  auto ignore = [](const auto&) {};

  for (uint32_t u = 0; u < kSites; ++u) {
    if (u == kAdversary && kind == v1::Envelope::kSecaggAdvertise) {
      if (auto advertise = Accepted(FromProto(hostile.secagg_advertise(), u))) Accepted(server->Receive(*advertise));
      silent.insert(u);
      continue;
    }
    honest(u, clients.at(u).Advertise(), ignore);
  }
  auto broadcasts = Accepted(server->CloseAdvertise());
  if (!broadcasts) return;

  for (auto& [u, broadcast] : *broadcasts) {
    if (silent.contains(u)) continue;
    if (u == kAdversary && kind == v1::Envelope::kSecaggShares) {
      if (auto shares = Accepted(FromProto(hostile.secagg_shares(), u))) Accepted(server->Receive(*shares));
      silent.insert(u);
      continue;
    }
    if (u == kVictim && kind == v1::Envelope::kSecaggKeys) {
      auto keys = Accepted(FromProto(hostile.secagg_keys()));
      if (!keys) return;
      broadcast = *keys;
    }
    honest(u, clients.at(u).Share(broadcast), ignore);
  }
  auto inboxes = Accepted(server->CloseShareKeys());
  if (!inboxes) return;

  std::vector<uint32_t> expected(kDimension, 0);
  std::set<uint32_t> sent_input;
  for (auto& [u, inbox] : *inboxes) {
    if (u == kAdversary && kind == v1::Envelope::kSecaggMaskedChunk) {
      std::vector<uint32_t> values;
      if (Accepted(AppendMaskedChunk(hostile.secagg_masked_chunk(), kDimension, values))) {
        FUZZ_CHECK(values.size() <= kDimension);
        if (values.size() == kDimension && Accepted(server->Receive(MaskedInput{u, values}))) {
          unknown_input = true;
          sent_input.insert(u);
        }
      }
      silent.insert(u);
      continue;
    }
    if (silent.contains(u)) continue;
    if (u == kVictim && kind == v1::Envelope::kSecaggInbox) {
      auto hostile_inbox = Accepted(FromProto(hostile.secagg_inbox()));
      if (!hostile_inbox) return;
      inbox = *hostile_inbox;
    }
    const uint32_t site = u;  // clang 14 cannot capture a structured binding
    const std::vector<uint32_t> input = InputOf(site);
    honest(site, clients.at(site).MaskInput(inbox, input), [&](const MaskedInput&) {
      if (silent.contains(site)) return;
      FUZZ_CHECK(AddInto(expected, input, kBits).ok());
      sent_input.insert(site);
    });
  }
  auto survivors = Accepted(server->CloseMaskedInput());
  if (!survivors) return;

  // The consistency check, unsigned as in every in-process run: a site's
  // "signature" is the digest of the bytes it confirmed (secagg/client.h).
  std::map<uint32_t, std::string> confirmed;
  std::map<uint32_t, std::set<uint32_t>> confirmed_set;  // U3 as each site signed it
  for (uint32_t u : survivors->survived) {
    if (u == kAdversary && kind == v1::Envelope::kSecaggSurvivorsSigned) {
      if (auto signed_survivors = Accepted(FromProto(hostile.secagg_survivors_signed(), u))) {
        Accepted(server->Receive(*signed_survivors));
      }
      continue;
    }
    if (silent.contains(u)) continue;
    SurvivorSet told = *survivors;
    if (u == kVictim && kind == v1::Envelope::kSecaggSurvivors) {
      auto hostile_set = FromProto(hostile.secagg_survivors(), Config().sites);
      if (!hostile_set.ok()) {
        fuzz::CheckError(hostile_set.status());
        silent.insert(u);
        continue;
      }
      told = *hostile_set;
    }
    auto message = clients.at(u).ConfirmSurvivors(told);
    if (!message.ok()) {
      fuzz::CheckError(message.status());
      silent.insert(u);
      continue;
    }
    confirmed[u] = *message;
    confirmed_set[u] = std::set<uint32_t>(told.survived.begin(), told.survived.end());
    if (!Accepted(server->Receive(SurvivorsSigned{u, UnauthenticatedSignature(*message)}))) silent.insert(u);
  }
  auto requests = Accepted(server->CloseConsistency());
  if (!requests) return;

  for (const auto& [u, request] : *requests) {
    if (u == kAdversary && kind == v1::Envelope::kSecaggUnmaskResponse) {
      if (auto response = Accepted(FromProto(hostile.secagg_unmask_response(), u))) Accepted(server->Receive(*response));
      continue;
    }
    if (silent.contains(u)) continue;
    UnmaskRequest asked = request;
    if (u == kVictim && kind == v1::Envelope::kSecaggUnmask) {
      auto hostile_request = Accepted(FromProto(hostile.secagg_unmask()));
      if (!hostile_request) return;
      asked = *hostile_request;
    }
    const uint32_t site = u;  // clang 14 cannot capture a structured binding
    honest(site, clients.at(site).Unmask(asked, UnauthenticatedSurvivorsCheck), [&](const UnmaskResponse& response) {
      CheckNeverBothShares(response);
      // It revealed only on t distinct neighbours' signatures over the set it
      // confirmed, and only what that set implies: b_v of a v in it, sk_v of
      // a v outside it.
      std::set<uint32_t> attested;
      for (const SurvivorsSigned& s : asked.signatures) {
        if (s.signature == UnauthenticatedSignature(confirmed.at(site))) attested.insert(s.site);
      }
      FUZZ_CHECK(int(attested.size()) >= Config().threshold, "site %u revealed its shares on %zu signatures", site,
                 attested.size());
      const std::set<uint32_t>& signed_set = confirmed_set.at(site);
      for (const PeerShare& seed : response.seed_shares) {
        FUZZ_CHECK(signed_set.contains(seed.peer), "site %u revealed the self-mask share of site %u, outside the set "
                   "it signed", site, seed.peer);
      }
      for (const PeerShare& key : response.key_shares) {
        FUZZ_CHECK(!signed_set.contains(key.peer), "site %u revealed the key share of site %u, in the set it signed",
                   site, key.peer);
      }
    });
  }
  auto output = Accepted(server->Finish());
  if (!output) return;
  FUZZ_CHECK(std::set<uint32_t>(output->included.begin(), output->included.end()) == sent_input,
             "the output includes %zu sites, %zu sent their input", output->included.size(), sent_input.size());
  if (!unknown_input) FUZZ_CHECK(output->sum == expected, "the unmasked sum is not the inputs' sum");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  v1::Envelope hostile;
  if (!hostile.ParseFromArray(data, int(size))) return 0;
  if (hostile.body_case() == v1::Envelope::kRoundStart) {
    SetupFromServer(hostile.round_start());
    return 0;
  }
  RunProtocol(hostile);
  return 0;
}
