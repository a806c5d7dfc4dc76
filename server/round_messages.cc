#include "server/round_messages.h"

#include "proto/frame.h"
#include "proto/wire.h"

namespace estuary::server {

v1::Envelope WelcomeMessage(const std::string& client, const ServerConfig& config) {
  v1::Envelope envelope;
  auto* welcome = envelope.mutable_welcome();
  welcome->set_protocol_version(proto::kProtocolVersion);
  welcome->set_client_name(client);
  welcome->set_max_frame_bytes(config.max_frame_bytes);
  welcome->set_chunk_bytes(config.chunk_bytes);
  welcome->set_heartbeat_ms(config.heartbeat_ms);
  return envelope;
}

v1::Envelope FederationCompleteMessage(uint64_t rounds, const GlobalModel& model) {
  v1::Envelope done;
  done.mutable_round_closed()->set_round(rounds);
  done.mutable_round_closed()->set_committed(true);
  done.mutable_round_closed()->set_model_version(model.version);
  done.mutable_round_closed()->set_model_checksum(model.checksum);
  done.mutable_round_closed()->set_federation_complete(true);
  return done;
}

v1::Envelope RoundStartMessage(uint64_t round, const GlobalModel& model, const Manifest& manifest,
                               const v1::TaskConfig& task, int64_t deadline_unix_ms) {
  v1::Envelope envelope;
  auto* start = envelope.mutable_round_start();
  start->set_round(round);
  start->set_model_version(model.version);
  start->set_model_checksum(model.checksum);
  *start->mutable_manifest() = proto::ToProto(manifest);
  *start->mutable_task() = task;
  start->set_deadline_unix_ms(deadline_unix_ms);
  return envelope;
}

v1::Envelope UpdateAckMessage(uint64_t round, const Status& folded) {
  v1::Envelope envelope;
  envelope.mutable_update_ack()->set_round(round);
  envelope.mutable_update_ack()->set_accepted(folded.ok());
  envelope.mutable_update_ack()->set_detail(folded.ok() ? "" : folded.message());
  return envelope;
}

v1::Envelope RoundCommittedMessage(const RoundRecord& record, double seconds, uint64_t bytes_per_update,
                                   uint64_t merge_bytes_down, bool federation_complete) {
  v1::Envelope envelope;
  auto* closed = envelope.mutable_round_closed();
  closed->set_round(record.round);
  closed->set_committed(true);
  closed->set_model_version(record.model_version);
  closed->set_model_checksum(record.global_checksum);
  closed->set_clients_selected(record.clients_selected);
  closed->set_updates_received(record.updates_received);
  closed->set_train_loss(record.train_loss);
  closed->set_has_test_metrics(record.test_accuracy.has_value());
  if (record.test_accuracy) {
    closed->set_test_accuracy(*record.test_accuracy);
    closed->set_test_loss(record.test_loss.value_or(0));
  }
  closed->set_seconds(seconds);
  closed->set_bytes_up(record.bytes_up);
  closed->set_bytes_down(record.bytes_down);
  closed->set_bytes_per_update(bytes_per_update);
  closed->set_merge_bytes_down(merge_bytes_down);
  closed->set_federation_complete(federation_complete);
  return envelope;
}

v1::Envelope RoundFailedMessage(const RoundRecord& record, const GlobalModel& model, const std::string& reason) {
  v1::Envelope envelope;
  auto* closed = envelope.mutable_round_closed();
  closed->set_round(record.round);
  closed->set_committed(false);
  closed->set_model_version(model.version);
  closed->set_model_checksum(model.checksum);
  closed->set_clients_selected(record.clients_selected);
  closed->set_updates_received(record.updates_received);
  closed->set_detail(reason);
  return envelope;
}

}  // namespace estuary::server
