// bench/secagg: the per-site and per-server costs of SecAgg+ masking
// (secagg/masking.h) on a 1M-element update, for federations of n sites whose
// neighbour degree k = DefaultDegree(n) grows as log n. In the same process,
// two baselines over the same vector: one AES-256-CTR mask pass (ApplyMask with one
// seed: the unit a mask costs) and a plain add into a sum (what aggregating
// without masks costs). Prints, per n:
//   site:   key agreement with k neighbours, sharing two secrets k ways, and
//           masking the update (self mask + k pairwise masks), ms and MB/s;
//   server: per dropped site, reconstructing its key from t shares and
//           cancelling its k pairwise masks; per surviving site,
//           reconstructing its seed and removing its self mask.
// Then the whole protocol (secagg/client.h, secagg/server.h) in one process
// for federations of --protocol-sites sites and an update of
// --protocol-elements (the MNIST MLP's 199,210 by default), one site in 20
// dropping after sharing its keys: bytes per site, each site's time for its
// four rounds, the server's, against the plain sum of the same float updates
// (what the server does without secure aggregation) and the 4-byte-a-weight
// upload.
//   build/bench/secagg [--elements 1000000] [--sites 100,1000,10000] [--steps 5] [--warmup 1]
//                      [--protocol-sites 10,50,100] [--protocol-elements 199210]
#include <fmt/format.h>

#include <vector>

#include "bench/harness.h"
#include "secagg/client.h"
#include "secagg/key_agreement.h"
#include "secagg/masking.h"
#include "secagg/neighbours.h"
#include "secagg/prg.h"
#include "secagg/server.h"
#include "secagg/shamir.h"

