// DDP and ZeRO-1/2/3 (parallel/data_parallel.h) with 2 and 4 real processes
// (forked, tests/comm/ranks.h) over Gloo on 127.0.0.1. Every rank also
// trains a single-process reference on the full global batch in its own
// memory, so each rank checks itself; batches never split evenly, and ranks
// other than 0 start from other weights (Create's broadcast must fix them).
//
// - Ddp/*: DDP equals one process on the full batch — parameters and
//   gradients after every step, and the global loss — for the MLP, the CNN
//   and the decoder (tied, untied), default and tiny buckets (cutting through
//   tensors), and k micro-batches against one batch k times larger.
// - Zero/*: ZeRO-1/2/3 equal a DDP model stepped beside them on the same
//   communicator, after every step: SGD with momentum and AdamW, clipping,
//   micro-batches, buckets whose sizes N does not divide (remainders).
// - LossScaler/*: the same with the loss scaler and clipping; on one step the
//   last rank puts an inf into a gradient that rank 0's shard owns: every
//   rank skips the step, every weight bit is unchanged, the scale backs off.
// - PerRank/MemoryTest: bytes held per rank for N = 1, 2, 4 against ZeRO's
//   accounting, and ZeRO-3's read-out holding two units at most.
// - Gloo/DeadRankTest: a rank that exits mid-backward makes the others' Step
//   fail, with a message, within the communicator's timeout.
// - DataParallelSchedule: (one process, a recording communicator) each
//   bucket's reduction starts at the first hook that makes it final, and
//   ZeRO-3 gathers the next unit ahead.
// Errors are relative, in L2 (RelError): fp32, 1e-5.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <vector>

#include "parallel/data_parallel.h"
#include "comm/gloo_communicator.h"
#include "models/llama.h"
#include "models/lora.h"
#include "models/model.h"
#include "models/optimizer.h"
#include "tests/comm/ranks.h"

extern "C" void openblas_set_num_threads(int);

