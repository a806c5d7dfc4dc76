// The multi-rank site (client/site.h, client/launch.h): the batch split, the
// launcher's flag checks, and SiteTrainer + RunFollower with 2 and 3 real
// processes over Gloo against the single-process trainers on the same data.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <random>
#include <thread>

#include "comm/gloo_communicator.h"
#include "client/launch.h"
#include "client/site.h"
#include "models/language_model.h"
#include "models/llama.h"
#include "models/lora_federation.h"
#include "models/model.h"
#include "tests/comm/ranks.h"

extern "C" void openblas_set_num_threads(int);

namespace estuary::client {
namespace {

using namespace std::chrono_literals;
using comm::testing::FreeTcpAddress;
using comm::testing::RunRanks;

TEST(ShareOfBatch, TilesTheBatchInContiguousSharesThatDifferByOne) {
  for (int ranks = 1; ranks <= 8; ++ranks) {
    for (uint64_t n = 0; n <= 50; ++n) {
      uint64_t at = 0;
      for (int r = 0; r < ranks; ++r) {
        const BatchShare s = ShareOfBatch(n, ranks, r);
        EXPECT_EQ(s.begin, at) << n << " over " << ranks << ", rank " << r;
        EXPECT_TRUE(s.count == n / ranks || s.count == n / ranks + 1);
        at += s.count;
      }
      EXPECT_EQ(at, n);
    }
  }
  EXPECT_EQ(ShareOfBatch(7, 2, 0).count, 4u);
  EXPECT_EQ(ShareOfBatch(7, 2, 1).begin, 4u);
  EXPECT_EQ(ShareOfBatch(7, 2, 1).count, 3u);
  EXPECT_EQ(ShareOfBatch(1, 3, 2).count, 0u);  // a short last batch leaves a rank without examples
  EXPECT_EQ(ShareOfBatch(1, 3, 2).begin, 1u);
}

Result<int> TwoGpus() { return 2; }
Result<int> NoCuda() { return FailedPrecondition("this build has no NCCL"); }

TEST(SiteLayout, RanksNodesAndGpus) {
  SiteFlags flags;
  flags.ranks = 3;
  flags.nodes = 2;
  flags.node_rank = 1;
  flags.local_rank = 2;
  flags.zero = 3;
  flags.rendezvous = "tcp://10.0.0.1:29500";
  auto site = MakeSiteLayout(flags, NoCuda);
  ASSERT_TRUE(site.ok()) << site.status().ToString();
  EXPECT_EQ(site->world(), 6);
  EXPECT_EQ(site->global_rank(), 5);
  EXPECT_EQ(site->backend, "gloo");
  EXPECT_EQ(site->zero, parallel::ZeroStage::kZero3);
  EXPECT_TRUE(site->multi_rank());

  EXPECT_FALSE(MakeSiteLayout(SiteFlags{}, NoCuda)->multi_rank());  // the plain client

  SiteFlags gpus;
  gpus.gpus = "1,0";
  site = MakeSiteLayout(gpus, TwoGpus);
  ASSERT_TRUE(site.ok()) << site.status().ToString();
  EXPECT_EQ(site->backend, "nccl");
  EXPECT_EQ(site->local_ranks, 2);
  EXPECT_EQ(site->gpus, (std::vector<int>{1, 0}));
  gpus.gpus = "all";
  EXPECT_EQ(MakeSiteLayout(gpus, TwoGpus)->gpus, (std::vector<int>{0, 1}));
}

TEST(SiteLayout, BadFlagsNameTheFlag) {
  struct Case {
    std::function<void(SiteFlags&)> set;
    std::function<Result<int>()> gpus;
    std::string expected;
  };
  const Case cases[] = {
      {[](SiteFlags& f) { f.ranks = 0; }, NoCuda, "--ranks 0: must be at least 1"},
      {[](SiteFlags& f) { f.zero = 4; }, NoCuda, "--zero 4: expected 0 (DDP), 1, 2 or 3"},
      {[](SiteFlags& f) { f.zero = -1; }, NoCuda, "--zero -1"},
      {[](SiteFlags& f) { f.gpus = "all"; }, NoCuda, "--gpus all: this build has no NCCL"},
      {[](SiteFlags& f) { f.gpus = "0,0"; }, TwoGpus, "--gpus 0,0: device 0 is listed twice"},
      {[](SiteFlags& f) { f.gpus = "2"; }, TwoGpus, "--gpus 2: device 2 is not visible (2 CUDA device(s))"},
      {[](SiteFlags& f) { f.gpus = "0,x"; }, TwoGpus, "--gpus '0,x': expected all or a list"},
      {[](SiteFlags& f) { f.gpus = "0,"; }, TwoGpus, "--gpus '0,': expected all or a list"},
      {[](SiteFlags& f) { f.gpus = "0"; f.ranks = 2; }, TwoGpus, "--gpus and --ranks 2"},
      {[](SiteFlags& f) { f.gpus = "0"; f.backend = "gloo"; }, TwoGpus, "--gpus with --backend gloo"},
      {[](SiteFlags& f) { f.backend = "nccl"; }, TwoGpus, "--backend nccl: name the GPUs"},
      {[](SiteFlags& f) { f.backend = "mpi"; }, NoCuda, "--backend 'mpi'"},
      {[](SiteFlags& f) { f.nodes = 2; f.node_rank = 2; f.rendezvous = "tcp://h:1"; }, NoCuda,
       "--node-rank 2: must be in [0, --nodes 2)"},
      {[](SiteFlags& f) { f.nodes = 2; }, NoCuda, "--nodes 2: a multi-node site needs --rendezvous"},
      {[](SiteFlags& f) { f.rendezvous = "10.0.0.1:1"; }, NoCuda, "--rendezvous '10.0.0.1:1'"},
      {[](SiteFlags& f) { f.rank_timeout_s = 0; }, NoCuda, "--rank-timeout 0"},
      {[](SiteFlags& f) { f.ranks = 2; f.local_rank = 2; }, NoCuda, "--local-rank 2: not in [0, 2)"},
  };
  for (const auto& c : cases) {
    SiteFlags flags;
    c.set(flags);
    auto site = MakeSiteLayout(flags, c.gpus);
    ASSERT_FALSE(site.ok()) << c.expected;
    EXPECT_NE(site.status().message().find(c.expected), std::string::npos) << site.status().message();
  }
}

// ---- SiteTrainer against one process ------------------------------------------

// ||a - b|| / ||b||, in double.
double RelError(std::span<const float> a, std::span<const float> b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

std::shared_ptr<const models::Dataset> Images(int n) {
  auto data = std::make_shared<models::Dataset>();
  data->feature_size = 784;
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> pixel(0, 1);
  data->features.resize(size_t(n) * 784);
  for (auto& v : data->features) v = pixel(gen);
  for (int i = 0; i < n; ++i) data->labels.push_back(int32_t(gen() % 10));
  return data;
}

std::shared_ptr<const std::vector<int32_t>> Text(int n) {
  auto tokens = std::make_shared<std::vector<int32_t>>();
  std::mt19937 gen(6);
  for (int i = 0; i < n; ++i) tokens->push_back(int32_t('a' + gen() % 26));
  return tokens;
}

struct Scenario {
  std::string model;  // "mlp", "cnn" or "llama-tiny"
  int ranks = 2;
  parallel::ZeroStage stage = parallel::ZeroStage::kDdp;
  v1::TaskConfig task;
  int lora_rank = 0;  // a lora site's own adapter rank (0: the federation's)
  DType lora_base = DType::kF32;
};
void PrintTo(const Scenario& s, std::ostream* os) {
  *os << s.model << " on " << s.ranks << " ranks, zero " << int(s.stage);
  if (s.task.update_kind() == v1::UPDATE_LORA) {
    *os << ", lora " << s.task.lora().merge() << " site rank " << s.lora_rank << " base " << DTypeName(s.lora_base);
  }
}

// A ZeRO-3 site's update: the producer runs on its own thread (the only one
// using the communicator meanwhile) while this one consumes, as the Agent does.
Result<std::vector<float>> Collect(UpdateStream& stream, size_t size) {
  std::thread producer([&] { stream.Run(); });
  std::vector<float> delta;
  Status end;
  UpdateStream::Slice slice;
  size_t slices = 0;
  while (stream.WaitPop(&slice, &end) == UpdateStream::Next::kSlice) {
    if (slice.offset != delta.size()) end = Internal("slice at {} where {} was due", slice.offset, delta.size());
    delta.insert(delta.end(), slice.values.begin(), slice.values.end());
    ++slices;
  }
  producer.join();
  ESTUARY_RETURN_IF_ERROR(end);
  if (delta.size() != size || slices < 2) return Internal("{} elements in {} slices for a model of {}", delta.size(), slices, size);
  return delta;
}

v1::TaskConfig LoraTask(std::string merge, bool mixed_ranks = false);

// The adapters of a lora task, as a site reads them.
models::LoraConfig AdaptersOf(const v1::TaskConfig& task) { return TaskFromProto(task)->lora.config; }

// Rank 0 trains two rounds through SiteTrainer (with idle messages between
// them) and checks each update against the single-process trainer's; the
// other ranks follow until rank 0 says the federation is over.
Status RunSite(const Scenario& s, const std::string& address, int rank) {
  openblas_set_num_threads(1);
  ESTUARY_ASSIGN_OR_RETURN(auto comm, comm::ConnectGloo({.address = address, .rank = rank, .size = s.ranks, .timeout = 60s},
                                                  {.host = "127.0.0.1"}));
  const bool text = models::IsLanguageModel(s.model);
  auto images = Images(61);
  auto tokens = Text(4000);
  parallel::DataParallelOptions options{.stage = s.stage, .bucket_bytes = 64 << 10, .first_bucket_bytes = 4 << 10};
  auto rank_trainer = text ? MakeTextRankTrainer(*comm, tokens, options, {.lora_rank = s.lora_rank, .lora_base = s.lora_base})
                           : MakeClassifierRankTrainer(*comm, images, {}, options);
  if (rank != 0) return RunFollower(*comm, *rank_trainer);

  const bool lora = s.task.update_kind() == v1::UPDATE_LORA;
  std::vector<float> global;
  Manifest manifest;
  if (lora) {
    ESTUARY_ASSIGN_OR_RETURN(auto initial, models::LoraInitialModel(s.model, AdaptersOf(s.task), 3, ""));
    global = std::move(initial.values);
    manifest = std::move(initial.manifest);
  } else if (text) {
    ESTUARY_ASSIGN_OR_RETURN(auto config, models::LlamaPreset(s.model));
    ESTUARY_ASSIGN_OR_RETURN(auto llama, models::Llama::Create(config, 1));
    llama.Initialize(3);
    global.assign(llama.parameters().begin(), llama.parameters().end());
    manifest = llama.manifest();
  } else {
    ESTUARY_ASSIGN_OR_RETURN(auto model, models::MakeModel(s.model));
    model->Initialize(3);
    global.assign(model->parameters().begin(), model->parameters().end());
    manifest = model->manifest();
  }
  // The one-rank case of the same site: one process, a solo communicator.
  ESTUARY_ASSIGN_OR_RETURN(auto single, MakeLocalSite(text ? SiteData{.text = tokens} : SiteData{.images = images},
                                                      {.lora_rank = s.lora_rank, .lora_base = s.lora_base}));
  SiteTrainer site(*comm, std::move(rank_trainer), s.stage, Compute{});
  Status broken;
  site.on_broken = [&](const Status& st) { broken = st; };
  for (uint64_t round = 1; round <= 2; ++round) {
    ESTUARY_RETURN_IF_ERROR(site.KeepAlive());
    ESTUARY_RETURN_IF_ERROR(site.KeepAlive());
    ESTUARY_ASSIGN_OR_RETURN(Update got, site.Train(global, manifest, s.task, round, "site-x"));
    if ((s.stage == parallel::ZeroStage::kZero3) != bool(got.stream)) return Internal("streamed: {}", bool(got.stream));
    if (got.stream) {
      ESTUARY_ASSIGN_OR_RETURN(got.payload, Collect(*got.stream, global.size()));
    }
    ESTUARY_ASSIGN_OR_RETURN(Update want, single->Train(global, manifest, s.task, round, "site-x"));
    // AdamW divides each gradient by its own magnitude, so the last bits of a
    // sum that cancels (one process, an all-reduce ring, a reduce-scatter ring
    // add in different orders) become visible steps on a few weights: its
    // deltas agree to 1e-4, SGD's to 1e-5 (measured: up to 1.4e-5 and 1.7e-6).
    const double tolerance = s.task.optimizer() == "adamw" ? 1e-4 : 1e-5;
    const double error = RelError(got.payload, want.payload);
    if (!(error <= tolerance)) {
      return Internal("round {}: update differs from one process by {} (relative L2)", round, error);
    }
    if (!(std::abs(got.train_loss - want.train_loss) <= 1e-5 * want.train_loss)) {
      return Internal("round {}: train loss {} != one process's {}", round, got.train_loss, want.train_loss);
    }
    if (got.num_examples != want.num_examples) return Internal("examples {} != {}", got.num_examples, want.num_examples);
    if (got.kind != want.kind || !(got.manifest == want.manifest)) {
      return Internal("round {}: the update's kind or manifest is not one process's", round);
    }
    // Where each trained, as each reports it: the same engine, N ranks over Gloo against one alone.
    const std::string engine = lora ? "models::LoraLlama" : text ? "models::Llama" : "models::Model";
    const std::string ranks = fmt::format("{} ranks (gloo, {})", s.ranks, parallel::ZeroStageName(s.stage));
    if (got.trained_on != fmt::format("{} on cpu in f32, {}", engine, ranks)) {
      return Internal("round {}: the site says it trained on '{}'", round, got.trained_on);
    }
    if (want.trained_on != fmt::format("{} on cpu in f32, 1 rank (solo, ddp)", engine)) {
      return Internal("round {}: one process says it trained on '{}'", round, want.trained_on);
    }
    if (s.lora_base != DType::kF32) {  // the base's storage does reach the model: f32 trains otherwise
      ESTUARY_ASSIGN_OR_RETURN(auto f32_site, MakeLocalSite({.text = tokens}, {}));
      ESTUARY_ASSIGN_OR_RETURN(Update f32, f32_site->Train(global, manifest, s.task, round, "site-x"));
      if (!(RelError(f32.payload, want.payload) > 1e-6)) return Internal("round {}: a bf16 base trained as f32", round);
    }
    if (s.task.proximal_mu() > 0) {  // the term reaches the ranks' DataParallel: without it the update differs
      v1::TaskConfig plain = s.task;
      plain.set_proximal_mu(0);
      ESTUARY_ASSIGN_OR_RETURN(Update without, single->Train(global, manifest, plain, round, "site-x"));
      if (!(RelError(without.payload, want.payload) > 1e-4)) {
        return Internal("round {}: proximal_mu {} changed nothing", round, s.task.proximal_mu());
      }
    }
    if (lora) {
      // The next round starts from a global adapter whose B is not zero.
      std::mt19937 gen{unsigned(round)};
      std::normal_distribution<float> noise(0.0f, 0.02f);
      const uint64_t adapter_at = models::MakeLoraGlobalLayout(*models::LlamaPreset(s.model), AdaptersOf(s.task))
                                      ->adapter_offset();
      for (size_t i = adapter_at; i < global.size(); ++i) global[i] += noise(gen);
    } else {
      for (size_t i = 0; i < global.size(); ++i) global[i] += want.payload[i];  // the next round starts elsewhere
    }
  }
  // A task rank 0 cannot train fails on rank 0 alone; the site carries on.
  v1::TaskConfig bad = lora ? s.task : LoraTask("exact");
  bad.set_update_kind(lora ? v1::UPDATE_FULL : v1::UPDATE_LORA);  // the global buffer is the other kind's
  if (site.Train(global, manifest, bad, 3, "site-x").ok()) return Internal("a task of the wrong kind trained");
  if (text && s.stage == parallel::ZeroStage::kZero3) {  // lora under ZeRO-3: one line, on rank 0 alone
    v1::TaskConfig lora_task = LoraTask("exact");
    ESTUARY_ASSIGN_OR_RETURN(auto initial, models::LoraInitialModel(s.model, AdaptersOf(lora_task), 3, ""));
    auto refused = site.Train(initial.values, initial.manifest, lora_task, 3, "site-x");
    if (refused.ok() || refused.status().message().find("under --zero 3") == std::string::npos) {
      return Internal("lora under ZeRO-3: {}", refused.status().ToString());
    }
  }
  if (!broken.ok()) return Internal("a refused task broke the site: {}", broken.ToString());
  return site.Finish(Status::Ok());
}

class SiteMatchesOneProcess : public ::testing::TestWithParam<Scenario> {};

TEST_P(SiteMatchesOneProcess, OverTwoRounds) {
  const Scenario s = GetParam();
  const std::string address = FreeTcpAddress();
  for (const auto& o : RunRanks(s.ranks, [&](int rank) { return RunSite(s, address, rank); }, 300s)) {
    EXPECT_TRUE(o.ok()) << o.Describe();
  }
}

v1::TaskConfig ImageTask(float momentum) {
  v1::TaskConfig t;
  t.set_model("mlp");
  t.set_epochs(2);
  t.set_batch_size(7);  // 61 examples: 8 batches of 7 and one of 5, split unevenly
  t.set_learning_rate(0.05f);
  t.set_momentum(momentum);
  t.set_seq_len(128);
  t.set_seed(11);
  return t;
}

v1::TaskConfig TextTask() {
  v1::TaskConfig t;
  t.set_model("llama-tiny");
  t.set_epochs(1);
  t.set_batch_size(5);
  t.set_seq_len(16);
  t.set_max_local_steps(3);
  t.set_learning_rate(0.003f);
  t.set_optimizer("adamw");
  t.set_weight_decay(0.01f);
  t.set_seed(11);
  return t;
}

// FedProx: the same task with the proximal term, strong enough to matter in a round.
v1::TaskConfig Proximal(v1::TaskConfig t) {
  t.set_proximal_mu(t.model() == "mlp" ? 5.0f : 50.0f);
  return t;
}

// A lora round of the same decoder: rank-4 adapters on q, v and down
// (dropout 0.1: the ranks draw the masks one process draws for their rows).
v1::TaskConfig LoraTask(std::string merge, bool mixed_ranks) {
  v1::TaskConfig t = TextTask();
  t.set_update_kind(v1::UPDATE_LORA);
  t.set_learning_rate(0.01f);
  v1::LoraTask& lora = *t.mutable_lora();
  lora.set_rank(4);
  lora.set_alpha(8);
  lora.set_dropout(0.1f);
  for (const char* module : {"q_proj", "v_proj", "down_proj"}) lora.add_target_modules(module);
  lora.set_merge(std::move(merge));
  lora.set_mixed_ranks(mixed_ranks);
  return t;
}

INSTANTIATE_TEST_SUITE_P(
    Site, SiteMatchesOneProcess,
    ::testing::Values(Scenario{"mlp", 2, parallel::ZeroStage::kDdp, ImageTask(0)},  // against the fused single-process SGD
                      Scenario{"mlp", 3, parallel::ZeroStage::kZero1, ImageTask(0.5f)},
                      Scenario{"mlp", 2, parallel::ZeroStage::kZero2, ImageTask(0.5f)},
                      Scenario{"mlp", 3, parallel::ZeroStage::kZero3, ImageTask(0.5f)},
                      Scenario{"llama-tiny", 2, parallel::ZeroStage::kDdp, TextTask()},
                      Scenario{"llama-tiny", 3, parallel::ZeroStage::kZero3, TextTask()},
                      Scenario{"llama-tiny", 2, parallel::ZeroStage::kDdp, LoraTask("exact")},
                      Scenario{"llama-tiny", 3, parallel::ZeroStage::kZero1, LoraTask("naive")},
                      Scenario{"llama-tiny", 2, parallel::ZeroStage::kZero2, LoraTask("frozen-a")},
                      Scenario{"llama-tiny", 3, parallel::ZeroStage::kDdp, LoraTask("exact", true), 2},
                      Scenario{"llama-tiny", 2, parallel::ZeroStage::kZero1, LoraTask("exact"), 0, DType::kBF16},
                      Scenario{"mlp", 3, parallel::ZeroStage::kZero3, Proximal(ImageTask(0.5f))},
                      Scenario{"llama-tiny", 2, parallel::ZeroStage::kZero2, Proximal(TextTask())}),
    [](const auto& info) {
      const Scenario& s = info.param;
      std::string name = fmt::format("{}_{}ranks_zero{}", s.model == "mlp" ? "mlp" : "llama", s.ranks, int(s.stage));
      if (s.task.update_kind() == v1::UPDATE_LORA) {
        name += fmt::format("_lora_{}", s.task.lora().merge() == "frozen-a" ? "frozen_a" : s.task.lora().merge());
        if (s.lora_rank != 0) name += fmt::format("_site_rank{}", s.lora_rank);
        if (s.lora_base != DType::kF32) name += fmt::format("_base_{}", DTypeName(s.lora_base));
      }
      if (s.task.proximal_mu() > 0) name += "_fedprox";
      return name;
    });

// Rank 0 ends the federation with an error: every follower returns it.
TEST(Site, FollowersHearRankZeroGiveUp) {
  const std::string address = FreeTcpAddress();
  auto outcomes = RunRanks(2, [&](int rank) -> Status {
    ESTUARY_ASSIGN_OR_RETURN(auto comm, comm::ConnectGloo({.address = address, .rank = rank, .size = 2, .timeout = 60s},
                                                    {.host = "127.0.0.1"}));
    auto rank_trainer = MakeClassifierRankTrainer(*comm, Images(10), {}, {});
    if (rank == 0) {
      return SiteTrainer(*comm, std::move(rank_trainer), parallel::ZeroStage::kDdp, Compute{})
          .Finish(Aborted("the server refused us"));
    }
    Status s = RunFollower(*comm, *rank_trainer);
    if (s.message().find("rank 0 gave up: the server refused us") == std::string::npos) {
      return Internal("the follower returned '{}'", s.ToString());
    }
    return Status::Ok();
  });
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << o.Describe();
}

}  // namespace
}  // namespace estuary::client

namespace estuary::client {
namespace {

TEST(UpdateStream, SlicesPassInOrderAndCancelUnblocksTheProducer) {
  // Capacity 1: the producer waits for the consumer after each slice.
  UpdateStream stream([](UpdateStream& out) -> Status {
    for (uint64_t i = 0; i < 3; ++i) ESTUARY_RETURN_IF_ERROR(out.Push({i * 2, {float(i), float(i)}}));
    return Status::Ok();
  }, 1);
  std::atomic<int> ready{0};
  stream.on_ready = [&] { ++ready; };
  UpdateStream::Slice slice;
  Status end;
  EXPECT_EQ(stream.Pop(&slice, &end), UpdateStream::Next::kPending);
  std::thread producer([&] { stream.Run(); });
  std::vector<uint64_t> offsets;
  while (stream.WaitPop(&slice, &end) == UpdateStream::Next::kSlice) offsets.push_back(slice.offset);
  producer.join();
  EXPECT_TRUE(end.ok()) << end.ToString();
  EXPECT_EQ(offsets, (std::vector<uint64_t>{0, 2, 4}));
  EXPECT_EQ(ready.load(), 4);  // three slices and the end
  stream.Run();                // runs once only
  EXPECT_EQ(stream.Pop(&slice, &end), UpdateStream::Next::kEnd);

  // A consumer that goes away: the blocked producer's next Push fails, and it ends.
  UpdateStream gone([](UpdateStream& out) -> Status {
    for (uint64_t i = 0;; ++i) ESTUARY_RETURN_IF_ERROR(out.Push({i, {0.0f}}));
  }, 1);
  std::thread blocked([&] { gone.Run(); });
  ASSERT_EQ(gone.WaitPop(&slice, &end), UpdateStream::Next::kSlice);
  gone.Cancel();
  blocked.join();
  EXPECT_TRUE(gone.started());
  while (gone.Pop(&slice, &end) == UpdateStream::Next::kSlice) {
  }
  EXPECT_EQ(gone.Pop(&slice, &end), UpdateStream::Next::kEnd);
  EXPECT_NE(end.message().find("cancelled"), std::string::npos) << end.ToString();
}

}  // namespace
}  // namespace estuary::client
