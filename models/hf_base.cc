#include "models/hf_base.h"

#include <openssl/evp.h>

#include <bit>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>

#include <fmt/format.h>

namespace estuary::models {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kIdentityPrefix = "estuary-hf-base-v1\n";

std::string_view RopeKindName(RopeScaling::Kind kind) {
  switch (kind) {
    case RopeScaling::Kind::kLinear: return "linear";
    case RopeScaling::Kind::kLlama3: return "llama3";
    default: return "none";
  }
}

// The lines of a canonical shape, in order: key -> value.
std::vector<std::pair<std::string, std::string>> ShapeLines(std::string_view text) {
  std::vector<std::pair<std::string, std::string>> lines;
  while (!text.empty()) {
    const size_t end = text.find('\n');
    std::string_view line = text.substr(0, end);
    text = end == std::string_view::npos ? std::string_view() : text.substr(end + 1);
    const size_t eq = line.find('=');
    if (eq == std::string_view::npos) {
      lines.emplace_back(std::string(line), "");
    } else {
      lines.emplace_back(std::string(line.substr(0, eq)), std::string(line.substr(eq + 1)));
    }
  }
  return lines;
}

}  // namespace

std::string CanonicalShape(const LlamaConfig& c) {
  const RopeScaling& r = c.rope_scaling;
  return fmt::format(
      "architecture={}\nvocab_size={}\nhidden_size={}\nintermediate_size={}\nnum_hidden_layers={}\n"
      "num_attention_heads={}\nnum_key_value_heads={}\nhead_dim={}\nmax_position_embeddings={}\nrms_norm_eps={}\n"
      "rope_theta={}\ntie_word_embeddings={}\nrope_scaling.type={}\nrope_scaling.factor={}\n"
      "rope_scaling.low_freq_factor={}\nrope_scaling.high_freq_factor={}\n"
      "rope_scaling.original_max_position_embeddings={}\nqkv_bias={}\no_bias={}\nmlp_bias={}\nsliding_window={}\n",
      c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads,
      c.head_dim(), c.max_position_embeddings > 0 ? c.max_position_embeddings : c.max_seq_len, c.rms_norm_eps,
      c.rope_theta, int(c.tie_embeddings), RopeKindName(r.kind), r.factor, r.low_freq_factor, r.high_freq_factor,
      r.original_max_position_embeddings, int(c.qkv_bias), int(c.o_bias), int(c.mlp_bias), c.sliding_window);
}

Result<LlamaConfig> ParseCanonicalShape(std::string_view text) {
  std::map<std::string, std::string> values;
  for (auto& [key, value] : ShapeLines(text)) values[key] = value;
  LlamaConfig c;
  auto integer = [&](const char* key, int* out) -> Status {
    const auto it = values.find(key);
    if (it == values.end()) return InvalidArgument("base model shape: '{}' is missing", key);
    const char* end = it->second.data() + it->second.size();
    auto [ptr, error] = std::from_chars(it->second.data(), end, *out);
    if (error != std::errc() || ptr != end) {
      return InvalidArgument("base model shape: {}={}: expected an integer", key, it->second);
    }
    return Status::Ok();
  };
  auto number = [&](const char* key, double* out) -> Status {
    const auto it = values.find(key);
    if (it == values.end()) return InvalidArgument("base model shape: '{}' is missing", key);
    char* end = nullptr;
    *out = std::strtod(it->second.c_str(), &end);
    if (it->second.empty() || *end != '\0') {
      return InvalidArgument("base model shape: {}={}: expected a number", key, it->second);
    }
    return Status::Ok();
  };
  int head_dim = 0, tie = 0, qkv_bias = 0, o_bias = 0, mlp_bias = 0;
  ESTUARY_RETURN_IF_ERROR(integer("vocab_size", &c.vocab_size));
  ESTUARY_RETURN_IF_ERROR(integer("hidden_size", &c.hidden_size));
  ESTUARY_RETURN_IF_ERROR(integer("intermediate_size", &c.intermediate_size));
  ESTUARY_RETURN_IF_ERROR(integer("num_hidden_layers", &c.num_layers));
  ESTUARY_RETURN_IF_ERROR(integer("num_attention_heads", &c.num_heads));
  ESTUARY_RETURN_IF_ERROR(integer("num_key_value_heads", &c.num_kv_heads));
  ESTUARY_RETURN_IF_ERROR(integer("head_dim", &head_dim));
  ESTUARY_RETURN_IF_ERROR(integer("max_position_embeddings", &c.max_seq_len));
  ESTUARY_RETURN_IF_ERROR(number("rms_norm_eps", &c.rms_norm_eps));
  ESTUARY_RETURN_IF_ERROR(number("rope_theta", &c.rope_theta));
  ESTUARY_RETURN_IF_ERROR(integer("tie_word_embeddings", &tie));
  ESTUARY_RETURN_IF_ERROR(number("rope_scaling.factor", &c.rope_scaling.factor));
  ESTUARY_RETURN_IF_ERROR(number("rope_scaling.low_freq_factor", &c.rope_scaling.low_freq_factor));
  ESTUARY_RETURN_IF_ERROR(number("rope_scaling.high_freq_factor", &c.rope_scaling.high_freq_factor));
  ESTUARY_RETURN_IF_ERROR(integer("rope_scaling.original_max_position_embeddings",
                                  &c.rope_scaling.original_max_position_embeddings));
  ESTUARY_RETURN_IF_ERROR(integer("qkv_bias", &qkv_bias));
  ESTUARY_RETURN_IF_ERROR(integer("o_bias", &o_bias));
  ESTUARY_RETURN_IF_ERROR(integer("mlp_bias", &mlp_bias));
  ESTUARY_RETURN_IF_ERROR(integer("sliding_window", &c.sliding_window));
  c.architecture = values["architecture"];
  const std::string& kind = values["rope_scaling.type"];
  if (kind == "linear") {
    c.rope_scaling.kind = RopeScaling::Kind::kLinear;
  } else if (kind == "llama3") {
    c.rope_scaling.kind = RopeScaling::Kind::kLlama3;
  } else if (kind != "none") {
    return InvalidArgument("base model shape: rope_scaling.type={}: expected none, linear or llama3", kind);
  }
  c.tie_embeddings = tie != 0;
  c.qkv_bias = qkv_bias != 0;
  c.o_bias = o_bias != 0;
  c.mlp_bias = mlp_bias != 0;
  // Only a head_dim that hidden_size / heads does not give is explicit.
  if (c.num_heads > 0 && head_dim != c.hidden_size / c.num_heads) c.explicit_head_dim = head_dim;
  if (Status valid = c.Validate(); !valid.ok()) return InvalidArgument("base model shape: {}", valid.message());
  if (CanonicalShape(c) != text) return InvalidArgument("base model shape: not in canonical form");
  return c;
}

