#include "models/custom_model.h"

#include <openssl/evp.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "base/atomic_file.h"
#include "models/precision.h"

namespace estuary::models {
namespace {

// Bytes per element of the dtypes a custom model may hold; nullopt for the
// ones it refuses or does not know.
std::optional<uint64_t> DTypeBytes(const std::string& dtype) {
  static const std::map<std::string, uint64_t> sizes = {
      {"F32", 4}, {"BF16", 2}, {"F16", 2}, {"I8", 1},  {"U8", 1},  {"BOOL", 1},
      {"I16", 2}, {"U16", 2},  {"I32", 4}, {"U32", 4}, {"I64", 8}, {"U64", 8}};
  const auto it = sizes.find(dtype);
  if (it == sizes.end()) return std::nullopt;
  return it->second;
}

uint64_t Elements(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= uint64_t(d);
  return n;
}

bool Federated(const CustomTensor& t) { return IsFederatedDType(t.dtype) && Elements(t.shape) > 0; }

// The manifest of the federated tensors, in layout order (a 0-d one as [1]).
Manifest ManifestOf(const std::vector<CustomTensor>& layout) {
  Manifest manifest;
  for (const CustomTensor& t : layout) {
    if (Federated(t)) manifest.Append(t.name, t.shape.empty() ? std::vector<int64_t>{1} : t.shape);
  }
  return manifest;
}

std::string Hex(std::string_view bytes) {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

std::optional<std::string> Unhex(std::string_view hex) {
  if (hex.size() % 2) return std::nullopt;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  std::string out(hex.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out[i] = char(hi * 16 + lo);
  }
  return out;
}

// The layout's tensors from a JSON array of {name, dtype, shape}, checked as
// the file's header is.
Result<std::vector<CustomTensor>> LayoutFromJson(const nlohmann::json& json, const std::string& where) {
  if (!json.is_array()) return InvalidArgument("{}: custom_layout is not a JSON array", where);
  std::vector<CustomTensor> layout;
  for (const auto& entry : json) {
    if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string() || !entry.contains("dtype") ||
        !entry["dtype"].is_string() || !entry.contains("shape") || !entry["shape"].is_array()) {
      return InvalidArgument("{}: custom_layout has an entry without name, dtype and shape", where);
    }
    CustomTensor t{.name = entry["name"].get<std::string>(), .dtype = entry["dtype"].get<std::string>()};
    for (const auto& d : entry["shape"]) {
      if (!d.is_number_unsigned()) return InvalidArgument("{}: custom_layout: '{}' has a bad shape", where, t.name);
      t.shape.push_back(d.get<int64_t>());
    }
    if (!DTypeBytes(t.dtype)) return InvalidArgument("{}: custom_layout: '{}' has dtype {}", where, t.name, t.dtype);
    layout.push_back(std::move(t));
  }
  return layout;
}

}  // namespace

bool IsFederatedDType(const std::string& dtype) { return dtype == "F32" || dtype == "BF16" || dtype == "F16"; }

std::string CustomModelName(const std::vector<CustomTensor>& layout) {
  std::vector<const CustomTensor*> sorted;
  for (const CustomTensor& t : layout) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(), [](const CustomTensor* a, const CustomTensor* b) { return a->name < b->name; });
  std::string text;
  for (const CustomTensor* t : sorted) text += fmt::format("{}\t{}\t{}\n", t->name, t->dtype, fmt::join(t->shape, ","));
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EVP_Digest(text.data(), text.size(), digest, &size, EVP_sha256(), nullptr);
  return "custom@" + Hex(std::string_view(reinterpret_cast<const char*>(digest), size)).substr(0, 12);
}