namespace estuary::parallel {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using comm::testing::FreeTcpAddress;
using comm::testing::RankOutcome;
using comm::testing::RunRanks;


void ExpectAllOk(const std::vector<RankOutcome>& outcomes) {
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << o.Describe() << " (its message is above)";
}

// ||a - b|| / ||b|| (L2, in double): the error relative to the tensor's
// scale. Element-wise ratios would measure rounding, not the engine: AdamW
// divides each gradient by its own magnitude, so a gradient that cancels to
// ~1e-8 turns the last bits of a sum, which differ between one process, an
// all-reduce ring and a reduce-scatter ring, into a visible step on that one
// weight.
double RelError(std::span<const float> a, std::span<const float> b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = double(a[i]) - double(b[i]);
    diff += d * d;
    norm += double(b[i]) * double(b[i]);
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

// ---- the models, behind one face -------------------------------------------

struct Batch {
  int n = 0;
  std::vector<float> x;            // classifiers: [n, input]
  std::vector<int32_t> y;          // classifiers: [n]
  std::vector<int32_t> tokens, targets;  // decoders: [n, seq]
};

constexpr int kSeq = 8;

models::LlamaConfig SmallLlama(bool tied, int scale = 1) {
  models::LlamaConfig c;
  c.vocab_size = 32 * scale;
  c.hidden_size = 16 * scale;
  c.intermediate_size = 32 * scale;
  c.num_layers = 2 * scale;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.max_seq_len = kSeq;
  c.tie_embeddings = tied;
  return c;
}

class Net {
 public:
  // "mlp", "cnn", "llama" (untied), "llama-tied", "llama-big" (for memory),
  // "lora" (adapters on all seven projections of the untied decoder, A and B
  // drawn non-zero so that both get gradients).
  static Result<Net> Make(const std::string& name, uint64_t seed, int max_batch) {
    Net net;
    if (name == "lora") {
      auto base = models::Llama::Create(SmallLlama(false), max_batch);
      if (!base.ok()) return base.status();
      base->Initialize(1);  // the shared pretrained base: the same on every rank (Create broadcasts adapters only)
      models::LoraConfig config;
      config.rank = 3;
      config.alpha = 5;
      config.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
      auto lora = models::LoraLlama::Create(std::move(base).value(), config);
      if (!lora.ok()) return lora.status();
      net.lora_.emplace(std::move(lora).value());
      std::mt19937 gen{uint32_t(seed + 1)};
      std::uniform_real_distribution<float> value(-0.3f, 0.3f);
      for (float& p : net.lora_->parameters()) p = value(gen);
      return net;
    }
    if (name.rfind("llama", 0) == 0) {
      const bool big = name == "llama-big";
      auto llama = models::Llama::Create(SmallLlama(name == "llama-tied", big ? 4 : 1), max_batch);
      if (!llama.ok()) return llama.status();
      net.llama_.emplace(std::move(llama).value());
      net.llama_->Initialize(seed);
    } else {
      auto model = models::MakeModel(name);
      if (!model.ok()) return model.status();
      net.model_ = std::move(model).value();
      net.model_->Initialize(seed);
    }
    return net;
  }

  std::span<float> parameters() {
    return lora_ ? lora_->parameters() : llama_ ? llama_->parameters() : model_->parameters();
  }
  std::span<float> gradients() { return lora_ ? lora_->gradients() : llama_ ? llama_->gradients() : model_->gradients(); }
  std::vector<models::ParameterUnit> units() const {
    return lora_ ? lora_->units() : llama_ ? llama_->units() : model_->units();
  }

  Batch MakeBatch(int n, uint64_t seed) const {
    std::mt19937 gen{uint32_t(seed)};
    Batch b;
    b.n = n;
    if (llama_ || lora_) {
      std::uniform_int_distribution<int32_t> tok(0, Decoder().config().vocab_size - 1);
      b.tokens.resize(size_t(n) * kSeq);
      b.targets.resize(size_t(n) * kSeq);
      for (auto& t : b.tokens) t = tok(gen);
      for (auto& t : b.targets) t = tok(gen);
    } else {
      std::uniform_real_distribution<float> pixel(0.0f, 1.0f);
      std::uniform_int_distribution<int32_t> label(0, model_->num_classes() - 1);
      b.x.resize(size_t(n) * model_->input_size());
      b.y.resize(n);
      for (auto& v : b.x) v = pixel(gen);
      for (auto& v : b.y) v = label(gen);
    }
    return b;
  }

  // Forward and backward over examples [lo, hi) of b.
  Result<float> Run(const Batch& b, int lo, int hi, const models::BackwardOptions& o) {
    if (lora_) {
      return lora_->ForwardBackward(&b.tokens[size_t(lo) * kSeq], &b.targets[size_t(lo) * kSeq], hi - lo, kSeq, o);
    }
    if (llama_) {
      return llama_->ForwardBackward(&b.tokens[size_t(lo) * kSeq], &b.targets[size_t(lo) * kSeq], hi - lo, kSeq, o);
    }
    return model_->ForwardBackward(&b.x[size_t(lo) * model_->input_size()], &b.y[lo], hi - lo, o);
  }

 private:
  const models::Llama& Decoder() const { return lora_ ? lora_->base() : *llama_; }

  std::unique_ptr<models::Model> model_;
  std::optional<models::Llama> llama_;
  std::optional<models::LoraLlama> lora_;
};

// One optimizer of either kind, stepping any span or slices it is given.
struct Optimizer {
  std::optional<models::Sgd> sgd;
  std::optional<models::AdamW> adamw;
  explicit Optimizer(bool use_adamw) {
    if (use_adamw) {
      adamw.emplace(models::AdamWOptions{.lr = 1e-2f, .weight_decay = 0.1f});
    } else {
      sgd.emplace(0.05f, 0.9f, 1e-3f);
    }
  }
  void Step(std::span<float> p, std::span<const float> g) {
    if (adamw) {
      adamw->Step(p, g);
    } else {
      sgd->Step(p, g);
    }
  }
  void Step(std::span<const models::ParameterSlice> slices) {
    if (adamw) {
      adamw->Step(slices);
    } else {
      sgd->Step(slices);
    }
  }
  size_t state_bytes() const {
    return adamw ? (adamw->first_moment().size() + adamw->second_moment().size()) * sizeof(float) : 0;
  }
};

// Examples [lo, hi) of b global ones that rank r of n takes: uneven when n does not divide b.
std::pair<int, int> Split(int b, int r, int n) { return {r * b / n, (r + 1) * b / n}; }

// ---- the scenarios -----------------------------------------------------------

struct Scenario {
  std::string model = "mlp";
  int ranks = 2;
  ZeroStage stage = ZeroStage::kDdp;  // kDdp: DDP against the reference; else ZeRO against DDP too
  size_t bucket_bytes = size_t(25) << 20;
  size_t first_bucket_bytes = size_t(1) << 20;
  int steps = 3;
  int micro = 1;   // micro-batches per step
  int batch = 10;  // global examples per micro-batch
  bool adamw = false;
  double clip = 0;
  bool scaler = false;
  int inject_step = -1;  // this step, the last rank puts an inf into one gradient
};

std::string Name(const Scenario& s) {
  std::string name = fmt::format("{}_{}_n{}", s.model, ZeroStageName(s.stage), s.ranks);
  for (char& c : name) {
    if (c == '-') c = '_';
  }
  if (s.bucket_bytes != Scenario{}.bucket_bytes || s.first_bucket_bytes != Scenario{}.first_bucket_bytes) {
    name += fmt::format("_buckets{}_{}", s.first_bucket_bytes, s.bucket_bytes);
  }
  if (s.micro > 1) name += fmt::format("_micro{}", s.micro);
  name += s.adamw ? "_adamw" : "_sgd";
  if (s.clip > 0) name += "_clip";
  if (s.scaler) name += "_scaler";
  if (s.inject_step >= 0) name += "_inf";
  return name;
}

void PrintTo(const Scenario& s, std::ostream* os) { *os << Name(s); }
}  // namespace
void PrintTo(ZeroStage stage, std::ostream* os) { *os << ZeroStageName(stage); }
namespace {

// Wraps the engine's hooks to put an inf into one gradient just before the
// engine sees it final (so the inf goes into the reduction, as an overflow would).
class InjectInf : public models::StepHooks {
 public:
  InjectInf(models::StepHooks* inner, std::span<float> grads, uint64_t at) : inner_(inner), grads_(grads), at_(at) {}
  void BeforeUnit(int u, models::Pass p) override { inner_->BeforeUnit(u, p); }
  void AfterUnit(int u, models::Pass p) override { inner_->AfterUnit(u, p); }
  void GradientsFinal(uint64_t offset) override {
    if (!done_ && at_ >= offset) {
      grads_[at_] = std::numeric_limits<float>::infinity();
      done_ = true;
    }
    inner_->GradientsFinal(offset);
  }

