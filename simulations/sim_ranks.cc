#include "simulations/sim_ranks.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "proto/wire.h"
#include "simulations/runner.h"

#if ESTUARY_HAVE_MPI
// The C API only: the deprecated C++ bindings would need libmpi_cxx.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace estuary::simulations {

bool SimRanks::LaunchedByMpi() {
  // Open MPI's mpirun, and the PMI launchers (MPICH's hydra, Slurm's srun).
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    if (std::getenv(name) != nullptr) return true;
  }
  return false;
}

Status CheckMpiScenario(const Scenario& s, bool async, const std::string& scenario) {
  auto refuse = [](std::string_view what) {
    return FailedPrecondition("sim: {} is not supported under mpirun (run it in one process)", what);
  };
  if (!scenario.empty()) return refuse(fmt::format("--scenario {}", scenario));
  if (s.mode != "inproc") return refuse(fmt::format("--mode {}", s.mode));
  if (async) return refuse("--async");
  if (s.secagg) return refuse("--secagg");
  // SCAFFOLD's c_i live with the sites across rounds, and a site may train on another rank next round.
  if (s.federation.strategy().name() == "scaffold") return refuse("--strategy scaffold");
  if (s.device != "cpu") return refuse(fmt::format("--device {} (every rank would train on the same GPU)", s.device));
  return Status::Ok();
}

#if ESTUARY_HAVE_MPI

namespace {

constexpr int kUpdateTag = 1;
// MPI counts are ints: bigger buffers travel in pieces of this many bytes.
constexpr size_t kPiece = size_t{1} << 30;

void BroadcastBytes(void* data, size_t bytes) {
  auto* at = static_cast<char*>(data);
  for (size_t done = 0; done < bytes; done += kPiece) {
    MPI_Bcast(at + done, int(std::min(kPiece, bytes - done)), MPI_BYTE, 0, MPI_COMM_WORLD);
  }
}
void SendBytes(const void* data, size_t bytes) {
  const auto* at = static_cast<const char*>(data);
  for (size_t done = 0; done < bytes; done += kPiece) {
    MPI_Send(at + done, int(std::min(kPiece, bytes - done)), MPI_BYTE, 0, kUpdateTag, MPI_COMM_WORLD);
  }
}
void ReceiveBytes(void* data, size_t bytes, int from) {
  auto* at = static_cast<char*>(data);
  for (size_t done = 0; done < bytes; done += kPiece) {
    MPI_Recv(at + done, int(std::min(kPiece, bytes - done)), MPI_BYTE, from, kUpdateTag, MPI_COMM_WORLD,
             MPI_STATUS_IGNORE);
  }
}

// An update's header as bytes. Every rank runs the same build on the same
// architecture (mpirun starts one binary), so numbers travel as they lie in memory.
class Writer {
 public:
  template <typename T>
  void Put(T value) {
    out_.append(reinterpret_cast<const char*>(&value), sizeof value);
  }
  void Put(const std::string& text) {
    Put(uint64_t(text.size()));
    out_ += text;
  }
  std::string& bytes() { return out_; }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  template <typename T>
  bool Get(T& value) {
    if (in_.size() < sizeof value) return false;
    std::memcpy(&value, in_.data(), sizeof value);
    in_.remove_prefix(sizeof value);
    return true;
  }
  bool Get(std::string& text) {
    uint64_t size = 0;
    if (!Get(size) || in_.size() < size) return false;
    text.assign(in_.substr(0, size));
    in_.remove_prefix(size);
    return true;
  }
  bool done() const { return in_.empty(); }

 private:
  std::string_view in_;
};

}  // namespace

Result<std::unique_ptr<SimRanks>> SimRanks::Join(int* argc, char*** argv) {
  // Training runs on threads of its own; only the main thread calls MPI.
  int provided = 0;
  if (MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
    return Internal("sim: MPI_Init failed");
  }
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return std::unique_ptr<SimRanks>(new SimRanks(rank, size));
}

SimRanks::~SimRanks() { MPI_Finalize(); }

