#include "crypto/transfer_digest.h"

#include <xxhash.h>

#include <array>
#include <cassert>
#include <cstdio>
#include <cstdlib>
#include <span>

#include "crypto/sha256.h"

namespace estuary::crypto {
namespace {

// XXH3 fails only on a null state, i.e. when its allocation failed.
void CheckXxh(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "crypto: transfer digest: %s failed\n", what);
    std::abort();
  }
}

std::string Hex(XXH128_hash_t hash) {
  XXH128_canonical_t canonical;  // big-endian: high half first, as xxhsum writes it
  XXH128_canonicalFromHash(&canonical, hash);
  return ToHex(std::span<const uint8_t>(canonical.digest, sizeof(canonical.digest)));
}

}  // namespace

struct TransferDigest::State {
  XXH3_state_t* xxh = nullptr;
};

TransferDigest::TransferDigest() : state_(new State) {
  state_->xxh = XXH3_createState();
  CheckXxh(state_->xxh != nullptr, "XXH3_createState");
  CheckXxh(XXH3_128bits_reset(state_->xxh) == XXH_OK, "XXH3_128bits_reset");
}

TransferDigest::~TransferDigest() {
  XXH3_freeState(state_->xxh);
  delete state_;
}

void TransferDigest::Update(const void* data, size_t size) {
  assert(!finalized_);
  if (size == 0) return;
  CheckXxh(XXH3_128bits_update(state_->xxh, data, size) == XXH_OK, "XXH3_128bits_update");
}

std::string TransferDigest::FinalHex() {
  assert(!finalized_);
  finalized_ = true;
  return Hex(XXH3_128bits_digest(state_->xxh));
}

std::string TransferDigestHex(const void* data, size_t size) { return Hex(XXH3_128bits(data, size)); }

}  // namespace estuary::crypto
