#include "models/dataset.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>

#include "models/checkpoint.h"

namespace estuary::models {

namespace fs = std::filesystem;

namespace {

constexpr uint32_t kImagesMagic = 0x00000803;
constexpr uint32_t kLabelsMagic = 0x00000801;

uint32_t BigEndian(const unsigned char* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

void PutBigEndian(std::string& out, uint32_t v) {
  out.push_back(char(v >> 24));
  out.push_back(char(v >> 16));
  out.push_back(char(v >> 8));
  out.push_back(char(v));
}

Result<std::string> ReadFile(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return NotFound("{}: no such file", path.string());
  const uintmax_t size = fs::file_size(path, ec);
  if (ec) return IoError("{}: cannot stat: {}", path.string(), ec.message());
  std::ifstream in(path, std::ios::binary);
  if (!in) return IoError("{}: cannot open: {}", path.string(), std::strerror(errno));
  std::string bytes(size, '\0');
  in.read(bytes.data(), std::streamsize(size));
  if (in.gcount() != std::streamsize(size)) {
    return IoError("{}: read {} of {} bytes", path.string(), in.gcount(), size);
  }
  return bytes;
}

// Parses an IDX header of `dims` dimensions; returns the sizes.
Result<std::vector<uint32_t>> Header(const std::string& bytes, const fs::path& path, uint32_t magic, int dims) {
  const size_t header = 4 + 4 * size_t(dims);
  if (bytes.size() < header) return InvalidArgument("{}: {} bytes is too short for an IDX header", path.string(), bytes.size());
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const uint32_t found = BigEndian(p);
  if (found != magic) return InvalidArgument("{}: bad magic 0x{:08x} (expected 0x{:08x})", path.string(), found, magic);
  std::vector<uint32_t> sizes;
  uint64_t payload = 1;
  for (int d = 0; d < dims; ++d) {
    sizes.push_back(BigEndian(p + 4 + 4 * d));
    payload *= sizes.back();
  }
  if (bytes.size() != header + payload) {
    return InvalidArgument("{}: {} bytes, but its header describes {}", path.string(), bytes.size(), header + payload);
  }
  return sizes;
}

Status WriteIdxPair(const fs::path& dir, const std::string& prefix, const Dataset& d) {
  const int side = int(std::lround(std::sqrt(double(d.feature_size))));
  if (side * side != d.feature_size) return InvalidArgument("idx: feature size {} is not a square image", d.feature_size);
  std::string images, labels;
  PutBigEndian(images, kImagesMagic);
  PutBigEndian(images, uint32_t(d.size()));
  PutBigEndian(images, uint32_t(side));
  PutBigEndian(images, uint32_t(side));
  images.reserve(images.size() + d.features.size());
  for (float v : d.features) images.push_back(char(uint8_t(std::lround(std::clamp(v, 0.0f, 1.0f) * 255.0f))));
  PutBigEndian(labels, kLabelsMagic);
  PutBigEndian(labels, uint32_t(d.size()));
  for (int32_t l : d.labels) labels.push_back(char(uint8_t(l)));
  ESTUARY_RETURN_IF_ERROR(WriteFileAtomically(dir / (prefix + "-images-idx3-ubyte"), images));
  return WriteFileAtomically(dir / (prefix + "-labels-idx1-ubyte"), labels);
}

}  // namespace

Result<Dataset> LoadIdx(const fs::path& dir, Split split) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return NotFound("{}: no such data directory", dir.string());
  const std::string prefix = split == Split::kTrain ? "train" : "t10k";
  const fs::path images_path = dir / (prefix + "-images-idx3-ubyte");
  const fs::path labels_path = dir / (prefix + "-labels-idx1-ubyte");
  ESTUARY_ASSIGN_OR_RETURN(std::string images, ReadFile(images_path));
  ESTUARY_ASSIGN_OR_RETURN(std::string labels, ReadFile(labels_path));
  ESTUARY_ASSIGN_OR_RETURN(auto image_dims, Header(images, images_path, kImagesMagic, 3));
  ESTUARY_ASSIGN_OR_RETURN(auto label_dims, Header(labels, labels_path, kLabelsMagic, 1));
  if (image_dims[0] != label_dims[0]) {
    return InvalidArgument("{}: {} images but {} has {} labels", images_path.string(), image_dims[0],
                           labels_path.string(), label_dims[0]);
  }
  if (image_dims[0] == 0) return InvalidArgument("{}: holds no images", images_path.string());
  Dataset d;
  d.feature_size = int(image_dims[1] * image_dims[2]);
  d.labels.resize(label_dims[0]);
  const auto* label_bytes = reinterpret_cast<const unsigned char*>(labels.data()) + 8;
  for (size_t i = 0; i < d.labels.size(); ++i) {
    if (label_bytes[i] >= d.num_classes) {
      return InvalidArgument("{}: label {} of example {} is not in [0, {})", labels_path.string(), label_bytes[i], i,
                             d.num_classes);
    }
    d.labels[i] = label_bytes[i];
  }
  d.features.resize(size_t(image_dims[0]) * d.feature_size);
  const auto* pixels = reinterpret_cast<const unsigned char*>(images.data()) + 16;
  for (size_t i = 0; i < d.features.size(); ++i) d.features[i] = float(pixels[i]) / 255.0f;
  return d;
}

Status WriteIdx(const fs::path& dir, const Dataset& train, const Dataset& test) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return IoError("idx: {}: {}", dir.string(), ec.message());
  ESTUARY_RETURN_IF_ERROR(WriteIdxPair(dir, "train", train));
  return WriteIdxPair(dir, "t10k", test);
}

}  // namespace estuary::models