Result<CustomModel> LoadCustomModel(const std::filesystem::path& path) {
  const std::string file = path.string();
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("{}: cannot open it: {}", file, std::strerror(errno));
  in.seekg(0, std::ios::end);
  const uint64_t file_size = uint64_t(std::streamoff(in.tellg()));
  in.seekg(0);
  if (!in || file_size < 8) return InvalidArgument("{}: too short for a safetensors file", file);
  unsigned char length[8];
  in.read(reinterpret_cast<char*>(length), 8);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(length[i]) << (8 * i);
  if (n > file_size - 8) return InvalidArgument("{}: header length {} runs past the file", file, n);
  std::string header_text(n, '\0');
  in.read(header_text.data(), std::streamsize(n));
  if (!in) return IoError("{}: cannot read the header: {}", file, std::strerror(errno));
  const auto header = nlohmann::json::parse(header_text, nullptr, false);
  if (header.is_discarded() || !header.is_object()) {
    return InvalidArgument("{}: the safetensors header is not a JSON object", file);
  }
  const uint64_t data_bytes = file_size - 8 - n;
  struct Entry {
    uint64_t begin, end;
    CustomTensor tensor;
  };
  std::vector<Entry> entries;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") continue;
    if (!value.is_object() || !value.contains("dtype") || !value["dtype"].is_string() || !value.contains("shape") ||
        !value["shape"].is_array() || !value.contains("data_offsets") || !value["data_offsets"].is_array() ||
        value["data_offsets"].size() != 2) {
      return InvalidArgument("{}: tensor '{}' needs dtype, shape and data_offsets", file, name);
    }
    CustomTensor t{.name = name, .dtype = value["dtype"].get<std::string>()};
    const std::optional<uint64_t> size = DTypeBytes(t.dtype);
    if (!size) {
      return InvalidArgument("{}: tensor '{}' has dtype {}: a federation averages in fp32 and gives back exactly "
                             "F32, BF16, F16 and the integer and bool dtypes (convert it to F32)",
                             file, name, t.dtype);
    }
    for (const auto& d : value["shape"]) {
      // A dimension past 2^32 is no tensor a file this size holds, and the
      // bound keeps the element count below from wrapping around.
      if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t{1} << 32)) {
        return InvalidArgument("{}: tensor '{}' has a bad shape", file, name);
      }
      t.shape.push_back(d.get<int64_t>());
    }
    const auto& offsets = value["data_offsets"];
    if (!offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) {
      return InvalidArgument("{}: tensor '{}' has bad data_offsets", file, name);
    }
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    uint64_t elements = 1;
    for (int64_t d : t.shape) {
      if (d != 0 && elements > data_bytes / uint64_t(d)) {
        return InvalidArgument("{}: tensor '{}' of shape [{}] is larger than the file", file, name,
                               fmt::join(t.shape, ", "));
      }
      elements *= uint64_t(d);
    }
    if (end < begin || end > data_bytes || end - begin != elements * *size) {
      return InvalidArgument("{}: tensor '{}' data_offsets [{}, {}) disagree with its {} shape [{}] or the file", file,
                             name, begin, end, t.dtype, fmt::join(t.shape, ", "));
    }
    entries.push_back({begin, end, std::move(t)});
  }
  if (entries.empty()) return InvalidArgument("{}: holds no tensors", file);
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t next = 0;
  for (const Entry& e : entries) {
    if (e.begin != next) {
      return InvalidArgument("{}: tensor '{}' starts at byte {} of the data, but the one before ends at {}", file,
                             e.tensor.name, e.begin, next);
    }
    next = e.end;
  }
  if (next != data_bytes) return InvalidArgument("{}: the tensors end at byte {} of {} in the data", file, next, data_bytes);

  CustomModel model{.source = file};
  for (const Entry& e : entries) model.layout.push_back(e.tensor);
  model.name = CustomModelName(model.layout);
  model.manifest = ManifestOf(model.layout);
  if (model.manifest.tensors.empty()) {
    return InvalidArgument("{}: no F32, BF16 or F16 tensor with elements: nothing for a federation to train", file);
  }
  if (Status valid = model.manifest.Validate(); !valid.ok()) return InvalidArgument("{}: {}", file, valid.message());
  model.values.resize(model.manifest.total_elements);
  size_t federated = 0;
  for (const Entry& e : entries) {
    std::string bytes(e.end - e.begin, '\0');
    in.seekg(std::streamoff(8 + n + e.begin));
    in.read(bytes.data(), std::streamsize(bytes.size()));
    if (!in) return IoError("{}: cannot read tensor '{}': {}", file, e.tensor.name, std::strerror(errno));
    if (!Federated(e.tensor)) {
      model.held[e.tensor.name] = std::move(bytes);
      continue;
    }
    const TensorSpec& spec = model.manifest.tensors[federated++];
    float* out = model.values.data() + spec.offset;
    if (e.tensor.dtype == "F32") {
      std::memcpy(out, bytes.data(), bytes.size());  // little-endian, as the host
      continue;
    }
    std::vector<uint16_t> halves(spec.numel());
    std::memcpy(halves.data(), bytes.data(), bytes.size());
    if (e.tensor.dtype == "BF16") {
      Bf16ToFloat(halves, {out, halves.size()});
    } else {
      F16ToFloat(halves, {out, halves.size()});
    }
  }
  return model;
}

