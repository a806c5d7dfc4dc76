#include "tests/server/fakes.h"

#include <algorithm>

#include "crypto/transfer_digest.h"
#include "models/federated_model.h"
#include "proto/frame.h"
#include "proto/wire.h"

namespace estuary::server::fake {

class FakeClock::FakeTimer final : public Timer {
 public:
  explicit FakeTimer(FakeClock& clock) : clock_(clock) {}
  ~FakeTimer() override { Cancel(); }

  void Arm(std::chrono::steady_clock::duration delay, std::function<void()> fire) override {
    fire_ = std::move(fire);
    clock_.due_[this] = clock_.now_ + delay;
  }
  void Cancel() override {
    clock_.due_.erase(this);
    fire_ = nullptr;
  }
  void Fire() {
    auto fire = std::move(fire_);
    fire_ = nullptr;
    fire();
  }

 private:
  FakeClock& clock_;
  std::function<void()> fire_;
};

std::unique_ptr<Timer> FakeClock::MakeTimer() { return std::make_unique<FakeTimer>(*this); }

void FakeClock::Advance(std::chrono::steady_clock::duration by) {
  const auto until = now_ + by;
  for (;;) {
    FakeTimer* next = nullptr;
    for (const auto& [timer, at] : due_) {
      if (at <= until && (!next || at < due_[next])) next = timer;
    }
    if (!next) break;
    now_ = std::max(now_, due_[next]);
    due_.erase(next);
    next->Fire();  // may arm timers again, or cancel others
  }
  now_ = until;
}

size_t Executors::RunUntilIdle() {
  size_t total = 0;
  for (;;) {
    worker.restart();
    size_t ran = worker.poll();
    io.restart();
    ran += io.poll();
    if (ran == 0) return total;
    total += ran;
  }
}

CoordinatorRig::CoordinatorRig() {
  config.listen = "127.0.0.1:0";
  config.db = dir / "rounds.db";
  config.rounds = 3;
  config.clients_per_round = 2;
  config.min_clients = 2;
  config.min_updates = 1;
  config.round_deadline_s = 60;
  v1::TaskConfig& task = *config.federation.mutable_task();
  task.set_model("mlp");
  task.set_epochs(1);
  task.set_batch_size(32);
  task.set_learning_rate(0.1f);
  task.set_seq_len(128);
}

Status CoordinatorRig::Start() {
  ESTUARY_RETURN_IF_ERROR(config.Finalize());
  ESTUARY_ASSIGN_OR_RETURN(store, Store::Open(config.db));
  if (config.mode == "async") {
    async = std::make_unique<AsyncCoordinator>(config, *store, clock, executors.io.get_executor(),
                                               executors.worker.get_executor());
  } else {
    coordinator = std::make_unique<Coordinator>(config, *store, clock, executors.io.get_executor(),
                                                executors.worker.get_executor());
  }
  ESTUARY_RETURN_IF_ERROR(driver().Recover());
  ESTUARY_ASSIGN_OR_RETURN(auto initial, models::InitialModel(config.federation.task().model(), config.federation.task().seed()));
  manifest_ = initial.manifest;
  initial_ = std::make_shared<const std::vector<float>>(std::move(initial.values));
  return Status::Ok();
}

std::shared_ptr<FakeSession> CoordinatorRig::Connect(const std::string& name, const std::string& serial,
                                                     bool keeps_model, bool evaluates) {
  auto session = std::make_shared<FakeSession>(name, serial);
  session->on_closed = [this](ClientSession& closed) { driver().OnClosed(closed); };
  v1::Hello hello;
  hello.set_protocol_version(proto::kProtocolVersion);
  hello.set_keeps_model(keeps_model);
  hello.set_evaluates(evaluates);
  driver().OnHello(session, hello);
  return session;
}

void CoordinatorRig::FinishDownloads(const std::vector<std::shared_ptr<FakeSession>>& sessions) {
  for (bool any = true; any;) {
    any = false;
    for (const auto& session : sessions) {
      if (!session->downloading()) continue;
      session->FinishDownload();
      any = true;
    }
  }
}

void CoordinatorRig::Begin(const std::shared_ptr<FakeSession>& session, uint64_t round, uint64_t examples,
                           double loss) {
  v1::Envelope begin;
  begin.mutable_update_begin()->set_round(round);
  begin.mutable_update_begin()->set_kind(v1::UPDATE_FULL);
  begin.mutable_update_begin()->set_num_examples(examples);
  begin.mutable_update_begin()->set_train_loss(loss);
  *begin.mutable_update_begin()->mutable_manifest() = proto::ToProto(manifest_);
  if (trained_from) begin.mutable_update_begin()->set_trained_from_version(*trained_from);
  driver().OnMessage(session, begin);
}

void CoordinatorRig::SendChunks(const std::shared_ptr<FakeSession>& session, uint64_t round,
                                const std::vector<float>& delta, std::optional<size_t> chunks) {
  const char* bytes = reinterpret_cast<const char*>(delta.data());
  const uint64_t size = delta.size() * sizeof(float);
  constexpr uint64_t kChunk = 64 << 10;
  size_t sent = 0;
  for (uint64_t offset = 0; offset < size && (!chunks || sent < *chunks); offset += kChunk, ++sent) {
    v1::Envelope chunk;
    chunk.mutable_update_chunk()->set_round(round);
    chunk.mutable_update_chunk()->set_offset(offset);
    chunk.mutable_update_chunk()->set_dtype(v1::DTYPE_F32);
    chunk.mutable_update_chunk()->set_data(bytes + offset, std::min(kChunk, size - offset));
    driver().OnMessage(session, chunk);
  }
}

void CoordinatorRig::Commit(const std::shared_ptr<FakeSession>& session, uint64_t round,
                            const std::vector<float>& delta) {
  v1::Envelope commit;
  commit.mutable_update_commit()->set_round(round);
  commit.mutable_update_commit()->set_digest(crypto::TransferDigestHex(delta.data(), delta.size() * sizeof(float)));
  driver().OnMessage(session, commit);
}

void CoordinatorRig::Upload(const std::shared_ptr<FakeSession>& session, uint64_t round,
                            const std::vector<float>& delta, uint64_t examples, double loss) {
  Begin(session, round, examples, loss);
  SendChunks(session, round, delta);
  Commit(session, round, delta);
}

}  // namespace estuary::server::fake
