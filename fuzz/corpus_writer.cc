// Writes the fuzz targets' seed corpora with the project's own writers: real
// frames (EncodeFrame and the chunk encoders), manifests (ToProto), model
// patches (WriteModelPatch), safetensors files (SaveCheckpoint), a Hugging
// Face model and a PEFT adapter (SaveHfCheckpoint, SaveLoraAdapter), IDX files
// (WriteIdx), federation files (WriteFederationFile) and CRLs issued by the
// federation CA code (RenewCrl, RevokeCertificate), plus a few edge cases per
// target. CRLs are signed by fuzz/crl_ca, which is made once and kept.
//   build-fuzz/fuzz/corpus_writer fuzz/corpus
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "aggregation/federation.h"
#include "crypto/certs.h"
#include "crypto/revocation.h"
#include "crypto/sha256.h"
#include "crypto/transfer_digest.h"
#include "fuzz/fuzz_util.h"
#include "fuzz/tiny_models.h"
#include "models/checkpoint.h"
#include "models/dataset.h"
#include "proto/frame.h"
#include "proto/model_patch.h"
#include "proto/wire.h"
#include "secagg/client.h"
#include "secagg/server.h"
#include "secagg/wire.h"

namespace estuary::fuzz {
namespace {

namespace fs = std::filesystem;

void Check(const Status& status) {
  if (!status.ok()) {
    std::fprintf(stderr, "corpus_writer: %s\n", status.ToString().c_str());
    std::exit(1);
  }
}

std::string ReadAll(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) Check(IoError("{}: cannot read", path.string()));
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

class Corpus {
 public:
  explicit Corpus(fs::path root) : root_(std::move(root)) {}
  void Add(const std::string& target, const std::string& name, const std::string& bytes) {
    std::error_code ec;
    fs::create_directories(root_ / target, ec);
    Check(WriteFileAtomically(root_ / target / name, bytes));
  }

