// A federation file (protobuf text format) through
// aggregation::ReadFederationFile, and a federation read through
// aggregation::CheckFederation, as `estuary-server serve --federation` does.
// A file accepted must write back (WriteFederationFile) to a file that reads
// to the same federation.
#include "aggregation/federation.h"
#include "fuzz/fuzz_util.h"
#include "fuzz/quiet_protobuf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace estuary;
  const auto path = fuzz::WriteScratch("federation.txtpb", {reinterpret_cast<const char*>(data), size});
  auto federation = aggregation::ReadFederationFile(path);
  if (!federation.ok()) {
    fuzz::CheckError(federation.status());
    return 0;
  }
  if (Status checked = aggregation::CheckFederation(*federation); !checked.ok()) fuzz::CheckError(checked);
  const auto copy = fuzz::ScratchDir() / "copy.txtpb";
  Status written = aggregation::WriteFederationFile(copy, *federation);
  FUZZ_CHECK(written.ok(), "%s", written.message().c_str());
  auto again = aggregation::ReadFederationFile(copy);
  FUZZ_CHECK(again.ok(), "%s", again.status().message().c_str());
  FUZZ_CHECK(again->SerializeAsString() == federation->SerializeAsString());
  return 0;
}