std::string DescribeCustomModel(const CustomModel& model) {
  return fmt::format("model {} from {}: {} tensors ({} federated, {} held as the file has them); the server knows no "
                     "architecture for it, so it reports no server-side accuracy, only the sites' training loss",
                     model.name, model.source, model.layout.size(), model.manifest.tensors.size(), model.held.size());
}

std::map<std::string, std::string> CustomModelMetadata(const CustomModel& model) {
  nlohmann::ordered_json layout = nlohmann::ordered_json::array();
  for (const CustomTensor& t : model.layout) layout.push_back({{"name", t.name}, {"dtype", t.dtype}, {"shape", t.shape}});
  nlohmann::ordered_json held = nlohmann::ordered_json::object();
  for (const auto& [name, bytes] : model.held) held[name] = Hex(bytes);
  return {{"custom_layout", layout.dump()}, {"custom_held", held.dump()}};
}

Result<CustomModel> CustomModelFromMetadata(const std::map<std::string, std::string>& metadata,
                                            std::vector<float> values, const std::string& where) {
  const auto layout_text = metadata.find("custom_layout"), held_text = metadata.find("custom_held");
  if (layout_text == metadata.end() || held_text == metadata.end()) {
    return InvalidArgument("{}: the metadata lacks custom_layout or custom_held", where);
  }
  CustomModel model;
  ESTUARY_ASSIGN_OR_RETURN(model.layout,
                           LayoutFromJson(nlohmann::json::parse(layout_text->second, nullptr, false), where));
  model.name = CustomModelName(model.layout);
  model.manifest = ManifestOf(model.layout);
  if (values.size() != model.manifest.total_elements) {
    return InvalidArgument("{}: {} values for a custom_layout of {} federated elements", where, values.size(),
                           model.manifest.total_elements);
  }
  model.values = std::move(values);
  const auto held = nlohmann::json::parse(held_text->second, nullptr, false);
  if (!held.is_object()) return InvalidArgument("{}: custom_held is not a JSON object", where);
  for (const CustomTensor& t : model.layout) {
    if (Federated(t)) continue;
    if (!held.contains(t.name) || !held[t.name].is_string()) {
      return InvalidArgument("{}: custom_held lacks tensor '{}'", where, t.name);
    }
    std::optional<std::string> bytes = Unhex(held[t.name].get<std::string>());
    if (!bytes || bytes->size() != Elements(t.shape) * *DTypeBytes(t.dtype)) {
      return InvalidArgument("{}: custom_held: tensor '{}' is not {} bytes of hex", where, t.name,
                             Elements(t.shape) * *DTypeBytes(t.dtype));
    }
    model.held[t.name] = std::move(*bytes);
  }
  return model;
}

Status SaveCustomModel(const std::filesystem::path& path, const CustomModel& model,
                       const std::map<std::string, std::string>& metadata) {
  if (model.values.size() != model.manifest.total_elements) {
    return InvalidArgument("{}: {} values for a model of {}", path.string(), model.values.size(),
                           model.manifest.total_elements);
  }
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string data;
  size_t federated = 0;
  for (const CustomTensor& t : model.layout) {
    const uint64_t begin = data.size();
    if (Federated(t)) {
      const TensorSpec& spec = model.manifest.tensors.at(federated++);
      const std::span<const float> values(model.values.data() + spec.offset, spec.numel());
      if (t.dtype == "F32") {
        data.append(reinterpret_cast<const char*>(values.data()), values.size_bytes());
      } else {
        std::vector<uint16_t> halves(values.size());
        if (t.dtype == "BF16") {
          FloatToBf16(values, halves);
        } else {
          FloatToF16(values, halves);
        }
        data.append(reinterpret_cast<const char*>(halves.data()), halves.size() * 2);
      }
    } else {
      const auto held = model.held.find(t.name);
      if (held == model.held.end()) return Internal("{}: no bytes for held tensor '{}'", path.string(), t.name);
      data += held->second;
    }
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {begin, uint64_t(data.size())}}};
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = char((uint64_t(text.size()) >> (8 * i)) & 0xff);
  file += text;
  file += data;
  return WriteFileAtomically(path, file);
}

}  // namespace estuary::models
