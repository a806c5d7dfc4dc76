#include "secagg/bytes.h"
#include "crypto/openssl_util.h"

#include <openssl/err.h>
#include <openssl/rand.h>

namespace estuary::secagg {

Result<Key32> RandomKey() {
  Key32 key;
  if (RAND_bytes(key.data(), static_cast<int>(key.size())) != 1) {
    return Internal("secagg: RAND_bytes refused: {}", crypto::internal::TakeOpenSslErrors());
  }
  return key;
}

std::string Hex(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  }
  return out;
}

namespace internal {

void AppendBigEndian64(std::string& out, uint64_t value) {
  for (int shift = 56; shift >= 0; shift -= 8) out += static_cast<char>((value >> shift) & 0xff);
}

void AppendBigEndian32(std::string& out, uint32_t value) {
  for (int shift = 24; shift >= 0; shift -= 8) out += static_cast<char>((value >> shift) & 0xff);
}

}  // namespace internal
}  // namespace estuary::secagg
