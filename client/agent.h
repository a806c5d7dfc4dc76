// Agent: the client's end of the connection to the aggregation server.
//
// It connects over mutual TLS (checking the server's certificate against the
// federation CA and the host name), says Hello, and then follows the server:
// on RoundStart it receives the global model (unless it already holds that
// version), trains on the training executor (never on the I/O thread, so
// heartbeats keep flowing), streams the update back as chunks encoded one at
// a time, and commits it. An update that comes as an UpdateStream (a ZeRO-3
// site's) is run on the training executor and its slices are encoded as the
// socket drains, so the delta is never whole in this process. A RoundStart
// with a patch sends only the ranges that changed since the version held
// (a lora federation's adapter and the base weights a merge changed); the
// rest comes from the model held, and the transfer digest (XXH3-128) is
// checked over the whole.
// A RoundStart with a SecAggSetup makes the site take part in SecAgg+
// instead of uploading in the clear (agent_secagg.cc, client/secagg_site.h).
// A RoundStart with evaluate_only has the trainer score the model on the
// site's held-out examples (Trainer::Evaluate) and answers with an
// EvalReport instead of an update; its Hello says it understands them.
// A RoundStart with control_follows (SCAFFOLD) sends the server's control
// variate c after the model (or alone, when the site holds the model),
// checked against its own digest; the site trains through its SiteControl
// (AgentOptions::scaffold) and uploads Δc_i after its delta in the same
// upload (agent_download.cc).
// When the connection drops it reconnects with
// exponential backoff, until the server announces the federation complete.
// Every stage of a connection has a deadline (AgentOptions); one that passes
// counts as a dropped connection. A server whose certificate fails our check
// (not signed by the CA, not the server's role, not for the host dialled,
// revoked) is never retried: the agent finishes with that error and has sent
// it nothing. One that is only expired or not yet valid is retried.
// Everything except training runs on the io_context given to it; many agents
// may share one io_context (the loopback simulator does).
#pragma once

#include "base/asio.h"
#include <chrono>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "crypto/tls_socket.h"
#include "client/scaffold.h"
#include "client/secagg_site.h"
#include "client/trainer.h"
#include "crypto/sha256.h"
#include "crypto/transfer_digest.h"
#include "crypto/tls.h"
#include "estuary.pb.h"
#include "proto/frame.h"
#include "models/hf_base.h"
#include "models/low_rank.h"
#include "models/tensor.h"

namespace estuary::client {

// Where a site stops in a SecAgg+ round (AgentOptions::secagg_drop), the
// stages of the in-process simulation (simulations/secagg_round.h): before
// advertising its keys (on RoundStart), after advertising them (on the keys
// broadcast), after sharing its keys (on its share inbox), and after sending
// its masked input (on the survivor set: its input is in the sum, its
// signature and unmasking answer missing).
enum class SecAggDrop { kNone, kBeforeAdvertise, kAfterAdvertise, kAfterShare, kAfterMaskedInput };

// Where a site stops in a round without secure aggregation
// (AgentOptions::upload_drop), the stages of the in-process simulation
// (simulations/dropout_draw.h): after training, before it begins its upload;
// and mid-upload, once half of its update's bytes are written and before its
// commit, so that the server holds a partial upload to discard.
enum class UploadDrop { kNone, kAfterTraining, kMidUpload };

struct AgentOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 7443;
  std::shared_ptr<boost::asio::ssl::context> tls;
  // When set, presented on every connection instead of the context's own
  // certificate (many simulated sites sharing one context).
  std::shared_ptr<const crypto::Identity> identity;
  double initial_backoff_s = 0.25;
  double max_backoff_s = 30;
  uint32_t chunk_bytes = proto::kDefaultChunkBytes;  // upper bound; the server's Welcome may lower it
  uint64_t max_frame_bytes = 64u << 20;
  std::string label;                 // for logs before the server names us
  // Keep the global model after training, so a reconnect in the same round
  // needs no download. A simulator with many agents turns it off: otherwise
  // it holds one model per client, O(clients x model).
  bool keep_model = true;
  // Seconds each stage may take before the agent gives the connection up
  // with one line naming the stage and the server, and reconnects after its
  // backoff. read: the longest silence from the server once connected (at
  // least three of the heartbeat intervals it asks for; it echoes ours);
  // write: one frame. While an upload awaits the server's answer both
  // stretch past the round's deadline: the server reads nothing from a site
  // whose upload waits for a staging slot.
  double resolve_timeout_s = 10;
  double connect_timeout_s = 10;
  double handshake_timeout_s = 10;
  double read_timeout_s = 60;
  double write_timeout_s = 60;
  // This site's copy of a Hugging Face base (estuary-client --base-model).
  // A round whose task names a base (TaskConfig.hf_base) is trained only when
  // this copy's shape and identity are the task's; otherwise the agent sends
  // a SiteRefusal naming both identities and finishes with that line. A
  // patch on the base (RoundStart.patch_on_base) is applied to this copy.
  std::shared_ptr<const models::HfBase> base;
  // The model this site trains, when it knows it ("custom@..." of its own
  // layout): a round whose task names another is refused in one line, as a
  // base that differs is. Empty: whatever the task names.
  std::string expected_model;
  // A SecAgg+ round (RoundStart.secagg): where the site keeps a copy of the
  // quantised input it masked (SecAggSite::MaskedInput); empty: nowhere.
  std::filesystem::path secagg_keep_dir;
  // A simulated dropout in SecAgg+ rounds (estuary-sim --dropout in loopback
  // mode): asked once per secure round with the round, this site's protocol
  // id and the round's site count; the agent closes its connection at the
  // stage returned, as a site that died there would, and reconnects after its
  // backoff for the rounds that follow. Empty: the site never drops on purpose.
  std::function<SecAggDrop(uint64_t round, uint32_t site, uint32_t sites)> secagg_drop;
  // A simulated dropout in rounds without secure aggregation (estuary-sim
  // --dropout in loopback mode): asked once per trained round with the round
  // and this site's name (the server's); the agent closes its connection at
  // the stage returned and reconnects after its backoff. Empty: never.
  std::function<UploadDrop(uint64_t round, const std::string& site)> upload_drop;
  // SCAFFOLD: this site's control variate c_i (in memory, or a file of the
  // site's state directory), used by the rounds whose RoundStart says
  // control_follows. Null: such a round is refused in one line, and the
  // agent finishes with it.
  std::shared_ptr<SiteControl> scaffold;
};