namespace {

using namespace estuary;
using namespace estuary::secagg;

constexpr int kBits = 32;
constexpr uint64_t kRound = 1;

struct Neighbourhood {
  X25519KeyPair site;
  Key32 self_seed{};
  std::vector<PeerPublicKey> peers;  // ids 1..k; the site is 0, so it adds every pairwise mask
};

Result<Neighbourhood> MakeNeighbourhood(int degree) {
  Neighbourhood hood;
  ESTUARY_ASSIGN_OR_RETURN(hood.site, GenerateX25519KeyPair());
  ESTUARY_ASSIGN_OR_RETURN(hood.self_seed, RandomKey());
  for (int v = 1; v <= degree; ++v) {
    ESTUARY_ASSIGN_OR_RETURN(X25519KeyPair peer, GenerateX25519KeyPair());
    hood.peers.push_back({static_cast<uint32_t>(v), peer.public_key});
  }
  return hood;
}

std::string Rate(size_t bytes, double seconds) { return fmt::format("{:.0f} MB/s", double(bytes) / seconds / 1e6); }

struct ProtocolCost {
  double site_seconds = 0;    // mean over the sites, all four rounds
  double server_seconds = 0;  // receiving, relaying, unmasking
  uint64_t site_bytes = 0;    // mean over the sites that completed, sent + received
};

// One run of the protocol over n sites, site u dropping after share keys
// when u % 20 == 7.
Result<ProtocolCost> RunProtocol(uint32_t n, const std::vector<uint32_t>& input) {
  ESTUARY_ASSIGN_OR_RETURN(Key32 graph_seed, RandomKey());
  const ProtocolConfig config = DefaultProtocolConfig(n, input.size(), kRound, graph_seed);
  auto dropped = [](uint32_t u) { return u % 20 == 7; };
  ProtocolCost cost;
  double site_seconds = 0;
  std::vector<uint64_t> bytes(n, 0);
  double server_seconds = 0;
  auto on_server = [&](auto&& step) {
    bench::Stopwatch clock;
    auto result = step();
    server_seconds += clock.Seconds();
    return result;
  };
  ESTUARY_ASSIGN_OR_RETURN(SecAggServer server, SecAggServer::Create(config));
  std::vector<SecAggClient> clients;
  for (uint32_t u = 0; u < n; ++u) {
    bench::Stopwatch clock;
    ESTUARY_ASSIGN_OR_RETURN(SecAggClient client, SecAggClient::Create(config, u));
    ESTUARY_ASSIGN_OR_RETURN(AdvertiseKeys keys, client.Advertise());
    site_seconds += clock.Seconds();
    bytes[u] += WireBytes(keys);
    ESTUARY_RETURN_IF_ERROR(on_server([&] { return server.Receive(keys); }));
    clients.push_back(std::move(client));
  }
  ESTUARY_ASSIGN_OR_RETURN(auto broadcasts, on_server([&] { return server.CloseAdvertise(); }));
  for (auto& [u, broadcast] : broadcasts) {
    bench::Stopwatch clock;
    ESTUARY_ASSIGN_OR_RETURN(ShareKeys shares, clients[u].Share(broadcast));
    site_seconds += clock.Seconds();
    bytes[u] += WireBytes(broadcast) + WireBytes(shares);
    ESTUARY_RETURN_IF_ERROR(on_server([&] { return server.Receive(shares); }));
  }
  ESTUARY_ASSIGN_OR_RETURN(auto inboxes, on_server([&] { return server.CloseShareKeys(); }));
  for (auto& [u, inbox] : inboxes) {
    bytes[u] += WireBytes(inbox);
    if (dropped(u)) continue;
    bench::Stopwatch clock;
    ESTUARY_ASSIGN_OR_RETURN(MaskedInput masked, clients[u].MaskInput(inbox, input));
    site_seconds += clock.Seconds();
    bytes[u] += WireBytes(masked);
    ESTUARY_RETURN_IF_ERROR(on_server([&] { return server.Receive(masked); }));
  }
  ESTUARY_ASSIGN_OR_RETURN(SurvivorSet survivors, on_server([&] { return server.CloseMaskedInput(); }));
  for (uint32_t u : survivors.survived) {
    bench::Stopwatch clock;
    ESTUARY_ASSIGN_OR_RETURN(std::string confirmed, clients[u].ConfirmSurvivors(survivors));
    site_seconds += clock.Seconds();
    // Unsigned, in one process (32 bytes; over the network an ECDSA signature of 70 to 72).
    const SurvivorsSigned signed_survivors{.site = u, .signature = UnauthenticatedSignature(confirmed)};
    bytes[u] += WireBytes(survivors, n) + WireBytes(signed_survivors);
    ESTUARY_RETURN_IF_ERROR(on_server([&] { return server.Receive(signed_survivors); }));
  }
  ESTUARY_ASSIGN_OR_RETURN(auto requests, on_server([&] { return server.CloseConsistency(); }));
  for (const auto& [u, request] : requests) {
    bench::Stopwatch clock;
    ESTUARY_ASSIGN_OR_RETURN(UnmaskResponse response, clients[u].Unmask(request, UnauthenticatedSurvivorsCheck));
    site_seconds += clock.Seconds();
    bytes[u] += WireBytes(request) + WireBytes(response);
    ESTUARY_RETURN_IF_ERROR(on_server([&] { return server.Receive(response); }));
  }
  ESTUARY_ASSIGN_OR_RETURN(AggregateOutput output, on_server([&] { return server.Finish(); }));
  if (output.dropped.empty() && n > 7) return Internal("bench: no site dropped");
  cost.site_seconds = site_seconds / n;
  cost.server_seconds = server_seconds;
  uint64_t total = 0;
  for (uint32_t u : output.included) total += bytes[u];
  cost.site_bytes = total / output.included.size();
  return cost;
}

}  // namespace

