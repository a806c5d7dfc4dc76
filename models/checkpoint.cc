#include "models/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>

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

float Bf16BitsToFloat(uint16_t bits) {
  const uint32_t word = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &word, sizeof f);
  return f;
}

float F16BitsToFloat(uint16_t bits) {
  const uint32_t sign = uint32_t(bits & 0x8000) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
  uint32_t word;
  if (exponent == 0x1f) {
    word = sign | 0x7f800000u | (mantissa << 13);  // infinity, or NaN with its payload
  } else if (exponent != 0) {
    word = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    word = sign;  // signed zero
  } else {
    // A subnormal half, mantissa * 2^-24, is a normal float: shift its
    // leading one into the implicit bit.
    int shift = 0;
    uint32_t m = mantissa;
    while (!(m & 0x400)) {
      m <<= 1;
      ++shift;
    }
    word = sign | (uint32_t(127 - 15 + 1 - shift) << 23) | ((m & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &word, sizeof f);
  return f;
}

Result<Checkpoint> LoadCheckpoint(const fs::path& path, const CheckpointReadOptions& options) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("{}: cannot open checkpoint: {}", path.string(), std::strerror(errno));
  // The header is read whole; the data tensor by tensor, straight into the
  // fp32 buffer (a published model's shards are gigabytes: no second copy).
  in.seekg(0, std::ios::end);
  const uint64_t file_size = uint64_t(std::streamoff(in.tellg()));
  in.seekg(0);
  if (!in || file_size < 8) return InvalidArgument("{}: too short for a safetensors file", path.string());
  unsigned char length[8];
  in.read(reinterpret_cast<char*>(length), 8);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(length[i]) << (8 * i);
  if (n > file_size - 8) return InvalidArgument("{}: header length {} runs past the file", path.string(), n);
  std::string header_text(n, '\0');
  in.read(header_text.data(), std::streamsize(n));
  if (!in) return IoError("{}: cannot read the header: {}", path.string(), std::strerror(errno));
  auto header = nlohmann::json::parse(header_text, nullptr, false);
  if (header.is_discarded() || !header.is_object()) {
    return InvalidArgument("{}: the safetensors header is not a JSON object", path.string());
  }
  const uint64_t data_bytes = file_size - 8 - n;
  Checkpoint checkpoint;
  struct Entry {
    uint64_t begin, end;
    DType stored;
    TensorSpec spec;
  };
  std::vector<Entry> entries;
  const char* const accepted = options.widen_half ? "F32, BF16 or F16" : "F32";
  auto stored_dtype = [&](const nlohmann::json& dtype) -> std::optional<DType> {
    if (dtype == "F32") return DType::kF32;
    if (options.widen_half && dtype == "BF16") return DType::kBF16;
    if (options.widen_half && dtype == "F16") return DType::kF16;
    return std::nullopt;
  };
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
    if (!value.is_object() || !value.contains("dtype") || !stored_dtype(value["dtype"]) || !value.contains("shape") ||
        !value["shape"].is_array() || !value.contains("data_offsets") || !value["data_offsets"].is_array() ||
        value["data_offsets"].size() != 2) {
      return InvalidArgument("{}: tensor '{}' needs dtype {}, shape and data_offsets", path.string(), name, accepted);
    }
    const DType stored = *stored_dtype(value["dtype"]);
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
    const uint64_t size = DTypeSize(stored);
    if (end < begin || end > data_bytes || (end - begin) != spec.numel() * size || begin % size != 0) {
      return InvalidArgument("{}: tensor '{}' data_offsets [{}, {}) disagree with its shape or the file", path.string(),
                             name, begin, end);
    }
    entries.push_back({begin, end, stored, std::move(spec)});
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.begin < b.begin; });
  // The fp32 layout follows the file's byte order; the bytes must tile the
  // data section as the elements tile the manifest.
  uint64_t next_byte = 0, next_element = 0;
  std::string gap;
  for (auto& e : entries) {
    if (gap.empty() && e.begin != next_byte) {
      gap = fmt::format("tensor '{}' starts at byte {} but the previous one ends at {}", e.spec.name, e.begin,
                        next_byte);
    }
    next_byte = e.end;
    e.spec.offset = next_element;
    next_element += e.spec.numel();
    checkpoint.stored[e.spec.name] = e.stored;
    checkpoint.manifest.tensors.push_back(e.spec);
  }
  if (gap.empty() && next_byte != data_bytes) {
    gap = fmt::format("the tensors end at byte {} of {}", next_byte, data_bytes);
  }
  checkpoint.manifest.total_elements = next_element;
  Status valid = checkpoint.manifest.Validate();
  if (!valid.ok() || !gap.empty()) {
    return InvalidArgument("{}: tensors do not tile the data section: {}", path.string(),
                           valid.ok() ? gap : valid.message());
  }
  checkpoint.data.resize(checkpoint.manifest.total_elements);
  std::vector<uint16_t> halves;
  for (const Entry& e : entries) {
    float* out = checkpoint.data.data() + e.spec.offset;
    const uint64_t count = e.spec.numel();
    in.seekg(std::streamoff(8 + n + e.begin));
    if (e.stored == DType::kF32) {
      in.read(reinterpret_cast<char*>(out), std::streamsize(count * 4));  // little-endian, as the host
    } else {
      float (*widen)(uint16_t) = e.stored == DType::kBF16 ? Bf16BitsToFloat : F16BitsToFloat;
      halves.resize(count);
      in.read(reinterpret_cast<char*>(halves.data()), std::streamsize(count * 2));
      for (uint64_t i = 0; i < count; ++i) out[i] = widen(halves[i]);
    }
    if (!in) return IoError("{}: cannot read tensor '{}': {}", path.string(), e.spec.name, std::strerror(errno));
  }
  return checkpoint;
}

}  // namespace estuary::models