class Agent : public std::enable_shared_from_this<Agent> {
 public:
  using Executor = boost::asio::any_io_executor;
  Agent(boost::asio::io_context& io, AgentOptions options, Trainer& trainer, Executor training);

  void Start();
  // Closes the connection and stops reconnecting.
  void Stop();
  // Gives up for good: closes the connection (the server records this site
  // as dropped from a round in progress) and reports status through
  // on_finished. For a failure outside the Agent, such as a multi-rank site
  // that lost a rank. Call it on the I/O thread.
  void Fail(const Status& status) { Finish(status); }

  // Called on the I/O thread each time the server welcomes this site: its
  // TLS handshake and Hello went through (a load generator paces its
  // connections by it, bench/connections).
  std::function<void()> on_welcome;
  // Called on the I/O thread for every RoundClosed the server broadcasts.
  std::function<void(const v1::RoundClosed&)> on_round_closed;
  // Called once: ok when the federation completed, an error when the agent
  // gave up (the server refused us for good).
  std::function<void(const Status&)> on_finished;

  const std::string& name() const { return name_; }
  uint64_t rounds_trained() const { return rounds_trained_; }

 private:
  // OpenSSL on the socket itself (crypto/tls_socket.h): a frame's records
  // are read in one completion, not one by one between every connection.
  using SslStream = crypto::TlsSocket;

  using Clock = std::chrono::steady_clock;

  void Connect();
  // Gives the connection up if the stage ("connect to", ...) outlasts `seconds`.
  void ArmStage(const char* stage, const std::string& peer, double seconds);
  // The latest moment a read or write begun now may end, for a timeout of
  // `seconds` (stretched while an upload awaits the server).
  Clock::time_point Patience(double seconds) const;
  void ArmRead();
  std::string Peer() const;  // "host:port"
  void OnConnected();
  void ReadHeader();
  void Dispatch(v1::Envelope envelope);
  void OnRoundStart(const v1::RoundStart& start);
  void OnModelChunk(const v1::ModelChunk& chunk);
  // SCAFFOLD (agent_download.cc): why this site will not train a round whose
  // RoundStart sends c (empty: it will); then, for such a round, makes ready
  // to receive c once the model is in.
  std::string RefusalOfControl(const v1::RoundStart& start, const std::string& site) const;
  void ExpectControl(const v1::RoundStart& start);
  void OnModelBytes(const v1::ModelChunk& chunk);
  void OnControlBytes(const v1::ModelChunk& chunk);
  // Adds every low-rank change, its factors received, to the held tensor.
  void ApplyLowRank();
  // Trains the round's model, or scores it in an evaluation round (agent_work.cc).
  void Train();
  void OnTrained(uint64_t round, Result<Update> update);
  void OnEvaluated(uint64_t round, Result<Evaluation> evaluation);
  void Send(const v1::Envelope& envelope);
  void WriteNext();
  // The next frame of a streamed upload, or nothing while its slice is pending.
  void NextStreamChunk();
  // Runs a stream nobody will upload (cancelled), so the site's ranks finish its gathers.
  void Discard(const std::shared_ptr<UpdateStream>& stream);
  void DropUpload();
  // A simulated dropout (options.upload_drop, agent_drop.cc): whether the
  // site stops after training `round` (its connection closed); otherwise
  // sets where a mid-upload stop cuts `update`'s upload.
  bool DropsAfterTraining(uint64_t round, const Update& update);
  // Whether the upload has reached that cut with every frame written (the
  // connection then closed).
  bool DropsMidUpload();
  void Disconnected(const std::string& reason);
  void Revoked(const std::string& detail);
  void ScheduleReconnect();
  void Heartbeat();
  void Finish(const Status& status);
  // Tells the server why this site will not train `round`, then finishes
  // with that reason when the server, having read it, closes the connection.
  void Refuse(uint64_t round, const std::string& reason);

