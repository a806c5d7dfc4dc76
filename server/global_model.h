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
  std::string checksum;  // sha256 hex of the values' bytes
  uint64_t version = 0;  // 0 before the first commit
};

}  // namespace estuary::server