std::string FirstShapeDifference(std::string_view mine, std::string_view theirs) {
  const auto a = ShapeLines(mine), b = ShapeLines(theirs);
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    const std::string key = i < a.size() ? a[i].first : b[i].first;
    const std::string va = i < a.size() && a[i].first == key ? a[i].second : "(absent)";
    const std::string vb = i < b.size() && b[i].first == key ? b[i].second : "(absent)";
    if (va != vb) return fmt::format("{}: {} vs {}", key, va, vb);
  }
  return {};
}

std::string HfBaseIdentity(const LlamaConfig& config, std::span<const float> weights) {
  static_assert(std::endian::native == std::endian::little, "the identity hashes little-endian floats");
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), &EVP_MD_CTX_free);
  EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr);
  EVP_DigestUpdate(ctx.get(), kIdentityPrefix.data(), kIdentityPrefix.size());
  const std::string shape = CanonicalShape(config);
  EVP_DigestUpdate(ctx.get(), shape.data(), shape.size());
  EVP_DigestUpdate(ctx.get(), weights.data(), weights.size_bytes());
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EVP_DigestFinal_ex(ctx.get(), digest, &size);
  std::string hex;
  for (unsigned int i = 0; i < size; ++i) hex += fmt::format("{:02x}", digest[i]);
  return hex;
}

std::string HfBase::ModelName() const {
  std::string name = fs::absolute(dir).lexically_normal().filename().string();
  if (name.empty()) name = fs::absolute(dir).lexically_normal().parent_path().filename().string();
  if (name.empty()) name = "hf";
  return fmt::format("{}@{}", name, sha256.substr(0, 12));
}

bool IsHfModelDir(const fs::path& path) {
  std::error_code error;
  return fs::is_directory(path, error) && fs::exists(path / "config.json", error);
}

Result<HfBase> LoadHfBase(const fs::path& dir, HfLoadOptions options) {
  if (!IsHfModelDir(dir)) {
    return InvalidArgument("base model {}: not a Hugging Face model directory (no config.json)", dir.string());
  }
  options.max_seq_len = 0;
  ESTUARY_ASSIGN_OR_RETURN(Llama model, LoadHfCheckpoint(dir, options));
  HfBase base;
  base.dir = dir;
  base.config = model.config();
  base.shape = CanonicalShape(base.config);
  base.manifest = model.manifest();
  base.weights.assign(model.parameters().begin(), model.parameters().end());
  base.sha256 = HfBaseIdentity(base.config, base.weights);
  return base;
}

}  // namespace estuary::models