 private:
  fs::path root_;
};

std::string Bytes(const proto::Frame& frame) { return {reinterpret_cast<const char*>(frame.data()), frame.size()}; }
std::string FrameOf(const proto::Envelope& envelope) { return Bytes(proto::EncodeFrame(envelope)); }

// A small model's layout: two dense layers.
Manifest SmallManifest() {
  Manifest m;
  m.Append("fc1.weight", {16, 8});
  m.Append("fc1.bias", {16});
  m.Append("fc2.weight", {4, 16});
  m.Append("fc2.bias", {4});
  return m;
}

std::vector<float> Values(uint64_t n, float scale) {
  std::vector<float> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = scale * float(int64_t(i % 17) - 8);
  return v;
}

std::string AsBytes(const std::vector<float>& v) {
  return {reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float)};
}

v1::RoundStart SmallRoundStart() {
  v1::RoundStart start;
  start.set_round(3);
  start.set_model_version(2);
  start.set_model_checksum(crypto::Sha256Hex("", 0));
  *start.mutable_manifest() = proto::ToProto(SmallManifest());
  *start.mutable_task() = aggregation::DefaultFederation().task();
  start.set_deadline_unix_ms(1700000000000);
  start.set_model_follows(true);
  return start;
}

void Frames(Corpus& corpus) {
  proto::Envelope e;
  e.mutable_hello()->set_protocol_version(proto::kProtocolVersion);
  e.mutable_hello()->set_client_version("0.1.0");
  e.mutable_hello()->set_num_examples(6000);
  e.mutable_hello()->set_model_version_held(2);
  e.mutable_hello()->set_model_checksum_held(crypto::Sha256Hex("x", 1));
  e.mutable_hello()->set_keeps_model(true);
  corpus.Add("frame", "hello", FrameOf(e));
  e.Clear();
  e.mutable_welcome()->set_protocol_version(proto::kProtocolVersion);
  e.mutable_welcome()->set_client_name("site-1");
  e.mutable_welcome()->set_max_frame_bytes(proto::kDefaultMaxFrameBytes);
  e.mutable_welcome()->set_chunk_bytes(proto::kDefaultChunkBytes);
  e.mutable_welcome()->set_heartbeat_ms(5000);
  corpus.Add("frame", "welcome", FrameOf(e));
  e.Clear();
  v1::RoundStart start = SmallRoundStart();
  proto::ModelPatch patch;
  patch.ranges = {{128, 16}, {208, 4}};
  patch.low_rank = {{.offset = 0, .rows = 16, .cols = 8, .rank = 2}};
  proto::WriteModelPatch(patch, &start);
  start.set_patch_base_version(1);
  *e.mutable_round_start() = start;
  corpus.Add("frame", "round_start_patch", FrameOf(e));
  const std::vector<float> values = Values(SmallManifest().total_elements, 0.25f);
  corpus.Add("frame", "model_chunk", Bytes(proto::EncodeModelChunk(3, 64, values.data() + 16, 64)));
  e.Clear();
  auto& begin = *e.mutable_update_begin();
  begin.set_round(3);
  begin.set_kind(v1::UPDATE_FULL);
  begin.set_num_examples(600);
  begin.set_train_loss(0.75);
  begin.set_train_seconds(1.5);
  *begin.mutable_manifest() = proto::ToProto(SmallManifest());
  corpus.Add("frame", "update_begin", FrameOf(e));
  corpus.Add("frame", "update_chunk", Bytes(proto::EncodeUpdateChunk(3, 0, v1::DTYPE_F32, values.data(), 64)));
  e.Clear();
  e.mutable_update_commit()->set_round(3);
  e.mutable_update_commit()->set_digest(crypto::TransferDigestHex(values.data(), values.size() * sizeof(float)));
  corpus.Add("frame", "update_commit", FrameOf(e));
  e.Clear();
  e.mutable_update_ack()->set_round(3);
  e.mutable_update_ack()->set_accepted(true);
  e.mutable_update_ack()->set_detail("folded");
  corpus.Add("frame", "update_ack", FrameOf(e));
  e.Clear();
  auto& closed = *e.mutable_round_closed();
  closed.set_round(3);
  closed.set_committed(true);
  closed.set_model_version(3);
  closed.set_model_checksum(crypto::Sha256Hex("y", 1));
  closed.set_clients_selected(2);
  closed.set_updates_received(2);
  closed.set_train_loss(0.5);
  closed.set_has_test_metrics(true);
  closed.set_test_accuracy(0.9);
  closed.set_test_loss(0.3);
  closed.set_bytes_up(1 << 20);
  closed.set_federation_complete(true);
  corpus.Add("frame", "round_closed", FrameOf(e));
  e.Clear();
  e.mutable_heartbeat()->set_sent_unix_ms(1700000000000);
  corpus.Add("frame", "heartbeat", FrameOf(e));
  e.Clear();
  e.mutable_error()->set_code(v1::Error::BAD_CHUNK);
  e.mutable_error()->set_message("chunk: offset 4 but the next expected byte is 0");
  corpus.Add("frame", "error", FrameOf(e));
  // Edge cases: a zero length, a length past every limit, an empty envelope,
  // a field of no known message.
  corpus.Add("frame", "edge_zero_length", std::string(4, '\0'));
  corpus.Add("frame", "edge_huge_length", std::string("\xff\xff\xff\xff\x0a\x00", 6));
  corpus.Add("frame", "edge_empty_envelope", std::string("\x00\x00\x00\x00", 4));
  corpus.Add("frame", "edge_unknown_field", std::string("\x00\x00\x00\x03\x62\x01\x00", 7));
}

// An upload as frames: begin, the payload in chunks of `chunk` bytes, commit.
std::string Upload(const Manifest& manifest, size_t chunk, bool right_digest) {
  proto::Envelope e;
  auto& begin = *e.mutable_update_begin();
  begin.set_round(5);
  begin.set_kind(v1::UPDATE_FULL);
  begin.set_num_examples(100);
  begin.set_train_loss(1.25);
  *begin.mutable_manifest() = proto::ToProto(manifest);
  std::string out = FrameOf(e);
  const std::string payload = AsBytes(Values(manifest.byte_size() / sizeof(float), 0.125f));
  for (size_t at = 0; at < payload.size(); at += chunk) {
    const size_t n = std::min(chunk, payload.size() - at);
    out += Bytes(proto::EncodeUpdateChunk(5, at, v1::DTYPE_F32, payload.data() + at, n));
  }
  e.Clear();
  e.mutable_update_commit()->set_round(5);
  e.mutable_update_commit()->set_digest(right_digest ? crypto::TransferDigestHex(payload.data(), payload.size())
                                                     : crypto::TransferDigestHex("", 0));
  return out + FrameOf(e);
}

void Uploads(Corpus& corpus) {
  corpus.Add("upload", "small_two_chunks", Upload(SmallManifest(), 512, true));
  corpus.Add("upload", "small_wrong_digest", Upload(SmallManifest(), 400, false));
  Manifest large;  // past the harness's 1 KiB memory budget: a spill file
  large.Append("embedding.weight", {24, 12});
  large.Append("head.weight", {12});
  corpus.Add("upload", "spilled", Upload(large, 512, true));
  Manifest mixed = SmallManifest();  // a bf16 tensor in the layout
  mixed.tensors[1].dtype = DType::kBF16;
  corpus.Add("upload", "bf16_tensor", Upload(mixed, 256, true));
  // Chunks out of order (the second one first), and chunks with no begin.
  std::vector<std::string> frames;
  const std::string ordered = Upload(SmallManifest(), 512, true);
  for (size_t at = 0; at < ordered.size();) {
    const size_t n = 4 + ((size_t(uint8_t(ordered[at])) << 24) | (size_t(uint8_t(ordered[at + 1])) << 16) |
                          (size_t(uint8_t(ordered[at + 2])) << 8) | size_t(uint8_t(ordered[at + 3])));
    frames.push_back(ordered.substr(at, n));
    at += n;
  }
  corpus.Add("upload", "edge_out_of_order", frames[0] + frames[2] + frames[1] + frames[3]);
  corpus.Add("upload", "edge_no_begin", frames[1] + frames[2] + frames[3]);
}

void RoundStarts(Corpus& corpus) {
  v1::RoundStart start = SmallRoundStart();
  corpus.Add("round_start", "full_model", start.SerializeAsString());
  proto::ModelPatch patch;
  patch.ranges = {{128, 16}, {208, 4}};
  proto::WriteModelPatch(patch, &start);
  start.set_patch_base_version(2);
  corpus.Add("round_start", "patch_ranges", start.SerializeAsString());
  patch.low_rank = {{.offset = 0, .rows = 16, .cols = 8, .rank = 2}, {.offset = 144, .rows = 4, .cols = 16, .rank = 1}};
  patch.ranges = {{128, 16}};
  proto::WriteModelPatch(patch, &start);
  corpus.Add("round_start", "patch_low_rank", start.SerializeAsString());
  start.set_model_follows(false);
  start.clear_patch();
  start.clear_low_rank();
  v1::TaskConfig& task = *start.mutable_task();
  task.set_model("llama-tiny");
  task.set_update_kind(v1::UPDATE_LORA);
  task.set_optimizer("adamw");
  task.mutable_lora()->set_merge("frozen-a");
  corpus.Add("round_start", "lora_task", start.SerializeAsString());
  // Edge cases: a patch range running past the model, a low-rank change of a
  // whole tensor but of full rank, a manifest whose tensors leave a gap.
  start = SmallRoundStart();
  patch = {};
  patch.ranges = {{200, 100}};
  proto::WriteModelPatch(patch, &start);
  corpus.Add("round_start", "edge_range_past_end", start.SerializeAsString());
  patch = {};
  patch.low_rank = {{.offset = 0, .rows = 16, .cols = 8, .rank = 8}};
  proto::WriteModelPatch(patch, &start);
  corpus.Add("round_start", "edge_full_rank", start.SerializeAsString());
  start = SmallRoundStart();
  start.mutable_manifest()->mutable_tensors(1)->set_offset(129);
  corpus.Add("round_start", "edge_manifest_gap", start.SerializeAsString());
}

void Safetensors(Corpus& corpus, const fs::path& scratch) {
  const Manifest m = SmallManifest();
  const fs::path file = scratch / "small.safetensors";
  Check(models::SaveCheckpoint(file, m, Values(m.total_elements, 0.5f), {{"format", "pt"}, {"round", "3"}}));
  corpus.Add("safetensors", "small_with_metadata", ReadAll(file));
  Manifest one;
  one.Append("w", {1});
  Check(models::SaveCheckpoint(file, one, Values(1, 1.0f)));
  corpus.Add("safetensors", "one_value", ReadAll(file));
  auto header = [](const std::string& json) {
    std::string out(8, '\0');
    for (int i = 0; i < 8; ++i) out[i] = char((json.size() >> (8 * i)) & 0xff);
    return out + json;
  };
  corpus.Add("safetensors", "edge_empty_header", header("{}"));
  corpus.Add("safetensors", "edge_offsets_disagree",
             header(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})") + std::string(16, '\0'));
  corpus.Add("safetensors", "edge_f16", header(R"({"w":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})") +
                                            std::string(4, '\0'));
  corpus.Add("safetensors", "edge_length_past_end", std::string("\xff\xff\xff\xff\xff\xff\xff\x7f{}", 10));
}

void HuggingFace(Corpus& corpus, const fs::path& scratch) {
  auto base = models::Llama::Create(TinyLlamaConfig(), 1);
  Check(base.status());
  base->Initialize(1);
  Check(models::SaveHfCheckpoint(scratch / "hf", *base));
  const std::string config = ReadAll(scratch / "hf" / "config.json");
  const std::string tensors = ReadAll(scratch / "hf" / "model.safetensors");
  corpus.Add("hf_checkpoint", "tiny_llama", JoinParts({config, tensors}));
  models::LlamaConfig tied = TinyLlamaConfig();
  tied.tie_embeddings = true;
  auto tied_model = models::Llama::Create(tied, 1);
  Check(tied_model.status());
  tied_model->Initialize(2);
  Check(models::SaveHfCheckpoint(scratch / "hf-tied", *tied_model));
  corpus.Add("hf_checkpoint", "tiny_llama_tied",
             JoinParts({ReadAll(scratch / "hf-tied" / "config.json"), ReadAll(scratch / "hf-tied" / "model.safetensors")}));
  corpus.Add("hf_checkpoint", "edge_config_only", JoinParts({config, ""}));
  corpus.Add("hf_checkpoint", "edge_minimal_config", JoinParts({R"({"vocab_size":8,"hidden_size":4,"intermediate_size":6,"num_hidden_layers":2,"num_attention_heads":2,"num_key_value_heads":1,"max_position_embeddings":4})", tensors}));

  auto lora = models::LoraLlama::Create(std::move(base).value(), TinyLoraConfig());
  Check(lora.status());
  lora->Initialize(3);
  Check(models::SaveLoraAdapter(scratch / "peft", *lora));
  const std::string adapter_config = ReadAll(scratch / "peft" / "adapter_config.json");
  const std::string adapter = ReadAll(scratch / "peft" / "adapter_model.safetensors");
  corpus.Add("peft", "tiny_adapter", JoinParts({adapter_config, adapter}));
  corpus.Add("peft", "edge_minimal_config",
             JoinParts({R"({"r":2,"lora_alpha":4,"target_modules":["q_proj","v_proj","down_proj"]})", adapter}));
  corpus.Add("peft", "edge_other_rank", JoinParts({R"({"r":4,"lora_alpha":4,"target_modules":["q_proj"]})", adapter}));
}

void Idx(Corpus& corpus, const fs::path& scratch) {
  models::Dataset train;
  train.feature_size = 4;
  train.labels = {3, 1, 4};
  train.features = Values(12, 1.0f / 8);
  for (float& v : train.features) v = v < 0 ? -v : v;
  models::Dataset test = train;
  test.labels = {9, 0, 0};
  Check(models::WriteIdx(scratch / "idx", train, test));
  corpus.Add("idx", "three_images", JoinParts({ReadAll(scratch / "idx" / "train-images-idx3-ubyte"),
                                               ReadAll(scratch / "idx" / "train-labels-idx1-ubyte")}));
  corpus.Add("idx", "three_test_images", JoinParts({ReadAll(scratch / "idx" / "t10k-images-idx3-ubyte"),
                                                    ReadAll(scratch / "idx" / "t10k-labels-idx1-ubyte")}));
  corpus.Add("idx", "edge_label_out_of_range",
             JoinParts({std::string("\0\0\x08\x03\0\0\0\x01\0\0\0\x01\0\0\0\x01\x80", 17),
                        std::string("\0\0\x08\x01\0\0\0\x01\x0a", 9)}));
}

void Fortunes(Corpus& corpus) {
  corpus.Add("fortunes", "three", "A fortune.\n%\nAnother one,\non two lines.\n%\nThe last.\n");
  corpus.Add("fortunes", "crlf", "Windows\r\nlines\r\n%\r\nand more\r\n%\r\n");
  corpus.Add("fortunes", "edge_separators_only", "%\n%\n%\n");
  corpus.Add("fortunes", "edge_no_newline", "%\nend without a newline\n%");
}

void Toml(Corpus& corpus) {
  corpus.Add("toml_config", "server",
             "listen = \"127.0.0.1:7443\"\n"
             "db = \"estuary.db\"\n"
             "rounds = 40\n"
             "clients_per_round = 0.5\n"
             "min_clients = 2\n"
             "round_deadline = 120.5\n"
             "exit_when_done = true\n"
             "model = \"cnn\"\n"
             "epochs = 2\n"
             "batch = 32\n"
             "lr = 0.01\n"
             "strategy = \"fedadam\"\n"
             "server_lr = 0.01\n"
             "beta1 = 0.9\n"
             "tau = 1e-3\n");
  corpus.Add("toml_config", "lora",
             "model = 'llama-tiny'\n"
             "update-kind = 'lora'\n"
             "lora_rank = 4\n"
             "lora_alpha = 8.0\n"
             "lora_targets = \"q_proj,v_proj\"\n"
             "lora_merge = \"exact\"\n"
             "lora_mixed_ranks = true\n"
             "optimizer = \"adamw\"\n"
             "seq_len = 64\n"
             "gpus = \"0,1\"\n"
             "zero = 2\n");
  corpus.Add("toml_config", "edge_unknown_key", "rounds = 3\nno_such_key = 1\n");
  corpus.Add("toml_config", "edge_wrong_type", "epochs = \"many\"\n[task]\nlr = [1, 2]\n");
  corpus.Add("toml_config", "edge_command_line_wins", "seed = 99\nconfig = \"other.toml\"\n");
}

void FederationFiles(Corpus& corpus, const fs::path& scratch) {
  const fs::path file = scratch / "federation.txtpb";
  v1::FederationConfig config = aggregation::DefaultFederation();
  Check(aggregation::WriteFederationFile(file, config));
  corpus.Add("federation_file", "default", ReadAll(file));
  config.mutable_task()->set_model("llama-tiny");
  config.mutable_task()->set_update_kind(v1::UPDATE_LORA);
  config.mutable_task()->mutable_lora()->set_rank(4);
  config.mutable_task()->mutable_lora()->clear_target_modules();
  config.mutable_task()->mutable_lora()->add_target_modules("q_proj");
  config.mutable_task()->mutable_lora()->add_target_modules("down_proj");
  config.set_base_model("base.safetensors");
  Check(aggregation::WriteFederationFile(file, config));
  corpus.Add("federation_file", "lora", ReadAll(file));
  corpus.Add("federation_file", "partial", "task { epochs: 3 lr: 0.1 }\nstrategy { name: \"fedadam\" tau: 0.001 }\n");
  corpus.Add("federation_file", "edge_syntax", "task { epochs: }\n");
  corpus.Add("federation_file", "edge_unknown_field", "task { epochz: 3 }\n");
}

// CRLs signed by fuzz/crl_ca (made here the first time): empty, one revoked
// site with a reason, two revoked sites. Each as the file (first byte 0) and
// as DER for the harness to re-sign (first byte 1).
void Crls(Corpus& corpus, const fs::path& scratch) {
  const fs::path ca_dir = fs::path(ESTUARY_FUZZ_SOURCE_DIR) / "crl_ca", dir = scratch / "ca";
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (!fs::exists(ca_dir / "ca.pem")) {
    Check(crypto::InitCa(dir, "estuary-fuzz-ca",
                         {.not_before = std::chrono::seconds(-300), .not_after = std::chrono::hours(24 * 365 * 50)}));
    fs::create_directories(ca_dir, ec);
    fs::copy_file(dir / "ca.pem", ca_dir / "ca.pem");
    fs::copy_file(dir / "ca.key", ca_dir / "ca.key");
  } else {
    fs::copy_file(ca_dir / "ca.pem", dir / "ca.pem");
    fs::copy_file(ca_dir / "ca.key", dir / "ca.key");
  }
  Check(crypto::IssueCertificate(dir, "site-1"));
  Check(crypto::IssueCertificate(dir, "site-2"));
  const crypto::CrlOptions options{.valid_for = std::chrono::hours(24 * 365 * 50)};
  auto add = [&](const std::string& name) {
    const std::string pem = ReadAll(dir / "crl.pem");
    corpus.Add("crl", name + "_pem", std::string(1, '\0') + pem);
    BIO* bio = BIO_new_mem_buf(pem.data(), int(pem.size()));
    X509_CRL* crl = PEM_read_bio_X509_CRL(bio, nullptr, nullptr, nullptr);
    unsigned char* der = nullptr;
    const int n = crl ? i2d_X509_CRL(crl, &der) : -1;
    if (n <= 0) Check(Internal("cannot encode {} as DER", name));
    corpus.Add("crl", name + "_der", std::string(1, '\1') + std::string(reinterpret_cast<char*>(der), size_t(n)));
    OPENSSL_free(der);
    X509_CRL_free(crl);
    BIO_free(bio);
  };
  Check(crypto::RenewCrl(dir, options));
  add("empty");
  Check(crypto::RevokeCertificate(dir, "site-1", crypto::RevocationReason::kKeyCompromise, options).status());
  add("one_revoked");
  Check(crypto::RevokeCertificate(dir, "site-2", crypto::RevocationReason::kUnspecified, options).status());
  add("two_revoked");
  corpus.Add("crl", "edge_not_pem", std::string(1, '\0') + "not a revocation list\n");
  corpus.Add("crl", "edge_empty_block", std::string(1, '\0') + "-----BEGIN X509 CRL-----\n-----END X509 CRL-----\n");
}

// One of each SecAgg+ message from an honest run of the secagg target's
// protocol (five sites, six elements, Z/2^16, round 7), as Envelopes; and
// setups, one a site can afford and one whose graph it cannot.
void SecAgg(Corpus& corpus) {
  using namespace secagg;
  ProtocolConfig config{.round = 7, .sites = 5, .degree = 4, .threshold = 3, .bits = 16, .dimension = 6};
  for (size_t i = 0; i < config.graph_seed.size(); ++i) config.graph_seed[i] = uint8_t(i * 7 + 1);
  auto check = [](auto result) {
    Check(result.status());
    return std::move(*result);
  };
  auto add = [&](const std::string& name, const v1::Envelope& e) { corpus.Add("secagg", name, e.SerializeAsString()); };
  SecAggServer server = check(SecAggServer::Create(config));
  std::vector<SecAggClient> clients;
  for (uint32_t u = 0; u < config.sites; ++u) clients.push_back(check(SecAggClient::Create(config, u)));
  v1::Envelope e;
  for (SecAggClient& client : clients) {
    AdvertiseKeys keys = check(client.Advertise());
    Check(server.Receive(keys));
    if (client.site() == 4) *e.mutable_secagg_advertise() = ToProto(keys, config.round);
  }
  add("advertise", e);
  auto broadcasts = check(server.CloseAdvertise());
  e.Clear();
  *e.mutable_secagg_keys() = ToProto(broadcasts.at(0), config.round);
  add("keys", e);
  e.Clear();
  for (SecAggClient& client : clients) {
    ShareKeys shares = check(client.Share(broadcasts.at(client.site())));
    Check(server.Receive(shares));
    if (client.site() == 4) *e.mutable_secagg_shares() = ToProto(shares, config.round);
  }
  add("shares", e);
  auto inboxes = check(server.CloseShareKeys());
  e.Clear();
  *e.mutable_secagg_inbox() = ToProto(inboxes.at(0), config.round);
  add("inbox", e);
  for (SecAggClient& client : clients) {
    const std::vector<uint32_t> input(config.dimension, client.site() + 1);
    MaskedInput masked = check(client.MaskInput(inboxes.at(client.site()), input));
    Check(server.Receive(masked));
    if (client.site() == 4) add("masked_chunk", MaskedChunkMessage(config.round, 0, masked.values));
  }
  SurvivorSet survivors = check(server.CloseMaskedInput());
  e.Clear();
  *e.mutable_secagg_survivors() = ToProto(survivors, config.round, config.sites);
  add("survivors", e);
  e.Clear();
  for (SecAggClient& client : clients) {
    SurvivorsSigned signed_survivors{.site = client.site(),
                                     .signature = UnauthenticatedSignature(check(client.ConfirmSurvivors(survivors)))};
    Check(server.Receive(signed_survivors));
    if (client.site() == 4) *e.mutable_secagg_survivors_signed() = ToProto(signed_survivors, config.round);
  }
  add("survivors_signed", e);
  auto requests = check(server.CloseConsistency());
  e.Clear();
  *e.mutable_secagg_unmask() = ToProto(requests.at(0), config.round);
  add("unmask", e);
  e.Clear();
  for (SecAggClient& client : clients) {
    UnmaskResponse response = check(client.Unmask(requests.at(client.site()), UnauthenticatedSurvivorsCheck));
    Check(server.Receive(response));
    if (client.site() == 4) *e.mutable_secagg_unmask_response() = ToProto(response, config.round);
  }
  add("unmask_response", e);
  Check(server.Finish().status());
  e.Clear();
  e.mutable_round_start()->set_round(config.round);
  *e.mutable_round_start()->mutable_secagg() = ToProto(config, 0, 1.0, 1000.0, 60);
  add("setup", e);
  e.mutable_round_start()->mutable_secagg()->set_sites(1u << 24);
  e.mutable_round_start()->mutable_secagg()->set_neighbours((1u << 24) - 1);
  e.mutable_round_start()->mutable_secagg()->set_threshold(1u << 23);
  add("edge_setup_graph_too_large", e);
}

}  // namespace
}  // namespace estuary::fuzz

int main(int argc, char** argv) {
  using namespace estuary::fuzz;
  if (argc != 2) {
    std::fprintf(stderr, "usage: corpus_writer CORPUS_DIR\n");
    return 2;
  }
  Corpus corpus{fs::path(argv[1])};
  const fs::path scratch = ScratchDir();
  Frames(corpus);
  Uploads(corpus);
  RoundStarts(corpus);
  Safetensors(corpus, scratch);
  HuggingFace(corpus, scratch);
  Idx(corpus, scratch);
  Fortunes(corpus);
  Toml(corpus);
  FederationFiles(corpus, scratch);
  Crls(corpus, scratch);
  SecAgg(corpus);
  std::printf("corpus_writer: wrote the seeds under %s\n", argv[1]);
  return 0;
}
