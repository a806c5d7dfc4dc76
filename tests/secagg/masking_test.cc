#include "secagg/masking.h"

#include <gtest/gtest.h>

#include "secagg/key_agreement.h"
#include "secagg/prg.h"
#include "tests/secagg/test_util.h"

namespace estuary::secagg {
namespace {

using testing::CountingKey;

// Two sites, each the other's only neighbour: their pairwise masks cancel in
// the sum and the self masks are all that is left.
TEST(Masking, PairwiseMasksCancelBetweenTwoSites) {
  auto u = X25519KeyPairFromPrivate(CountingKey(1));
  auto v = X25519KeyPairFromPrivate(CountingKey(2));
  ASSERT_TRUE(u.ok() && v.ok());
  const std::vector<PeerPublicKey> u_peers = {{7, v->public_key}}, v_peers = {{3, u->public_key}};
  auto u_keys = PairwiseMaskKeys(3, u->private_key, u_peers, 1);
  auto v_keys = PairwiseMaskKeys(7, v->private_key, v_peers, 1);
  ASSERT_TRUE(u_keys.ok() && v_keys.ok());
  EXPECT_EQ((*u_keys)[0].key, (*v_keys)[0].key);
  std::vector<uint32_t> x_u(100, 5), x_v(100, 9);
  ASSERT_TRUE(MaskChunk(3, CountingKey(10), *u_keys, 32, 0, x_u).ok());
  ASSERT_TRUE(MaskChunk(7, CountingKey(20), *v_keys, 32, 0, x_v).ok());
  EXPECT_NE(x_u[0], 5u);
  std::vector<uint32_t> sum(100, 0);
  ASSERT_TRUE(AddInto(sum, x_u, 32).ok());
  ASSERT_TRUE(AddInto(sum, x_v, 32).ok());
  ASSERT_TRUE(RemoveSelfMask(CountingKey(10), 32, 0, sum).ok());
  ASSERT_TRUE(RemoveSelfMask(CountingKey(20), 32, 0, sum).ok());
  EXPECT_EQ(sum, std::vector<uint32_t>(100, 14));
}

// Site 7 dropped: the server cancels the mask site 3 applied for it from
// 7's private key and 3's public key alone.
TEST(Masking, ADroppedNeighboursMaskIsCancelledFromItsKey) {
  auto u = X25519KeyPairFromPrivate(CountingKey(1));
  auto v = X25519KeyPairFromPrivate(CountingKey(2));
  ASSERT_TRUE(u.ok() && v.ok());
  const std::vector<PeerPublicKey> u_peers = {{7, v->public_key}};
  auto u_keys = PairwiseMaskKeys(3, u->private_key, u_peers, 1);
  ASSERT_TRUE(u_keys.ok());
  for (int bits : {32, 11}) {
    std::vector<uint32_t> x_u(100, 5);
    ASSERT_TRUE(MaskChunk(3, CountingKey(10), *u_keys, bits, 40, x_u).ok());
    ASSERT_TRUE(RemoveSelfMask(CountingKey(10), bits, 40, x_u).ok());
    EXPECT_NE(x_u, std::vector<uint32_t>(100, 5));  // the pairwise mask is still on
    const std::vector<PeerPublicKey> survivors = {{3, u->public_key}};
    ASSERT_TRUE(RemoveDroppedSiteMasks(7, v->private_key, survivors, 1, bits, 40, x_u).ok());
    EXPECT_EQ(x_u, std::vector<uint32_t>(100, 5));
    // The wrong round's key does not cancel it.
    std::vector<uint32_t> again(100, 5);
    ASSERT_TRUE(MaskChunk(3, CountingKey(10), *u_keys, bits, 40, again).ok());
    ASSERT_TRUE(RemoveSelfMask(CountingKey(10), bits, 40, again).ok());
    ASSERT_TRUE(RemoveDroppedSiteMasks(7, v->private_key, survivors, 2, bits, 40, again).ok());
    EXPECT_NE(again, std::vector<uint32_t>(100, 5));
  }
}

TEST(Masking, BadInputsAreRefused) {
  std::vector<uint32_t> values(10, 0);
  const std::vector<PairwiseKey> self = {{3, CountingKey(1)}};
  const std::vector<PairwiseKey> twice = {{4, CountingKey(1)}, {4, CountingKey(2)}};
  EXPECT_FALSE(MaskChunk(3, CountingKey(9), self, 32, 0, values).ok());
  EXPECT_FALSE(MaskChunk(3, CountingKey(9), twice, 32, 0, values).ok());
  EXPECT_FALSE(MaskChunk(3, CountingKey(9), {}, 0, 0, values).ok());
  EXPECT_EQ(values, std::vector<uint32_t>(10, 0));  // nothing applied before the refusal
  std::vector<uint32_t> shorter(9, 0);
  EXPECT_FALSE(AddInto(values, shorter, 32).ok());
  auto pair = X25519KeyPairFromPrivate(CountingKey(5));
  ASSERT_TRUE(pair.ok());
  const std::vector<PeerPublicKey> itself = {{7, pair->public_key}};
  EXPECT_FALSE(RemoveDroppedSiteMasks(7, CountingKey(6), itself, 1, 32, 0, values).ok());
  auto peers = PairwiseMaskKeys(7, CountingKey(6), itself, 1);
  EXPECT_FALSE(peers.ok());
}

}  // namespace
}  // namespace estuary::secagg
