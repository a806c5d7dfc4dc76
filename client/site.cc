#include "client/site.h"

#include <spdlog/spdlog.h>

#include <chrono>

#include "client/local_work.h"

namespace estuary::client {

namespace {

Status Await(std::unique_ptr<comm::Work> work) { return work->Wait(); }

// ---- what rank 0 tells the others -------------------------------------------

// Every message starts with a header of this size; a round's header is
// followed by its v1::SiteRound (bytes) and the global weights (floats).
enum Kind : uint32_t { kIdle = 1, kRound = 2, kDone = 3, kAbort = 4 };
constexpr uint32_t kMagic = 0x45535452;  // "ESTR": a follower built from another binary fails at once
struct Header {
  uint32_t magic = kMagic;
  uint32_t kind = kIdle;
  uint64_t length = 0;  // bytes that follow
};
static_assert(sizeof(Header) == 16);

}  // namespace

// ---- rank 0 -------------------------------------------------------------------

SiteTrainer::SiteTrainer(comm::Communicator& comm, std::unique_ptr<RankTrainer> rank, parallel::ZeroStage stage,
                         Compute compute)
    : comm_(comm), rank_(std::move(rank)), stage_(stage), compute_(compute) {}

SiteTrainer::SiteTrainer(std::unique_ptr<comm::Communicator> solo, std::unique_ptr<RankTrainer> rank,
                         parallel::ZeroStage stage, Compute compute)
    : owned_(std::move(solo)), comm_(*owned_), rank_(std::move(rank)), stage_(stage), compute_(compute) {}

std::string SiteTrainer::TrainedOn() const {
  const RankModel* model = rank_->trained();
  const std::string note = model ? model->note() : std::string();
  return fmt::format("{}{} on {} in {}, {} rank{} ({}, {})", model ? model->engine() : "no model",
                     note.empty() ? "" : fmt::format(" ({})", note),
                     compute_.device == Device::kCuda ? fmt::format("cuda:{}", compute_.device_index) : "cpu",
                     DTypeName(model ? model->precision() : compute_.precision), comm_.size(),
                     comm_.size() == 1 ? "" : "s", comm_.backend(), parallel::ZeroStageName(stage_));
}

void SiteTrainer::RunPending() {
  if (pending_ && !pending_->started()) {
    pending_->Cancel();
    pending_->Run();
  }
  pending_.reset();
}

Status SiteTrainer::SendHeader(uint32_t kind, uint64_t length) {
  Header header{kMagic, kind, length};
  return Await(comm_.Broadcast(std::as_writable_bytes(std::span<Header>(&header, 1)), 0));
}

Status SiteTrainer::Broken(Status status) {
  if (broken_.ok()) {
    broken_ = status;
    if (on_broken) on_broken(broken_);
  }
  return broken_;
}

Result<Update> SiteTrainer::Train(std::span<const float> global, const Manifest& manifest,
                                  const v1::TaskConfig& from_server, uint64_t round, std::string_view client_name) {
  RunPending();
  ESTUARY_RETURN_IF_ERROR(broken_);
  if (finished_) return FailedPrecondition("site: the federation is over");
  // The task as this site trains it, which its other ranks are sent: the
  // server's, under this site's own time cap when that is tighter.
  v1::TaskConfig sent = from_server;
  if (max_local_seconds_ > 0 && (sent.max_local_seconds() == 0 || max_local_seconds_ < sent.max_local_seconds())) {
    sent.set_max_local_seconds(max_local_seconds_);
  }
  ESTUARY_ASSIGN_OR_RETURN(const TaskConfig task, TaskFromProto(sent));
  // A task this site cannot train fails here, before the other ranks hear of
  // it, like a task a single process cannot train: the site carries on.
  ESTUARY_RETURN_IF_ERROR(rank_->Check(task, manifest, global.size()));
  const auto start = std::chrono::steady_clock::now();
  // The other ranks hear of the round and get its weights; a broadcast takes
  // a mutable buffer, so they go out of a copy, which the ranks then train
  // from. A site of one rank trains from the caller's buffer: no copy.
  std::vector<float> sent_weights;
  std::span<const float> weights = global;
  if (comm_.size() > 1) {
    v1::SiteRound site_round;
    site_round.set_round(round);
    site_round.set_client_name(std::string(client_name));
    *site_round.mutable_task() = sent;
    site_round.set_global_size(global.size());
    std::string message = site_round.SerializeAsString();
    sent_weights.assign(global.begin(), global.end());
    if (Status s = SendHeader(kRound, message.size()); !s.ok()) return Broken(s);
    if (Status s = Await(comm_.Broadcast(std::as_writable_bytes(std::span<char>(message)), 0)); !s.ok()) {
      return Broken(s);
    }
    if (Status s = Await(comm_.Broadcast(std::span<float>(sent_weights), 0)); !s.ok()) return Broken(s);
    weights = sent_weights;
  }
  // After the broadcast the others are in this round too: any failure leaves
  // them somewhere in it, so the site cannot go on.
  Result<double> loss = rank_->TrainRound(weights, task, round, client_name);
  if (!loss.ok()) return Broken(loss.status());

  if (stage_ != parallel::ZeroStage::kZero3) {  // a lora round never runs under ZeRO-3 (Check)
    std::vector<float> trained(rank_->TrainedSize(task, global.size()));
    Status read = rank_->ReadOut([&](uint64_t offset, std::span<const float> values) {
      if (offset > trained.size() || values.size() > trained.size() - offset) {
        return Internal("site: trained values [{}, {}) overrun the {} expected", offset, offset + values.size(),
                        trained.size());
      }
      std::copy(values.begin(), values.end(), trained.begin() + offset);
      return Status::Ok();
    });
    if (!read.ok()) return Broken(read);
    Result<Update> update = rank_->UpdateOf(std::move(trained), global, manifest, task, *loss, start, round);
    if (update.ok()) {
      update->trained_on = TrainedOn();
      update->local_steps = rank_->steps();
      update->normalizer = FedNovaNormalizer(task, update->local_steps);
    }
    return update;
  }

  // ZeRO-3: the delta leaves unit by unit, as the Agent uploads it, taken
  // against the global weights it keeps.
  if (sent_weights.empty()) sent_weights.assign(global.begin(), global.end());
  auto stream = std::make_shared<UpdateStream>(
      [this, global = std::move(sent_weights)](UpdateStream& out) {
        Status cancelled;
        Status read = rank_->ReadOut([&](uint64_t offset, std::span<const float> values) {
          UpdateStream::Slice slice{offset, std::vector<float>(values.begin(), values.end())};
          for (size_t i = 0; i < values.size(); ++i) slice.values[i] -= global[offset + i];
          cancelled = out.Push(std::move(slice));
          return cancelled;
        });
        // A cancelled stream (the connection dropped) fails on this rank only,
        // after every gather ran; anything else is a collective failure.
        if (!read.ok() && read.message() != cancelled.message()) return Broken(read);
        return read;
      });
  pending_ = stream;
  Result<Update> trained = TrainedUpdate(UpdateKind::kFull, rank_->num_examples(), *loss, round);
  if (!trained.ok()) {
    RunPending();  // the other ranks are in the read-out; end it with them
    return trained.status();
  }
  Update update = std::move(trained).value();
  update.manifest = manifest;
  update.stream = std::move(stream);
  update.trained_on = TrainedOn();
  update.local_steps = rank_->steps();
  update.normalizer = FedNovaNormalizer(task, update.local_steps);
  update.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return update;
}

Result<Update> SiteTrainer::TrainControlled(std::span<const float> global, const Manifest& manifest,
                                            const v1::TaskConfig& task, uint64_t round, std::string_view client_name,
                                            std::span<const float> control, std::span<const float> site_control) {
  if (comm_.size() > 1) {
    return FailedPrecondition("site: SCAFFOLD's gradient correction runs on a site of one rank for now; this one "
                              "has {}",
                              comm_.size());
  }
  if (control.size() != global.size() || site_control.size() != global.size()) {
    return InvalidArgument("site: control variates of {} and {} values for a model of {}", control.size(),
                           site_control.size(), global.size());
  }
  rank_->SetControl(control, site_control);
  Result<Update> update = Train(global, manifest, task, round, client_name);
  rank_->SetControl({}, {});
  return update;
}

Status SiteTrainer::KeepAlive() {
  // While an update streams the others are in its gathers, not waiting for a header.
  if (finished_ || (pending_ && !pending_->started())) return Status::Ok();
  ESTUARY_RETURN_IF_ERROR(broken_);
  if (Status s = SendHeader(kIdle, 0); !s.ok()) return Broken(s);
  return Status::Ok();
}

Status SiteTrainer::Finish(const Status& outcome) {
  if (finished_) return Status::Ok();
  RunPending();
  finished_ = true;
  ESTUARY_RETURN_IF_ERROR(broken_);
  if (outcome.ok()) return SendHeader(kDone, 0);
  std::string reason = outcome.message();
  ESTUARY_RETURN_IF_ERROR(SendHeader(kAbort, reason.size()));
  return Await(comm_.Broadcast(std::as_writable_bytes(std::span<char>(reason)), 0));
}

// ---- every other rank ---------------------------------------------------------

Status RunFollower(comm::Communicator& comm, RankTrainer& rank) {
  std::vector<float> global;
  for (;;) {
    Header header;
    ESTUARY_RETURN_IF_ERROR(Await(comm.Broadcast(std::as_writable_bytes(std::span<Header>(&header, 1)), 0)));
    if (header.magic != kMagic) return ProtocolError("site rank {}: rank 0 sent a header without the site's magic", comm.rank());
    std::vector<std::byte> bytes(header.length);
    if (header.length > 0) ESTUARY_RETURN_IF_ERROR(Await(comm.Broadcast(std::span<std::byte>(bytes), 0)));
    switch (header.kind) {
      case kIdle: continue;
      case kDone: return Status::Ok();
      case kAbort:
        return Aborted("site rank {}: rank 0 gave up: {}", comm.rank(),
                       std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
      case kRound: break;
      default: return ProtocolError("site rank {}: unknown message kind {} from rank 0", comm.rank(), header.kind);
    }
    v1::SiteRound m;
    if (!m.ParseFromArray(bytes.data(), int(bytes.size()))) {
      return ProtocolError("site rank {}: rank 0's round message of {} bytes does not parse", comm.rank(),
                           bytes.size());
    }
    ESTUARY_ASSIGN_OR_RETURN(const TaskConfig task, TaskFromProto(m.task()));
    global.resize(m.global_size());
    ESTUARY_RETURN_IF_ERROR(Await(comm.Broadcast(std::span<float>(global), 0)));
    spdlog::debug("site rank {}: round {} for {}", comm.rank(), m.round(), m.client_name());
    auto loss = rank.TrainRound(global, task, m.round(), m.client_name());
    if (!loss.ok()) return loss.status();
    ESTUARY_RETURN_IF_ERROR(rank.ReadOut([](uint64_t, std::span<const float>) { return Status::Ok(); }));
  }
}

// ---- a site of one process ---------------------------------------------------

Result<std::unique_ptr<SiteTrainer>> MakeLocalSite(SiteData data, const LocalSiteOptions& options) {
  ESTUARY_RETURN_IF_ERROR(CheckStageOn(options.compute, options.stage));
  auto solo = comm::MakeSoloCommunicator(options.compute.device);
  RankModels models = options.compute.device == Device::kCuda ? CudaModels(options.compute, /*stream=*/nullptr)
                                                               : RankModels{};
  models.cache = options.cache;
  models.lora_rank = options.lora_rank;
  models.lora_base = options.lora_base;
  models.recompute = options.recompute;
  parallel::DataParallelOptions dp;
  dp.stage = options.stage;
  std::unique_ptr<RankTrainer> rank =
      data.instructions ? MakeInstructionRankTrainer(*solo, std::move(data.instructions), dp, std::move(models))
      : data.text       ? MakeTextRankTrainer(*solo, std::move(data.text), dp, std::move(models))
                        : MakeClassifierRankTrainer(*solo, std::move(data.images), std::move(data.indices), dp,
                                                    std::move(models));
  return std::make_unique<SiteTrainer>(std::move(solo), std::move(rank), options.stage, options.compute);
}

}  // namespace estuary::client