int main(int argc, char** argv) {
  bench::Bench bench("secagg", "SecAgg+ masking and unmasking costs against one mask pass (AES-256-CTR) and a plain add");
  int elements = 1'000'000;
  std::vector<int> site_counts = {100, 1000, 10000};
  bench::Repetitions runs{.warmup = 1, .timed = 5};
  bench.app().add_option("--elements", elements, "elements of the update (uint32 ring elements)")->check(bench::AtLeast(1));
  bench.app().add_option("--sites", site_counts, "federation sizes n (k = DefaultDegree(n))")->delimiter(',');
  std::vector<int> protocol_sites = {10, 50, 100};
  int protocol_elements = 199'210;
  bench.app().add_option("--protocol-sites", protocol_sites, "the whole protocol: sites n")->delimiter(',');
  bench.app().add_option("--protocol-elements", protocol_elements, "the whole protocol: update elements")
      ->check(bench::AtLeast(1));
  bench.AddRepetitions(runs);
  if (auto code = bench.Parse(argc, argv)) return *code;
  const size_t n_elements = static_cast<size_t>(elements);
  const size_t bytes = n_elements * sizeof(uint32_t);

  std::vector<uint32_t> update(n_elements), work(n_elements), sum(n_elements, 0);
  for (size_t i = 0; i < n_elements; ++i) update[i] = static_cast<uint32_t>(i * 2654435761u);
  auto seed = RandomKey();
  if (!seed.ok()) return bench.Fail(seed.status());

  // Baselines: a plain add of the update into a sum, and one mask pass.
  auto plain = bench::Repeat(runs, [&] { return AddInto(sum, update, kBits); });
  if (!plain.ok()) return bench.Fail(plain.status());
  auto one_pass = bench::Repeat(runs, [&] {
    work = update;
    return ApplyMask(*seed, 0, kBits, MaskSign::kAdd, work);
  });
  if (!one_pass.ok()) return bench.Fail(one_pass.status());
  fmt::print("update: {} elements ({:.1f} MB), {}-bit ring, median of {} runs\n", n_elements, bytes / 1e6, kBits,
             runs.timed);
  fmt::print("baseline plain add:         {:>8.2f} ms  {}  ({})\n", plain->median() * 1e3, Rate(bytes, plain->median()),
             bench::MedianAndRangeMs(*plain));
  fmt::print("baseline one mask pass:     {:>8.2f} ms  {}  ({})\n", one_pass->median() * 1e3,
             Rate(bytes, one_pass->median()), bench::MedianAndRangeMs(*one_pass));

  for (int n : site_counts) {
    if (n < 2) return bench.Fail(InvalidArgument("--sites {}: need at least 2", n));
    const int degree = DefaultDegree(n), threshold = DefaultThreshold(degree);
    auto hood = MakeNeighbourhood(degree);
    if (!hood.ok()) return bench.Fail(hood.status());

    // Site: agree k keys, share its two secrets among k neighbours, mask.
    std::vector<PairwiseKey> pairwise;
    auto agree = bench::Repeat(runs, [&]() -> Status {
      ESTUARY_ASSIGN_OR_RETURN(pairwise, PairwiseMaskKeys(0, hood->site.private_key, hood->peers, kRound));
      return Status::Ok();
    });
    if (!agree.ok()) return bench.Fail(agree.status());
    std::vector<uint32_t> xs;
    for (const PeerPublicKey& peer : hood->peers) xs.push_back(peer.site + 1);
    std::vector<Share> key_shares;
    Commitment key_commitment{};
    auto share = bench::Repeat(runs, [&]() -> Status {
      ESTUARY_ASSIGN_OR_RETURN(SharedSecret seed_split, Split(hood->self_seed, threshold, xs));
      ESTUARY_ASSIGN_OR_RETURN(SharedSecret key_split, Split(hood->site.private_key, threshold, xs));
      key_shares = std::move(key_split.shares);
      key_commitment = key_split.commitment;
      return Status::Ok();
    });
    if (!share.ok()) return bench.Fail(share.status());
    // Masking (one fused pass over the values) alternates, run by run, with
    // the same 1 + k masks applied one whole pass at a time, so load from
    // elsewhere on a shared machine falls on both alike.
    bench::Samples mask_samples, separate_samples;
    for (int run = 0; run < runs.warmup + runs.timed; ++run) {
      work = update;
      bench::Stopwatch mask_clock;
      if (Status s = MaskChunk(0, hood->self_seed, pairwise, kBits, 0, work); !s.ok()) return bench.Fail(s);
      const double mask_seconds = mask_clock.Seconds();
      work = update;
      bench::Stopwatch separate_clock;
      if (Status s = ApplyMask(hood->self_seed, 0, kBits, MaskSign::kAdd, work); !s.ok()) return bench.Fail(s);
      for (const PairwiseKey& pair : pairwise) {
        if (Status s = ApplyMask(pair.key, 0, kBits, MaskSign::kAdd, work); !s.ok()) return bench.Fail(s);
      }
      if (run >= runs.warmup) {
        mask_samples.Add(mask_seconds);
        separate_samples.Add(separate_clock.Seconds());
      }
    }
    const bench::Samples* mask = &mask_samples;

    // Server, per dropped site: reconstruct its key from t shares, cancel
    // the masks of its k surviving neighbours.
    auto dropped = bench::Repeat(runs, [&]() -> Status {
      ESTUARY_ASSIGN_OR_RETURN(Key32 key, Combine(std::span(key_shares).first(threshold), threshold, key_commitment));
      return RemoveDroppedSiteMasks(0, key, hood->peers, kRound, kBits, 0, sum);
    });
    if (!dropped.ok()) return bench.Fail(dropped.status());
    // Server, per surviving site: reconstruct its seed, remove its self mask.
    auto seed_split = Split(hood->self_seed, threshold, xs);
    if (!seed_split.ok()) return bench.Fail(seed_split.status());
    auto survivor = bench::Repeat(runs, [&]() -> Status {
      ESTUARY_ASSIGN_OR_RETURN(Key32 self_seed,
                               Combine(std::span(seed_split->shares).first(threshold), threshold, seed_split->commitment));
      return RemoveSelfMask(self_seed, kBits, 0, sum);
    });
    if (!survivor.ok()) return bench.Fail(survivor.status());

    fmt::print("\nn = {}: k = {} neighbours, threshold t = {}\n", n, degree, threshold);
    fmt::print("  site   key agreement (k X25519 + HKDF): {:>8.2f} ms\n", agree->median() * 1e3);
    fmt::print("  site   Shamir split of 2 secrets, k ways: {:>6.2f} ms\n", share->median() * 1e3);
    fmt::print("  site   masking (1 + k PRG passes):      {:>8.2f} ms  {}  ({})\n", mask->median() * 1e3,
               Rate(bytes, mask->median()), bench::MedianAndRangeMs(*mask));
    fmt::print("  server per dropped site (t-share Combine + k ECDH + k passes): {:>8.2f} ms\n", dropped->median() * 1e3);
    fmt::print("  server per surviving site (Combine + 1 pass):                  {:>8.2f} ms\n", survivor->median() * 1e3);
    fmt::print("  site   the same masks one pass each:    {:>8.2f} ms\n", separate_samples.median() * 1e3);
    bench::PrintRatio(fmt::format("n = {}: masking / one pass, masking / (1 + k) separate passes, masking / plain add", n),
                      {{"pass", mask->median() / one_pass->median()},
                       {"separate", mask->median() / separate_samples.median()},
                       {"add", mask->median() / plain->median()}});
  }

  // The whole protocol against the plain sum of float updates.
  std::vector<uint32_t> input(static_cast<size_t>(protocol_elements));
  for (size_t i = 0; i < input.size(); ++i) input[i] = static_cast<uint32_t>(i * 2654435761u);
  std::vector<float> float_update(input.size(), 0.5f);
  std::vector<double> float_sum(input.size(), 0);
  fmt::print("\nthe whole protocol: {} elements, one site in 20 drops after share keys, median of {} runs\n",
             input.size(), runs.timed);
  for (int n : protocol_sites) {
    if (n < 2) return bench.Fail(InvalidArgument("--protocol-sites {}: need at least 2", n));
    bench::Samples site, server, bytes_samples;
    for (int run = 0; run < runs.warmup + runs.timed; ++run) {
      auto cost = RunProtocol(uint32_t(n), input);
      if (!cost.ok()) return bench.Fail(cost.status());
      if (run >= runs.warmup) {
        site.Add(cost->site_seconds);
        server.Add(cost->server_seconds);
        bytes_samples.Add(double(cost->site_bytes));
      }
    }
    auto plain_sum = bench::Repeat(runs, [&]() -> Status {
      for (int u = 0; u < n; ++u) {
        for (size_t i = 0; i < float_update.size(); ++i) float_sum[i] += 0.25 * float_update[i];
      }
      return Status::Ok();
    });
    if (!plain_sum.ok()) return bench.Fail(plain_sum.status());
    const int degree = DefaultDegree(n);
    const double plain_bytes = 4.0 * double(input.size());
    fmt::print("n = {} (k = {}, t = {}): per site {:.0f} bytes, {:.2f} ms; server {:.2f} ms; plain sum of n float "
               "updates {:.2f} ms\n",
               n, degree, DefaultThreshold(degree), bytes_samples.median(), site.median() * 1e3,
               server.median() * 1e3, plain_sum->median() * 1e3);
    bench::PrintRatio(fmt::format("n = {}: site bytes / plain upload, server / plain sum", n),
                      {{"bytes", bytes_samples.median() / plain_bytes},
                       {"server", server.median() / plain_sum->median()}});
  }
  return 0;
}