  // SecAgg+ (agent_secagg.cc): the round's protocol instead of an upload.
  // StartSecAgg sends the site's keys when the RoundStart carries a setup;
  // the server's stage messages are answered as they come, and the masked
  // input goes once both the update and the share inbox are in.
  Status StartSecAgg(const v1::RoundStart& start);
  void OnSecAgg(const v1::Envelope& envelope);
  void SecAggTrained(Update update);
  void MaybeSendMaskedInput();
  void MaskNextSecAggFrame();

  boost::asio::io_context& io_;
  AgentOptions options_;
  Trainer& trainer_;
  Executor training_;
  std::shared_ptr<SslStream> stream_;  // handlers hold it, so a replaced stream outlives its last handler
  boost::asio::ip::tcp::resolver resolver_;
  boost::asio::steady_timer reconnect_timer_;
  boost::asio::steady_timer heartbeat_timer_;
  boost::asio::steady_timer stage_timer_;  // resolve, connect, handshake
  boost::asio::steady_timer read_timer_;
  boost::asio::steady_timer write_timer_;
  Clock::time_point last_frame_;     // when the server last sent a frame (or we connected)
  bool awaiting_answer_ = false;     // an upload begun on this connection and not yet answered
  bool welcomed_ = false;            // the server's Welcome came on this connection
  Clock::time_point round_deadline_;  // the round's deadline on our clock
  uint64_t connection_ = 0;  // bumps on every (re)connect; stale handlers check it
  int failures_ = 0;
  bool stopped_ = false;
  bool finished_ = false;
  std::optional<Status> finish_when_written_;  // Refuse: finish when the connection ends
  std::string name_;
  uint32_t chunk_bytes_;
  uint64_t heartbeat_ms_ = 5000;

  std::array<uint8_t, 4> header_{};
  proto::BodyBuffer body_;
  std::deque<std::shared_ptr<const proto::Frame>> outbox_;
  bool writing_ = false;

  // The global model we hold (shared with the training thread, never copied)
  // and the round we work on.
  std::shared_ptr<const std::vector<float>> model_;
  uint64_t model_version_ = 0;
  std::string model_checksum_;
  std::optional<v1::RoundStart> round_;
  uint64_t round_connection_ = 0;  // the connection round_ arrived on; an update goes back on the same one
  Manifest manifest_;
  std::vector<float> incoming_;
  uint64_t incoming_offset_ = 0;  // bytes: where the next chunk must start
  // The byte ranges [begin, end) still to come: the whole model, or a patch's
  // ranges over the model held (the bytes between them are digested as held).
  std::vector<std::pair<uint64_t, uint64_t>> incoming_ranges_;
  size_t incoming_range_ = 0;
  // A patch's low-rank changes (offset, shape; their factors arrive in
  // incoming_factors_, past the buffer's end): added to the held tensors once
  // everything is in, and only then is the model digested.
  std::vector<std::pair<uint64_t, models::LowRankMatrix>> incoming_low_rank_;
  std::vector<float> incoming_factors_;
  // SCAFFOLD: the round's c as it arrives (digested on its own, after the
  // model), then, checked, what the round trains with; null: no c this round.
  std::vector<float> incoming_control_;
  uint64_t control_received_ = 0;  // bytes
  std::unique_ptr<crypto::TransferDigest> control_digest_;
  std::shared_ptr<const std::vector<float>> control_;
  bool busy_training_ = false;
  bool train_again_ = false;
  uint64_t rounds_trained_ = 0;

  // The update being uploaded: chunks are encoded lazily from here.
  std::shared_ptr<const Update> upload_;
  uint64_t upload_round_ = 0;
  uint64_t upload_offset_ = 0;
  UpdateStream::Slice slice_;  // streamed upload: the slice being encoded
  uint64_t slice_at_ = 0;      // elements of slice_ already sent
  std::unique_ptr<crypto::TransferDigest> download_digest_;
  std::unique_ptr<crypto::TransferDigest> upload_digest_;  // the update's, as its chunks are encoded
  // A simulated mid-upload dropout: the byte offset the upload stops at (none: the maximum).
  uint64_t upload_drop_at_ = UINT64_MAX;

  std::shared_ptr<SecAggSite> secagg_;  // this round's, on this connection
  SecAggDrop secagg_drop_ = SecAggDrop::kNone;  // where this round's site closes its connection (options.secagg_drop)
  std::optional<Update> secagg_update_;  // trained, waiting for the share inbox
  bool secagg_masking_ = false;          // a frame of its masked input is being masked on the training executor
  std::shared_ptr<const Update> secagg_upload_;  // its masked input being streamed, frame by frame
  bool secagg_upload_begun_ = false;             // its opening chunk has been made
};

}  // namespace estuary::client