Status SimRanks::Settle(const Status& mine) {
  const int failing = mine.ok() ? size_ : rank_;
  int lowest = size_;
  MPI_Allreduce(&failing, &lowest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (lowest == size_) {
    state_ = State::kRunning;
    return Status::Ok();
  }
  state_ = State::kStopped;
  // The lowest failing rank's line, to every rank.
  int code = int(mine.code());
  std::string message = rank_ == lowest ? mine.message() : std::string();
  uint64_t length = message.size();
  MPI_Bcast(&code, 1, MPI_INT, lowest, MPI_COMM_WORLD);
  MPI_Bcast(&length, 1, MPI_UINT64_T, lowest, MPI_COMM_WORLD);
  message.resize(length);
  MPI_Bcast(message.data(), int(length), MPI_CHAR, lowest, MPI_COMM_WORLD);
  if (!mine.ok()) return mine;
  return Status(Code(code), fmt::format("rank {}: {}", lowest, message));
}

Result<RoundOrder> SimRanks::ShareOrder(const RoundOrder& order) {
  uint64_t head[2] = {order.round, order.sites.size()};
  MPI_Bcast(head, 2, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  RoundOrder out{.round = head[0], .sites = rank_ == 0 ? order.sites : std::vector<uint64_t>(head[1])};
  BroadcastBytes(out.sites.data(), out.sites.size() * sizeof(uint64_t));
  if (rank_ == 0) bytes_ += uint64_t(size_ - 1) * (sizeof head + out.sites.size() * sizeof(uint64_t));
  return out;
}

Status SimRanks::ShareGlobal(std::span<float> global) {
  BroadcastBytes(global.data(), global.size_bytes());
  if (rank_ == 0) bytes_ += uint64_t(size_ - 1) * global.size_bytes();
  return Status::Ok();
}

Status SimRanks::SendUpdate(const Result<client::Update>& update) {
  Writer header;
  header.Put(uint8_t(update.ok()));
  if (!update.ok()) {
    header.Put(int32_t(update.status().code()));
    header.Put(update.status().message());
  } else if (update->stream) {
    // The simulator's sites are processes of one rank; a ZeRO-3 site's streamed update never reaches here.
    Abort(Internal("sim: a streamed update cannot travel between ranks"));
  } else {
    const client::Update& u = update.value();
    header.Put(uint8_t(u.kind));
    header.Put(u.num_examples);
    header.Put(u.train_loss);
    header.Put(u.seconds);
    header.Put(u.local_steps);
    header.Put(u.normalizer);
    header.Put(u.trained_on);
    header.Put(proto::ToProto(u.manifest).SerializeAsString());
    header.Put(uint64_t(u.payload.size()));
    header.Put(uint64_t(u.control_delta.size()));
  }
  SendBytes(header.bytes().data(), header.bytes().size());
  if (update.ok()) {
    SendBytes(update->payload.data(), update->payload.size() * sizeof(float));
    SendBytes(update->control_delta.data(), update->control_delta.size() * sizeof(float));
  }
  return Status::Ok();
}

Result<client::Update> SimRanks::ReceiveUpdate(int from) {
  MPI_Status probe;
  MPI_Probe(from, kUpdateTag, MPI_COMM_WORLD, &probe);
  int size = 0;
  MPI_Get_count(&probe, MPI_BYTE, &size);
  std::string bytes(size_t(size), '\0');
  MPI_Recv(bytes.data(), size, MPI_BYTE, from, kUpdateTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  bytes_ += bytes.size();
  // A header this build cannot read leaves its payload unread in the channel: nothing after it can be trusted.
  auto unreadable = [&] { Abort(Internal("sim: rank {} sent an update header this rank cannot read", from)); };
  Reader in(bytes);
  uint8_t ok = 0;
  if (!in.Get(ok)) unreadable();
  if (!ok) {
    int32_t code = 0;
    std::string message;
    if (!in.Get(code) || !in.Get(message) || !in.done()) unreadable();
    return Status(Code(code), message);
  }
  client::Update u;
  uint8_t kind = 0;
  std::string manifest;
  uint64_t payload = 0, control = 0;
  if (!in.Get(kind) || !in.Get(u.num_examples) || !in.Get(u.train_loss) || !in.Get(u.seconds) ||
      !in.Get(u.local_steps) || !in.Get(u.normalizer) || !in.Get(u.trained_on) || !in.Get(manifest) ||
      !in.Get(payload) || !in.Get(control) || !in.done()) {
    unreadable();
  }
  v1::Manifest wire;
  if (!wire.ParseFromString(manifest)) unreadable();
  auto layout = proto::FromProto(wire, Manifest::kMaxElements);
  if (!layout.ok() || layout->total_elements != payload || (control != 0 && control != payload)) unreadable();
  u.kind = client::UpdateKind(kind);
  u.manifest = std::move(*layout);
  u.payload.resize(payload);
  u.control_delta.resize(control);
  ReceiveBytes(u.payload.data(), payload * sizeof(float), from);
  ReceiveBytes(u.control_delta.data(), control * sizeof(float), from);
  bytes_ += (payload + control) * sizeof(float);
  ++updates_by_rank_[size_t(from)];
  return u;
}

void SimRanks::Close() {
  if (rank_ != 0) return;
  if (state_ == State::kSetup) {
    (void)Settle(Aborted("rank 0 failed before the first round"));
  } else if (state_ == State::kRunning) {
    (void)ShareOrder(RoundOrder{});
  }
  state_ = State::kStopped;
}

void SimRanks::Abort(const Status& why) {
  std::fprintf(stderr, "estuary-sim: rank %d: %s\n", rank_, why.message().c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();  // MPI_Abort does not return
}

#else  // a build without MPI: one process, and a refusal under mpirun

Result<std::unique_ptr<SimRanks>> SimRanks::Join(int*, char***) {
  return FailedPrecondition("sim: started by an MPI launcher, but this estuary-sim was built without MPI (install "
                            "libopenmpi-dev and rebuild)");
}
SimRanks::~SimRanks() = default;
Status SimRanks::Settle(const Status& mine) { return mine; }
Result<RoundOrder> SimRanks::ShareOrder(const RoundOrder& order) { return order; }
Status SimRanks::ShareGlobal(std::span<float>) { return Status::Ok(); }
Status SimRanks::SendUpdate(const Result<client::Update>&) { return Internal("sim: no MPI in this build"); }
Result<client::Update> SimRanks::ReceiveUpdate(int) { return Internal("sim: no MPI in this build"); }
void SimRanks::Close() {}
void SimRanks::Abort(const Status& why) {
  std::fprintf(stderr, "estuary-sim: %s\n", why.message().c_str());
  std::exit(1);
}

#endif

}  // namespace estuary::simulations
