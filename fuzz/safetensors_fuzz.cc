// A safetensors file through models::LoadCheckpoint. A checkpoint accepted
// must be a valid manifest over exactly its data, and must come back the same
// when written with SaveCheckpoint and read again.
#include <cstring>

#include "fuzz/fuzz_util.h"
#include "models/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace estuary;
  const auto path = fuzz::WriteScratch("model.safetensors", {reinterpret_cast<const char*>(data), size});
  auto checkpoint = models::LoadCheckpoint(path);
  if (!checkpoint.ok()) {
    fuzz::CheckError(checkpoint.status());
    return 0;
  }
  fuzz::CheckAcceptedManifest(checkpoint->manifest, size / sizeof(float));
  FUZZ_CHECK(checkpoint->data.size() == checkpoint->manifest.total_elements);

  const auto copy = fuzz::ScratchDir() / "copy.safetensors";
  Status saved = models::SaveCheckpoint(copy, checkpoint->manifest, checkpoint->data, checkpoint->metadata);
  FUZZ_CHECK(saved.ok(), "%s", saved.message().c_str());
  auto again = models::LoadCheckpoint(copy);
  FUZZ_CHECK(again.ok(), "%s", again.status().message().c_str());
  FUZZ_CHECK(again->manifest == checkpoint->manifest && again->metadata == checkpoint->metadata);
  FUZZ_CHECK(again->data.size() == checkpoint->data.size() &&
             (again->data.empty() ||
              std::memcmp(again->data.data(), checkpoint->data.data(), 4 * again->data.size()) == 0));
  return 0;
}
