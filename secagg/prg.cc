#include "secagg/prg.h"
#include "crypto/openssl_util.h"

#include <openssl/evp.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <memory>
#include <vector>

namespace estuary::secagg {
namespace {

// The keystream words are read straight out of the cipher's output bytes.
static_assert(std::endian::native == std::endian::little, "secagg/prg.cc assumes a little-endian host");

struct CipherCtxFree {
  void operator()(EVP_CIPHER_CTX* ctx) const { EVP_CIPHER_CTX_free(ctx); }
};
using CipherCtx = std::unique_ptr<EVP_CIPHER_CTX, CipherCtxFree>;

// Keystream = the encryption of zeros; a chunk is a whole number of blocks so
// consecutive calls stay block-aligned.
constexpr size_t kChunkWords = 2048;
alignas(64) const uint8_t kZeros[kChunkWords * 4] = {};

// AES-256-CTR fetched from the provider once: EVP_aes_256_ctr() makes every
// EVP_EncryptInit_ex fetch it again, under the library's locks, and a masked
// input starts 1 + k streams for each of its chunks.
const EVP_CIPHER* Aes256Ctr() {
  static EVP_CIPHER* const cipher = EVP_CIPHER_fetch(nullptr, "AES-256-CTR", nullptr);
  return cipher;
}

Result<CipherCtx> StartStream(const Key32& key, const std::array<uint8_t, 16>& counter) {
  CipherCtx ctx(EVP_CIPHER_CTX_new());
  if (!ctx || Aes256Ctr() == nullptr ||
      EVP_EncryptInit_ex(ctx.get(), Aes256Ctr(), nullptr, key.data(), counter.data()) != 1) {
    return Internal("secagg: AES-256-CTR set-up failed: {}", crypto::internal::TakeOpenSslErrors());
  }
  return ctx;
}

// The counter block of AES block `block` of a seed's stream: big-endian.
Result<CipherCtx> StartStreamAt(const Key32& key, uint64_t block) {
  std::array<uint8_t, 16> counter{};
  for (int i = 0; i < 8; ++i) counter[15 - i] = static_cast<uint8_t>(block >> (8 * i));
  return StartStream(key, counter);
}

Status Keystream(EVP_CIPHER_CTX* ctx, uint8_t* out, size_t bytes) {
  int written = 0;
  if (EVP_EncryptUpdate(ctx, out, &written, kZeros, static_cast<int>(bytes)) != 1 ||
      static_cast<size_t>(written) != bytes) {
    return Internal("secagg: AES-256-CTR keystream failed: {}", crypto::internal::TakeOpenSslErrors());
  }
  return Status::Ok();
}

Status CheckRange(uint64_t offset, size_t count) {
  if (offset > kMaxStreamWords || count > kMaxStreamWords - offset) {
    return InvalidArgument("secagg: mask words [{}, {}) pass the end of a seed's stream (2^36 words)", offset,
                           offset + count);
  }
  return Status::Ok();
}

// Calls use(words, n, done) for successive keystream chunks covering words
// [offset, offset + count): words[0..n) are the stream's words offset + done
// onwards.
template <typename Use>
Status ForEachChunk(const Key32& seed, uint64_t offset, size_t count, Use use) {
  ESTUARY_RETURN_IF_ERROR(CheckRange(offset, count));
  if (count == 0) return Status::Ok();
  ESTUARY_ASSIGN_OR_RETURN(CipherCtx ctx, StartStreamAt(seed, offset / kWordsPerBlock));
  alignas(64) uint32_t words[kChunkWords];
  size_t skip = offset % kWordsPerBlock;  // words of the first block before `offset`
  size_t done = 0;
  while (done < count) {
    const size_t wanted = std::min(kChunkWords, skip + (count - done));
    const size_t whole_blocks = (wanted + kWordsPerBlock - 1) / kWordsPerBlock * kWordsPerBlock;
    ESTUARY_RETURN_IF_ERROR(Keystream(ctx.get(), reinterpret_cast<uint8_t*>(words), whole_blocks * 4));
    const size_t n = wanted - skip;
    use(words + skip, n, done);
    done += n;
    skip = 0;
  }
  return Status::Ok();
}

}  // namespace

Status CheckRingBits(int bits) {
  if (bits < 1 || bits > 32) return InvalidArgument("secagg: ring bits = {}: must be in [1, 32]", bits);
  return Status::Ok();
}

Status Aes256CtrKeystream(const Key32& key, const std::array<uint8_t, 16>& counter, std::span<uint8_t> out) {
  ESTUARY_ASSIGN_OR_RETURN(CipherCtx ctx, StartStream(key, counter));
  for (size_t done = 0; done < out.size();) {
    const size_t n = std::min(sizeof(kZeros), out.size() - done);
    ESTUARY_RETURN_IF_ERROR(Keystream(ctx.get(), out.data() + done, n));
    done += n;
  }
  return Status::Ok();
}

Status ExpandMask(const Key32& seed, uint64_t offset, int bits, std::span<uint32_t> out) {
  ESTUARY_RETURN_IF_ERROR(CheckRingBits(bits));
  const uint32_t mask = RingMask(bits);
  return ForEachChunk(seed, offset, out.size(), [&](const uint32_t* words, size_t n, size_t done) {
    for (size_t i = 0; i < n; ++i) out[done + i] = words[i] & mask;
  });
}

Status ApplyMask(const Key32& seed, uint64_t offset, int bits, MaskSign sign, std::span<uint32_t> values) {
  const SignedSeed one{&seed, sign};
  return ApplyMasks(std::span(&one, 1), offset, bits, values);
}

Status ApplyMasks(std::span<const SignedSeed> seeds, uint64_t offset, int bits, std::span<uint32_t> values) {
  ESTUARY_RETURN_IF_ERROR(CheckRingBits(bits));
  ESTUARY_RETURN_IF_ERROR(CheckRange(offset, values.size()));
  if (values.empty() || seeds.empty()) return Status::Ok();
  std::vector<CipherCtx> streams;
  streams.reserve(seeds.size());
  for (const SignedSeed& s : seeds) {
    if (s.seed == nullptr) return InvalidArgument("secagg: ApplyMasks: a null seed");
    ESTUARY_ASSIGN_OR_RETURN(CipherCtx ctx, StartStreamAt(*s.seed, offset / kWordsPerBlock));
    streams.push_back(std::move(ctx));
  }
  const uint32_t mask = RingMask(bits);
  alignas(64) uint32_t words[kChunkWords];
  size_t skip = offset % kWordsPerBlock;
  size_t done = 0;
  uint32_t* v = values.data();
  while (done < values.size()) {
    const size_t wanted = std::min(kChunkWords, skip + (values.size() - done));
    const size_t whole_blocks = (wanted + kWordsPerBlock - 1) / kWordsPerBlock * kWordsPerBlock;
    const size_t n = wanted - skip;
    for (size_t s = 0; s < seeds.size(); ++s) {
      ESTUARY_RETURN_IF_ERROR(Keystream(streams[s].get(), reinterpret_cast<uint8_t*>(words), whole_blocks * 4));
      const uint32_t* w = words + skip;
      if (seeds[s].sign == MaskSign::kAdd) {
        for (size_t i = 0; i < n; ++i) v[done + i] += w[i];
      } else {
        for (size_t i = 0; i < n; ++i) v[done + i] -= w[i];
      }
    }
    // Wrapping mod 2^32 then masking once is the same as masking each time.
    for (size_t i = 0; i < n; ++i) v[done + i] &= mask;
    done += n;
    skip = 0;
  }
  return Status::Ok();
}

Result<uint64_t> StreamWords::Next() {
  if (used_ + 2 > buffer_.size()) {
    ESTUARY_RETURN_IF_ERROR(ExpandMask(seed_, offset_, 32, buffer_));
    offset_ += buffer_.size();
    used_ = 0;
  }
  const uint64_t low = buffer_[used_], high = buffer_[used_ + 1];
  used_ += 2;
  return low | (high << 32);
}

}  // namespace estuary::secagg