 private:
  models::StepHooks* inner_;
  std::span<float> grads_;
  uint64_t at_;
  bool done_ = false;
};

Result<std::vector<float>> ReadOut(DataParallel& dp, size_t size) {
  std::vector<float> out(size);
  ESTUARY_RETURN_IF_ERROR(dp.ForEachSlice([&](uint64_t offset, std::span<const float> v) {
    std::memcpy(&out[offset], v.data(), v.size_bytes());
    return Status::Ok();
  }));
  return out;
}

Status RunScenario(const Scenario& s, const std::string& address, int rank) {
  openblas_set_num_threads(1);
  const int n = s.ranks;
  ESTUARY_ASSIGN_OR_RETURN(auto comm, comm::ConnectGloo({.address = address, .rank = rank, .size = n, .timeout = 60s},
                                                  {.host = "127.0.0.1"}));
  const int total = s.batch * s.micro;
  ESTUARY_ASSIGN_OR_RETURN(Net ref, Net::Make(s.model, 1, total));
  // Ranks other than 0 start from other weights: Create's broadcast must fix that.
  ESTUARY_ASSIGN_OR_RETURN(Net ddp, Net::Make(s.model, rank == 0 ? 1 : 100 + rank, s.batch));
  std::optional<Net> zero;
  if (s.stage != ZeroStage::kDdp) {
    ESTUARY_ASSIGN_OR_RETURN(zero, Net::Make(s.model, 1, s.batch));
  }

  DataParallelOptions options;
  options.bucket_bytes = s.bucket_bytes;
  options.first_bucket_bytes = s.first_bucket_bytes;
  options.max_grad_norm = s.clip;
  if (s.scaler) options.loss_scaler = models::LossScalerOptions{};
  ESTUARY_ASSIGN_OR_RETURN(auto dp, DataParallel::Create(*comm, ddp, options));
  std::unique_ptr<DataParallel> zp;
  if (zero) {
    options.stage = s.stage;
    options.broadcast_parameters = false;  // as a federated site: every rank holds the global weights
    ESTUARY_ASSIGN_OR_RETURN(zp, DataParallel::Create(*comm, *zero, options));
  }
  CHECK_OR_RETURN(RelError(ddp.parameters(), ref.parameters()) == 0, "rank {}: broadcast left other weights", rank);

  Optimizer ref_opt(s.adamw), ddp_opt(s.adamw), zero_opt(s.adamw);
  models::LossScaler ref_scaler;
  const uint64_t inject_at = dp->buckets()[0].first;  // rank 0's first element of the first bucket
  const uint64_t inject_at_zero = zp ? zp->buckets()[0].first : 0;

  for (int step = 0; step < s.steps; ++step) {
    const Batch data = ref.MakeBatch(total, 1000 + step);
    const bool inject = step == s.inject_step;
    const std::vector<float> before(ddp.parameters().begin(), ddp.parameters().end());

    // The reference: one process, the whole batch of every micro-batch at once.
    const float scale = s.scaler ? ref_scaler.scale() : 1.0f;
    ESTUARY_ASSIGN_OR_RETURN(float ref_loss, ref.Run(data, 0, total, {.grad_scale = scale}));
    if (inject) ref.gradients()[inject_at] = std::numeric_limits<float>::infinity();
    auto ref_step = [&] {
      if (s.clip > 0) models::ClipGradNorm(ref.gradients(), s.clip);
      ref_opt.Step(ref.parameters(), ref.gradients());
    };
    if (s.scaler) {
      ref_scaler.Step(ref.gradients(), ref_step);
    } else {
      ref_step();
    }

    // The data-parallel models: this rank's share of each micro-batch.
    double weighted_loss = 0;  // this rank's share of the global batch's mean loss
    auto run = [&](DataParallel& engine, Net& net, uint64_t at) -> Status {
      weighted_loss = 0;
      for (int m = 0; m < s.micro; ++m) {
        const auto [lo, hi] = Split(s.batch, rank, n);
        auto o = engine.MicroBatch(double(hi - lo) / total, m == s.micro - 1);
        std::optional<InjectInf> injector;
        if (inject && rank == n - 1 && m == s.micro - 1) {
          injector.emplace(o.hooks, net.gradients(), at);
          o.hooks = &*injector;
        }
        auto loss = net.Run(data, m * s.batch + lo, m * s.batch + hi, o);
        if (!loss.ok()) return loss.status();
        weighted_loss += double(*loss) * (hi - lo) / total;
      }
      return Status::Ok();
    };
    ESTUARY_RETURN_IF_ERROR(run(*dp, ddp, inject_at));
    ESTUARY_ASSIGN_OR_RETURN(StepResult r, dp->Step([&](auto slices) { ddp_opt.Step(slices); }));
    ESTUARY_ASSIGN_OR_RETURN(double loss, dp->SumOverRanks(weighted_loss));
    CHECK_OR_RETURN(std::abs(loss - ref_loss) <= 1e-5 * std::abs(ref_loss), "rank {} step {}: loss {} want {}", rank,
                    step, loss, ref_loss);
    CHECK_OR_RETURN(r.stepped == !inject, "rank {} step {}: DDP stepped = {}", rank, step, r.stepped);
    if (inject) {
      CHECK_OR_RETURN(std::memcmp(before.data(), ddp.parameters().data(), before.size() * 4) == 0,
                      "rank {} step {}: a skipped DDP step changed weights", rank, step);
    }
    const double e = RelError(ddp.parameters(), ref.parameters());
    CHECK_OR_RETURN(e <= 1e-5,
                    "rank {} step {}: DDP parameters differ from one process on the full batch by {:.3g}", rank, step,
                    e);
    // Gradients: on every step with SGD; with AdamW on the first (later ones
    // are taken at parameters that differ by rounding, amplified as above).
    if (!inject && (!s.adamw || step == 0)) {
      const double eg = RelError(ddp.gradients(), ref.gradients());
      CHECK_OR_RETURN(eg <= 1e-5, "rank {} step {}: DDP gradients differ from the full batch's by {:.3g}", rank, step,
                      eg);
    }
    if (s.scaler) {
      CHECK_OR_RETURN(dp->loss_scale() == ref_scaler.scale(), "rank {} step {}: loss scale {} want {}", rank, step,
                      dp->loss_scale(), ref_scaler.scale());
    }

    if (zp) {
      ESTUARY_ASSIGN_OR_RETURN(std::vector<float> zbefore, ReadOut(*zp, zero->parameters().size()));
      ESTUARY_RETURN_IF_ERROR(run(*zp, *zero, inject_at_zero));
      ESTUARY_ASSIGN_OR_RETURN(StepResult zr, zp->Step([&](auto slices) { zero_opt.Step(slices); }));
      CHECK_OR_RETURN(zr.stepped == !inject, "rank {} step {}: ZeRO stepped = {}", rank, step, zr.stepped);
      ESTUARY_ASSIGN_OR_RETURN(std::vector<float> zparams, ReadOut(*zp, zero->parameters().size()));
      if (inject) {
        CHECK_OR_RETURN(std::memcmp(zbefore.data(), zparams.data(), zparams.size() * 4) == 0,
                        "rank {} step {}: a skipped ZeRO step changed weights", rank, step);
      }
      const double ez = RelError(zparams, ddp.parameters());
      CHECK_OR_RETURN(ez <= 1e-5, "rank {} step {}: ZeRO parameters differ from DDP's by {:.3g}", rank, step, ez);
      if (s.clip > 0) {
        CHECK_OR_RETURN(std::abs(zr.grad_norm - r.grad_norm) <= 1e-5 * r.grad_norm,
                        "rank {} step {}: ZeRO's global norm {} differs from DDP's {}", rank, step, zr.grad_norm,
                        r.grad_norm);
      }
      if (s.scaler) {
        CHECK_OR_RETURN(zp->loss_scale() == ref_scaler.scale(), "rank {} step {}: ZeRO loss scale {} want {}", rank,
                        step, zp->loss_scale(), ref_scaler.scale());
      }
    }
  }
  return Status::Ok();
}

class DataParallelTest : public ::testing::TestWithParam<Scenario> {};

TEST_P(DataParallelTest, MatchesOneProcess) {
  const Scenario s = GetParam();
  const std::string address = FreeTcpAddress();
  ExpectAllOk(RunRanks(s.ranks, [&](int rank) { return RunScenario(s, address, rank); }, 300s));
}

std::vector<Scenario> DdpScenarios() {
  std::vector<Scenario> out;
  for (int n : {2, 4}) {
    for (std::string model : {"mlp", "cnn", "llama", "llama-tied"}) {
      for (bool tiny : {false, true}) {
        Scenario s{.model = model, .ranks = n};
        s.batch = model == "cnn" ? 6 : 10;
        if (tiny) {  // buckets cut through tensors; a few dozen of them (the CNN has 1.6M parameters)
          s.first_bucket_bytes = 1000;
          s.bucket_bytes = model == "cnn" ? 256000 : model == "mlp" ? 16000 : 1000;
        }
        out.push_back(s);
      }
    }
    // Accumulation: k micro-batches equal one batch k times larger.
    out.push_back({.model = "mlp", .ranks = n, .bucket_bytes = 64000, .first_bucket_bytes = 1000, .micro = 3});
    out.push_back({.model = "llama", .ranks = n, .micro = 2, .batch = 6});
    // LoRA: DDP over the adapter buffer, buckets cutting through adapters, and with accumulation.
    out.push_back({.model = "lora", .ranks = n, .bucket_bytes = 800, .first_bucket_bytes = 300, .batch = 6,
                   .adamw = true});
    out.push_back({.model = "lora", .ranks = n, .micro = 2, .batch = 6, .adamw = true});
  }
  return out;
}

std::vector<Scenario> ZeroScenarios() {
  std::vector<Scenario> out;
  for (int n : {2, 4}) {
    for (ZeroStage stage : {ZeroStage::kZero1, ZeroStage::kZero2, ZeroStage::kZero3}) {
      for (std::string model : {"mlp", "llama-tied", "llama"}) {
        for (bool adamw : {false, true}) {
          Scenario s{.model = model, .ranks = n, .stage = stage, .adamw = adamw};
          s.batch = model == "mlp" ? 10 : 6;
          if (model == "mlp") s.bucket_bytes = s.first_bucket_bytes = 40000 + 12;  // sizes not divisible by n
          out.push_back(s);
        }
      }
      Scenario clip{.model = "llama", .ranks = n, .stage = stage, .adamw = true, .clip = 0.05};
      clip.batch = 6;
      out.push_back(clip);
      Scenario micro{.model = "mlp", .ranks = n, .stage = stage, .bucket_bytes = 100000, .micro = 3, .clip = 0.5};
      out.push_back(micro);
      Scenario llama_micro{.model = "llama-tied", .ranks = n, .stage = stage, .micro = 2, .batch = 6, .adamw = true};
      out.push_back(llama_micro);
      if (stage != ZeroStage::kZero3) {  // LoRA reads its adapters outside unit brackets: no ZeRO-3
        Scenario lora{.model = "lora", .ranks = n, .stage = stage, .bucket_bytes = 800, .first_bucket_bytes = 300,
                      .batch = 6, .adamw = true, .clip = 0.5};
        out.push_back(lora);
      }
    }
  }
  return out;
}

std::vector<Scenario> ScalerScenarios() {
  std::vector<Scenario> out;
  for (int n : {2, 4}) {
    for (ZeroStage stage : {ZeroStage::kDdp, ZeroStage::kZero1, ZeroStage::kZero2, ZeroStage::kZero3}) {
      for (std::string model : {"mlp", "llama"}) {
        Scenario s{.model = model, .ranks = n, .stage = stage, .steps = 4, .adamw = true, .clip = 1.0,
                   .scaler = true, .inject_step = 1};
        s.batch = model == "mlp" ? 10 : 6;
        out.push_back(s);
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Ddp, DataParallelTest, ::testing::ValuesIn(DdpScenarios()),
                         [](const auto& info) { return Name(info.param); });
INSTANTIATE_TEST_SUITE_P(Zero, DataParallelTest, ::testing::ValuesIn(ZeroScenarios()),
                         [](const auto& info) { return Name(info.param); });
INSTANTIATE_TEST_SUITE_P(LossScaler, DataParallelTest, ::testing::ValuesIn(ScalerScenarios()),
                         [](const auto& info) { return Name(info.param); });

// ---- memory ------------------------------------------------------------------

// Bytes per rank after two AdamW steps, measured, against ZeRO's accounting
// with P = G = parameter bytes and O = AdamW's two moments (2P):
//   DDP P + G + O;  ZeRO-1 P + G + O/N;  ZeRO-2 P + G/N + O/N;  ZeRO-3 (P + G + O)/N
// and nothing more than the slack of the layout: a rank's pieces differ from
// 1/N of a bucket by at most one element (a shard buffer and the optimizer
// state may be that much over or under), two staging arrays of N floats per
// bucket, and at most one partial page per bucket boundary in a released
// buffer. ZeRO-1 and -2 keep no copy of their pieces: they step them where
// they lie in the flat buffers.
Status CheckMemory(ZeroStage stage, int n, const std::string& address, int rank) {
  openblas_set_num_threads(1);
  ESTUARY_ASSIGN_OR_RETURN(auto comm, comm::ConnectGloo({.address = address, .rank = rank, .size = n, .timeout = 60s},
                                                  {.host = "127.0.0.1"}));
  const int batch = 4;
  ESTUARY_ASSIGN_OR_RETURN(Net net, Net::Make("llama-big", 1, batch));
  DataParallelOptions options{.stage = stage, .broadcast_parameters = false};
  ESTUARY_ASSIGN_OR_RETURN(auto dp, DataParallel::Create(*comm, net, options));
  Optimizer opt(true);
  for (int step = 0; step < 2; ++step) {
    const Batch data = net.MakeBatch(batch, 7 + step);
    const auto [lo, hi] = Split(batch, rank, n);
    ESTUARY_ASSIGN_OR_RETURN(float loss, net.Run(data, lo, hi, dp->MicroBatch(double(hi - lo) / batch, true)));
    (void)loss;
    ESTUARY_ASSIGN_OR_RETURN(auto r, dp->Step([&](auto slices) { opt.Step(slices); }));
    (void)r;
  }
  ESTUARY_ASSIGN_OR_RETURN(MemoryUse m, dp->Memory(opt.state_bytes()));

  const double P = double(net.parameters().size_bytes()), G = P, O = 2 * P;
  const double buckets = double(dp->buckets().size());
  const double page = double(models::PageSize());
  const double pad = buckets * sizeof(float);        // per shard buffer
  const double page_slack = (buckets + 1) * page;    // per released buffer
  const double staging = stage == ZeroStage::kDdp ? 0 : buckets * 2 * n * sizeof(float);
  double params = P, grads = G, shard_p = 0, shard_g = 0, optimizer = O / n;
  double params_slack = 0, grads_slack = 0;
  switch (stage) {
    case ZeroStage::kDdp: optimizer = O; break;
    case ZeroStage::kZero1: break;
    case ZeroStage::kZero2: grads = 0, shard_g = G / n; grads_slack = page_slack; break;
    case ZeroStage::kZero3:
      params = grads = 0, shard_p = P / n, shard_g = G / n;
      params_slack = grads_slack = page_slack;
      break;
  }
  // Resident pages only ever add to a buffer; a rank's share of the remainders may also take from it.
  auto within = [](double measured, double want, double over, double under = 0) {
    return measured >= want - under - 1 && measured <= want + over + 1;
  };
  const std::string name(ZeroStageName(stage));
  const double formula = stage == ZeroStage::kDdp     ? P + G + O
                         : stage == ZeroStage::kZero1 ? P + G + O / n
                         : stage == ZeroStage::kZero2 ? P + G / n + O / n
                                                      : (P + G + O) / n;
  if (rank == 0) {
    std::printf("memory %-5s N=%d rank 0: params %8zu grads %8zu shard %8zu+%-8zu optimizer %8zu staging %5zu "
                "total %8zu  formula %8.0f\n",
                name.c_str(), n, m.parameters, m.gradients, m.shard_parameters, m.shard_gradients,
                m.optimizer_state, m.staging, m.total(), formula);
  }
  CHECK_OR_RETURN(within(double(m.parameters), params, params_slack), "{} N={} rank {}: parameters {} want {} + {}",
                  name, n, rank, m.parameters, params, params_slack);
  CHECK_OR_RETURN(within(double(m.gradients), grads, grads_slack), "{} N={} rank {}: gradients {} want {} + {}",
                  name, n, rank, m.gradients, grads, grads_slack);
  CHECK_OR_RETURN(within(double(m.shard_parameters), shard_p, shard_p ? pad : 0), "{} N={}: shard params {} want {}",
                  name, n, m.shard_parameters, shard_p);
  CHECK_OR_RETURN(within(double(m.shard_gradients), shard_g, shard_g ? pad : 0), "{} N={}: shard grads {} want {}",
                  name, n, m.shard_gradients, shard_g);
  const double state_pad = stage == ZeroStage::kDdp ? 0 : 2 * pad;
  CHECK_OR_RETURN(within(double(m.optimizer_state), optimizer, state_pad, state_pad),
                  "{} N={} rank {}: optimizer state {} want {}", name, n, rank, m.optimizer_state, optimizer);
  CHECK_OR_RETURN(double(m.staging) <= staging, "{} N={}: staging {} over {}", name, n, m.staging,
                  staging);
  // Reading the model out (a federated update) under ZeRO-3 holds at most
  // two units at a time: the one handed out and the next one, in flight.
  if (stage == ZeroStage::kZero3) {
    size_t peak = 0, largest = 0;
    for (const auto& u : net.units()) largest = std::max<size_t>(largest, (u.end - u.begin) * sizeof(float));
    ESTUARY_RETURN_IF_ERROR(dp->ForEachSlice([&](uint64_t, std::span<const float>) -> Status {
      ESTUARY_ASSIGN_OR_RETURN(MemoryUse now, dp->Memory());
      peak = std::max(peak, now.parameters);
      return Status::Ok();
    }));
    CHECK_OR_RETURN(double(peak) <= 2 * double(largest) + params_slack,
                    "zero3 N={}: {} parameter bytes resident while reading out, over two units ({} each) + {}", n,
                    peak, largest, params_slack);
    CHECK_OR_RETURN(peak < size_t(P) || n == 1 || net.units().size() <= 2,
                    "zero3 N={}: reading out materialised the model ({} bytes)", n, peak);
  }
  // The formula, with only the layout's slack stated above.
  const double slack = params_slack + grads_slack + 4 * pad + staging;
  CHECK_OR_RETURN(within(double(m.total()), formula, slack, state_pad),
                  "{} N={} rank {}: {} bytes, formula {} + slack {}", name, n, rank, m.total(), formula, slack);
  return Status::Ok();
}

class MemoryTest : public ::testing::TestWithParam<std::tuple<ZeroStage, int>> {};

TEST_P(MemoryTest, FollowsZeroAccounting) {
  const auto [stage, n] = GetParam();
  const std::string address = FreeTcpAddress();
  ExpectAllOk(RunRanks(n, [&](int rank) { return CheckMemory(stage, n, address, rank); }, 300s));
}

std::string StageAndRanks(const ::testing::TestParamInfo<std::tuple<ZeroStage, int>>& info) {
  return fmt::format("{}_n{}", ZeroStageName(std::get<0>(info.param)), std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(PerRank, MemoryTest,
                         ::testing::Combine(::testing::Values(ZeroStage::kDdp, ZeroStage::kZero1, ZeroStage::kZero2,
                                                              ZeroStage::kZero3),
                                            ::testing::Values(1, 2, 4)),
                         StageAndRanks);

// ---- a rank that dies mid-step ----------------------------------------------

// The last rank's process exits in the middle of the second step's backward
// (DDP: after a few buckets were launched; ZeRO-3: while a unit is gathered);
// the others must get a failed Step naming the trouble, within the timeout.
class DiesMidStep : public models::StepHooks {
 public:
  DiesMidStep(models::StepHooks* inner, bool die) : inner_(inner), die_(die) {}
  void BeforeUnit(int u, models::Pass p) override {
    if (die_ && p == models::Pass::kBackward) _exit(7);
    inner_->BeforeUnit(u, p);
  }
  void AfterUnit(int u, models::Pass p) override { inner_->AfterUnit(u, p); }
  void GradientsFinal(uint64_t offset) override {
    inner_->GradientsFinal(offset);
    if (die_ && ++calls_ == 2) _exit(7);
  }

 private:
  models::StepHooks* inner_;
  bool die_;
  int calls_ = 0;
};

constexpr auto kTimeout = 5s;

Status DieMidStep(ZeroStage stage, int n, const std::string& address, int rank) {
  openblas_set_num_threads(1);
  ESTUARY_ASSIGN_OR_RETURN(auto comm, comm::ConnectGloo({.address = address, .rank = rank, .size = n, .timeout = kTimeout},
                                                  {.host = "127.0.0.1"}));
  ESTUARY_ASSIGN_OR_RETURN(Net net, Net::Make("llama", 1, 4));
  DataParallelOptions options{.stage = stage, .bucket_bytes = 4096, .first_bucket_bytes = 4096};
  ESTUARY_ASSIGN_OR_RETURN(auto dp, DataParallel::Create(*comm, net, options));
  models::Sgd opt(0.1f, 0, 0);
  for (int step = 0; step < 2; ++step) {
    const Batch data = net.MakeBatch(4, step);
    const auto [lo, hi] = Split(4, rank, n);
    auto o = dp->MicroBatch(double(hi - lo) / 4, true);
    DiesMidStep hooks(o.hooks, step == 1 && rank == n - 1);
    o.hooks = &hooks;
    const auto start = Clock::now();
    auto loss = net.Run(data, lo, hi, o);
    if (!loss.ok()) return loss.status();
    auto r = dp->Step([&](auto slices) { opt.Step(slices); });
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
    if (step == 0) {
      if (!r.ok()) return r.status();
      continue;
    }
    CHECK_OR_RETURN(!r.ok(), "rank {}: a step with a dead rank succeeded", rank);
    CHECK_OR_RETURN(ms < 2 * std::chrono::milliseconds(kTimeout).count(), "rank {}: failing took {} ms", rank, ms);
    std::printf("rank %d failed after %lld ms: %s\n", rank, static_cast<long long>(ms),
                r.status().ToString().c_str());
  }
  return Status::Ok();
}

class DeadRankTest : public ::testing::TestWithParam<std::tuple<ZeroStage, int>> {};

TEST_P(DeadRankTest, OthersFailWithinTimeout) {
  const auto [stage, n] = GetParam();
  const std::string address = FreeTcpAddress();
  const auto outcomes = RunRanks(n, [&](int rank) { return DieMidStep(stage, n, address, rank); }, 120s);
  for (const auto& o : outcomes) {
    if (o.rank == n - 1) {
      EXPECT_EQ(o.exit_code, 7) << o.Describe();
    } else {
      EXPECT_TRUE(o.ok()) << o.Describe() << " (its message is above)";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Gloo, DeadRankTest,
                         ::testing::Combine(::testing::Values(ZeroStage::kDdp, ZeroStage::kZero3),
                                            ::testing::Values(2, 4)),
                         StageAndRanks);

// ---- the schedule --------------------------------------------------------------

// One rank that records every collective with the model's hooks in one log,
// so a test can see when each collective was launched relative to backward.
struct Log {
  std::vector<std::string> events;
  const float* params = nullptr;
  const float* grads = nullptr;
};

class DoneWork : public comm::Work {
 public:
  Status Wait() override { return Status::Ok(); }
};

class RecordingCommunicator : public comm::Communicator {
 public:
  explicit RecordingCommunicator(Log& log) : log_(log) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Device device() const override { return Device::kCpu; }
  std::string_view backend() const override { return "recording"; }
  std::unique_ptr<comm::Work> AllReduce(std::span<float> data, comm::ReduceOp) override {
    Record("all-reduce", data.data());
    return std::make_unique<DoneWork>();
  }
  std::unique_ptr<comm::Work> AllReduce(std::span<double>, comm::ReduceOp) override { return std::make_unique<DoneWork>(); }
  std::unique_ptr<comm::Work> ReduceScatter(std::span<const float> in, std::span<float> out, comm::ReduceOp) override {
    Record("reduce-scatter", in.data());
    std::memcpy(out.data(), in.data(), out.size_bytes());
    return std::make_unique<DoneWork>();
  }
  std::unique_ptr<comm::Work> AllGather(std::span<const float> in, std::span<float> out) override {
    Record("all-gather", out.data());
    std::memcpy(out.data(), in.data(), in.size_bytes());
    return std::make_unique<DoneWork>();
  }
  std::unique_ptr<comm::Work> Broadcast(std::span<float>, int) override { return std::make_unique<DoneWork>(); }
  std::unique_ptr<comm::Work> Broadcast(std::span<std::byte>, int) override { return std::make_unique<DoneWork>(); }
  std::unique_ptr<comm::Work> Barrier() override { return std::make_unique<DoneWork>(); }

 private:
  void Record(const char* what, const float* at) {
    const float* base = std::string_view(what) == "all-gather" ? log_.params : log_.grads;
    log_.events.push_back(fmt::format("{} {}", what, at - base));
  }
  Log& log_;
};

class RecordingHooks : public models::StepHooks {
 public:
  RecordingHooks(models::StepHooks* inner, Log& log) : inner_(inner), log_(log) {}
  void BeforeUnit(int u, models::Pass p) override {
    log_.events.push_back(fmt::format("before {}", u));
    if (inner_) inner_->BeforeUnit(u, p);
  }
  void AfterUnit(int u, models::Pass p) override {
    if (inner_) inner_->AfterUnit(u, p);
  }
  void GradientsFinal(uint64_t offset) override {
    log_.events.push_back(fmt::format("final {}", offset));
    if (inner_) inner_->GradientsFinal(offset);
  }

 private:
  models::StepHooks* inner_;
  Log& log_;
};

// Runs two steps of the untied decoder and returns the second step's log.
Result<std::vector<std::string>> Schedule(ZeroStage stage, std::vector<std::pair<uint64_t, uint64_t>>* buckets,
                                          std::vector<models::ParameterUnit>* units) {
  Log log;
  RecordingCommunicator comm(log);
  ESTUARY_ASSIGN_OR_RETURN(Net net, Net::Make("llama", 1, 4));
  log.params = net.parameters().data();
  log.grads = net.gradients().data();
  const DataParallelOptions options{.stage = stage, .bucket_bytes = 3000, .first_bucket_bytes = 1000};
  ESTUARY_ASSIGN_OR_RETURN(auto dp, DataParallel::Create(comm, net, options));
  *buckets = dp->buckets();
  *units = net.units();
  models::Sgd opt(0.1f, 0, 0);
  for (int step = 0; step < 2; ++step) {
    log.events.clear();
    const Batch data = net.MakeBatch(4, step);
    auto o = dp->MicroBatch(1.0, true);
    RecordingHooks hooks(o.hooks, log);
    o.hooks = &hooks;
    ESTUARY_ASSIGN_OR_RETURN(float loss, net.Run(data, 0, 4, o));
    (void)loss;
    ESTUARY_ASSIGN_OR_RETURN(auto r, dp->Step([&](auto slices) { opt.Step(slices); }));
    (void)r;
  }
  return log.events;
}

// Each bucket's reduction is launched by the first GradientsFinal whose
// watermark is at or below the bucket's start — during backward, not after it.
TEST(DataParallelSchedule, ReductionsStartAsSoonAsTheirGradientsAreFinal) {
  for (ZeroStage stage : {ZeroStage::kDdp, ZeroStage::kZero1, ZeroStage::kZero2, ZeroStage::kZero3}) {
    std::vector<std::pair<uint64_t, uint64_t>> buckets;
    std::vector<models::ParameterUnit> units;
    auto events = Schedule(stage, &buckets, &units);
    ASSERT_TRUE(events.ok()) << events.status().ToString();
    const std::string op = stage == ZeroStage::kDdp ? "all-reduce" : "reduce-scatter";
    uint64_t watermark = UINT64_MAX, previous = UINT64_MAX;  // the last two GradientsFinal offsets
    size_t next = 0, finals_after_first_launch = 0;
    for (const std::string& e : *events) {
      if (e.rfind("final ", 0) == 0) {
        previous = watermark;
        watermark = std::stoull(e.substr(6));
        if (next > 0) ++finals_after_first_launch;
        continue;
      }
      if (e.rfind(op + " ", 0) != 0) continue;
      ASSERT_LT(next, buckets.size());
      const uint64_t begin = buckets[next].first;
      EXPECT_EQ(std::stoull(e.substr(op.size() + 1)), begin) << "bucket " << next << " out of order";
      EXPECT_LE(watermark, begin) << "bucket " << next << " launched before its gradients were final";
      EXPECT_GT(previous, begin) << "bucket " << next << " was final a hook earlier than it was launched";
      ++next;
    }
    EXPECT_EQ(next, buckets.size()) << "every bucket reduced once";
    EXPECT_GT(finals_after_first_launch, 0u) << "the first reduction was launched only after backward";
  }
}

// ZeRO-3 gathers the unit the model opens next while the current one
// computes: after the first step (which records the order), no unit but the
// first of a pass waits for a gather launched inside its own BeforeUnit.
TEST(DataParallelSchedule, ZeroThreePrefetchesTheNextUnit) {
  std::vector<std::pair<uint64_t, uint64_t>> buckets;
  std::vector<models::ParameterUnit> units;
  auto events = Schedule(ZeroStage::kZero3, &buckets, &units);
  ASSERT_TRUE(events.ok()) << events.status().ToString();
  int on_demand = 0, befores = 0;
  for (size_t i = 0; i + 1 < events->size(); ++i) {
    if ((*events)[i].rfind("before ", 0) != 0) continue;
    ++befores;
    const int u = std::stoi((*events)[i].substr(7));
    if ((*events)[i + 1] == fmt::format("all-gather {}", units[u].begin)) ++on_demand;
  }
  EXPECT_GT(befores, int(units.size()));
  EXPECT_EQ(on_demand, 1) << "only the step's first unit is gathered on demand";
}

// ---- one process -------------------------------------------------------------

// A model that reads its parameters without opening units (LoraLlama) cannot
// run under ZeRO-3, whose parameters are released between units: the step
// fails with one line instead of stepping on what it computed from zeros.
TEST(DataParallelLocal, ZeroThreeRefusesAModelThatOpensNoUnit) {
  const std::string address = FreeTcpAddress();
  ExpectAllOk(RunRanks(1, [&](int) -> Status {
    ESTUARY_ASSIGN_OR_RETURN(auto comm, comm::ConnectGloo({.address = address, .rank = 0, .size = 1}, {.host = "127.0.0.1"}));
    ESTUARY_ASSIGN_OR_RETURN(Net net, Net::Make("lora", 1, 2));
    ESTUARY_ASSIGN_OR_RETURN(auto dp, DataParallel::Create(*comm, net, {.stage = ZeroStage::kZero3}));
    const Batch b = net.MakeBatch(2, 7);
    ESTUARY_RETURN_IF_ERROR(net.Run(b, 0, 2, dp->MicroBatch(1.0, true)).status());
    auto step = dp->Step([](auto) {});
    CHECK_OR_RETURN(!step.ok() && step.status().message().find("opened no unit") != std::string::npos,
                    "ZeRO-3 over LoraLlama: {}", step.ok() ? "stepped" : step.status().message());
    return Status::Ok();
  }));
}

// Over a communicator of one rank (what a single-process LoRA site trains
// over) DataParallel is the plain step: after three AdamW steps under DDP and
// ZeRO-1 the parameters are bit for bit those of the optimizer stepping the
// model directly.
TEST(DataParallelLocal, OverASoloCommunicatorItIsThePlainStep) {
  auto comm = comm::MakeSoloCommunicator(Device::kCpu);
  for (const char* name : {"lora", "mlp"}) {
    for (ZeroStage stage : {ZeroStage::kDdp, ZeroStage::kZero1}) {
      SCOPED_TRACE(fmt::format("{} under {}", name, ZeroStageName(stage)));
      auto plain = Net::Make(name, 4, 3);
      auto wrapped = Net::Make(name, 4, 3);
      ASSERT_TRUE(plain.ok() && wrapped.ok());
      const DataParallelOptions options{.stage = stage, .first_bucket_bytes = 4096, .broadcast_parameters = false};
      auto dp = DataParallel::Create(*comm, *wrapped, options);
      ASSERT_TRUE(dp.ok()) << dp.status().ToString();
      Optimizer direct(true), through(true);
      for (int step = 0; step < 3; ++step) {
        const Batch b = plain->MakeBatch(3, 10 + step);
        ASSERT_TRUE(plain->Run(b, 0, 3, {}).ok());
        direct.Step(plain->parameters(), plain->gradients());
        ASSERT_TRUE(wrapped->Run(b, 0, 3, (*dp)->MicroBatch(1.0, true)).ok());
        auto stepped = (*dp)->Step([&](auto slices) { through.Step(slices); });
        ASSERT_TRUE(stepped.ok()) << stepped.status().ToString();
      }
      const std::span<const float> want = plain->parameters(), got = wrapped->parameters();
      EXPECT_TRUE(std::equal(want.begin(), want.end(), got.begin(), got.end()));
    }
  }
  // Its copies are host copies; on a GPU only the in-place collectives apply.
  std::vector<float> in = {1, 2, 3}, out(3);
  EXPECT_TRUE(comm->ReduceScatter(in, out, comm::ReduceOp::kSum)->Wait().ok());
  EXPECT_EQ(out, in);
  Status refused = comm::MakeSoloCommunicator(Device::kCuda)->AllGather(in, out)->Wait();
  EXPECT_NE(refused.message().find("solo all-gather: one rank on a GPU"), std::string::npos) << refused.ToString();
}

TEST(DataParallelLocal, BucketsAreSlicesFromTheEnd) {
  const std::string address = FreeTcpAddress();
  ExpectAllOk(RunRanks(1, [&](int) -> Status {
    ESTUARY_ASSIGN_OR_RETURN(auto comm, comm::ConnectGloo({.address = address, .rank = 0, .size = 1}, {.host = "127.0.0.1"}));
    ESTUARY_ASSIGN_OR_RETURN(Net net, Net::Make("mlp", 1, 1));
    const uint64_t p = net.parameters().size();
    const DataParallelOptions options{.bucket_bytes = 400000, .first_bucket_bytes = 4000};
    ESTUARY_ASSIGN_OR_RETURN(auto dp, DataParallel::Create(*comm, net, options));
    const auto b = dp->buckets();
    CHECK_OR_RETURN(b.size() == 3, "{} buckets for {} parameters", b.size(), p);
    CHECK_OR_RETURN(b[0].second == p && b[0].first == p - 1000, "first bucket [{}, {})", b[0].first, b[0].second);
    CHECK_OR_RETURN(b[1].second == b[0].first && b[1].first == b[0].first - 100000, "second bucket [{}, {})",
                    b[1].first, b[1].second);
    CHECK_OR_RETURN(b[2].first == 0 && b[2].second == b[1].first, "last bucket [{}, {})", b[2].first, b[2].second);
    auto step = dp->Step([](auto) {});
    CHECK_OR_RETURN(!step.ok() && step.status().code() == Code::kFailedPrecondition,
                    "Step with no micro-batch: {}", step.status().ToString());
    return Status::Ok();
  }));
}

}  // namespace
}  // namespace estuary::parallel
