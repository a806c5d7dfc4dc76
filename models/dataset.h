// Labelled image datasets in the IDX format (the MNIST files).
//
// A directory holds train-images-idx3-ubyte, train-labels-idx1-ubyte,
// t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte. Pixels are scaled to
// [0, 1]. Errors name the file and what is wrong with it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "base/status.h"

namespace estuary::models {

struct Dataset {
  std::vector<float> features;   // [size, feature_size], row-major
  std::vector<int32_t> labels;   // [size]
  int feature_size = 0;          // rows * cols
  int num_classes = 10;

  uint64_t size() const { return labels.size(); }
  const float* row(uint64_t i) const { return features.data() + i * feature_size; }
};

enum class Split { kTrain, kTest };

Result<Dataset> LoadIdx(const std::filesystem::path& dir, Split split);
// Writes the four IDX files (uint8 pixels = round(feature * 255)).
Status WriteIdx(const std::filesystem::path& dir, const Dataset& train, const Dataset& test);

}  // namespace estuary::models
