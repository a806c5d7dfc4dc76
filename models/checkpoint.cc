#include "models/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

namespace estuary::models {

namespace fs = std::filesystem;

Status SaveCheckpoint(const fs::path& path, const Manifest& manifest, std::span<const float> data,
                      const std::map<std::string, std::string>& metadata) {
  ESTUARY_RETURN_IF_ERROR(manifest.Validate());
  if (data.size() != manifest.total_elements) {
    return InvalidArgument("{}: {} values for a manifest of {}", path.string(), data.size(), manifest.total_elements);
  }
  // An object even with no tensors and no metadata ("{}", which LoadCheckpoint
  // reads back; a default json would be written as "null").
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  for (const auto& t : manifest.tensors) {
    if (t.dtype != DType::kF32) return InvalidArgument("{}: tensor '{}' is not f32", path.string(), t.name);
    header[t.name] = {{"dtype", "F32"},
                      {"shape", t.shape},
                      {"data_offsets", {t.offset * 4, (t.offset + t.numel()) * 4}}};
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  std::string file(8, '\0');
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) file[i] = char((n >> (8 * i)) & 0xff);
  file += text;
  file.append(reinterpret_cast<const char*>(data.data()), data.size_bytes());
  return WriteFileAtomically(path, file);
}

Result<Checkpoint> LoadCheckpoint(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("{}: cannot open checkpoint: {}", path.string(), std::strerror(errno));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.size() < 8) return InvalidArgument("{}: too short for a safetensors file", path.string());
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(bytes[i])) << (8 * i);
  if (n > bytes.size() - 8) return InvalidArgument("{}: header length {} runs past the file", path.string(), n);
  auto header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + n, nullptr, false);
  if (header.is_discarded() || !header.is_object()) {
    return InvalidArgument("{}: the safetensors header is not a JSON object", path.string());
  }
  const uint64_t data_bytes = bytes.size() - 8 - n;
  Checkpoint checkpoint;
  struct Entry {
    uint64_t begin;
    TensorSpec spec;
  };
  std::vector<Entry> entries;
  for (auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) return InvalidArgument("{}: __metadata__ is not an object", path.string());
      for (auto& [k, v] : value.items()) {
        if (!v.is_string()) return InvalidArgument("{}: metadata '{}' is not a string", path.string(), k);
        checkpoint.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    // (value.value("dtype", "") would throw on a dtype that is not a string.)
    if (!value.is_object() || !value.contains("dtype") || value["dtype"] != "F32" || !value.contains("shape") ||
        !value["shape"].is_array() || !value.contains("data_offsets") || !value["data_offsets"].is_array() ||
        value["data_offsets"].size() != 2) {
      return InvalidArgument("{}: tensor '{}' needs dtype F32, shape and data_offsets", path.string(), name);
    }
    TensorSpec spec;
    spec.name = name;
    for (auto& d : value["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() <= 0) {
        return InvalidArgument("{}: tensor '{}' has a bad shape", path.string(), name);
      }
      spec.shape.push_back(d.get<int64_t>());
    }
    const auto& offsets = value["data_offsets"];
    if (!offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) {
      return InvalidArgument("{}: tensor '{}' has bad data_offsets", path.string(), name);
    }
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    if (end < begin || end > data_bytes || (end - begin) != spec.numel() * 4 || begin % 4 != 0) {
      return InvalidArgument("{}: tensor '{}' data_offsets [{}, {}) disagree with its shape or the file", path.string(),
                             name, begin, end);
    }
    entries.push_back({begin, std::move(spec)});
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.begin < b.begin; });
  for (auto& e : entries) {
    e.spec.offset = e.begin / 4;
    checkpoint.manifest.tensors.push_back(std::move(e.spec));
  }
  checkpoint.manifest.total_elements = data_bytes / 4;
  Status valid = checkpoint.manifest.Validate();
  if (!valid.ok() || data_bytes % 4 != 0) {
    return InvalidArgument("{}: tensors do not tile the data section: {}", path.string(), valid.message());
  }
  checkpoint.data.resize(checkpoint.manifest.total_elements);
  if (data_bytes > 0) std::memcpy(checkpoint.data.data(), bytes.data() + 8 + n, data_bytes);
  return checkpoint;
}

}  // namespace estuary::models
