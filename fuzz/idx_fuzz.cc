// An IDX pair (images, labels) through models::LoadIdx. The input is two
// parts (fuzz_util.h's SplitParts): the images file, then the labels file.
// A dataset accepted holds one row of feature_size pixels in [0, 1] per label.
#include "fuzz/fuzz_util.h"
#include "models/dataset.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace estuary;
  const auto parts = fuzz::SplitParts(data, size, 2);
  fuzz::WriteScratch("train-images-idx3-ubyte", parts[0]);
  fuzz::WriteScratch("train-labels-idx1-ubyte", parts[1]);
  auto dataset = models::LoadIdx(fuzz::ScratchDir(), models::Split::kTrain);
  if (!dataset.ok()) {
    fuzz::CheckError(dataset.status());
    return 0;
  }
  FUZZ_CHECK(dataset->size() > 0 && dataset->feature_size > 0);
  FUZZ_CHECK(dataset->features.size() == dataset->size() * uint64_t(dataset->feature_size));
  // Every pixel comes from the file: 16 header bytes, then one byte per pixel.
  FUZZ_CHECK(parts[0].size() == 16 + dataset->features.size());
  for (float v : dataset->features) FUZZ_CHECK(v >= 0 && v <= 1);
  for (int32_t label : dataset->labels) FUZZ_CHECK(label >= 0 && label < dataset->num_classes);
  return 0;
}
