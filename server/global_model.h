// GlobalModel: one published version of the federation's model. The values
// are shared, read-only, by everything that sends, checkpoints or starts a
// round from them, so the model is never copied per client.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace estuary::server {

struct GlobalModel {
  std::shared_ptr<const std::vector<float>> values;
  std::string checksum;  // sha256 hex of the values' bytes: the version's name
  uint64_t version = 0;  // 0 before the first commit
  // The transfer digest (crypto/transfer_digest.h) of the values' bytes,
  // which a site checks the model it assembles against. Taken where the
  // checksum is, off the I/O path.
  std::string digest;
};

}  // namespace estuary::server
