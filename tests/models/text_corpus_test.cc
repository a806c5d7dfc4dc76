// The byte tokenizer and the fortunes corpus: lossless round trips, document
// splitting, a seeded train/test split, and the real Debian files.
#include "models/text_corpus.h"

#include <gtest/gtest.h>

#include <fstream>
#include <set>

#include "tests/e2e/harness.h"

namespace estuary::models {
namespace {

using estuary::testing::TempDir;

void WriteText(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

TEST(ByteTokenizer, RoundTripsAnyBytes) {
  std::string text = "caf\xc3\xa9 \xe2\x82\xac\n";
  text.push_back('\0');
  text.push_back('\xff');
  const auto tokens = ByteTokenizer::Encode(text);
  ASSERT_EQ(tokens.size(), text.size());
  EXPECT_EQ(tokens[3], 0xc3);
  EXPECT_EQ(tokens.back(), 255);
  auto decoded = ByteTokenizer::Decode(tokens);
  ASSERT_TRUE(decoded.ok()) << decoded.status().message();
  EXPECT_EQ(*decoded, text);
}

TEST(ByteTokenizer, RefusesTokensOutsideAByteNamingThePosition) {
  const std::vector<int32_t> tokens = {72, 105, 256};
  auto decoded = ByteTokenizer::Decode(tokens);
  ASSERT_FALSE(decoded.ok());
  EXPECT_NE(decoded.status().message().find("token 256 at position 2"), std::string::npos)
      << decoded.status().message();
  EXPECT_FALSE(ByteTokenizer::Decode(std::vector<int32_t>{-1}).ok());
}

TEST(SplitFortunes, SplitsOnPercentLinesAndDropsEmptyDocuments) {
  const auto docs = SplitFortunes("first\n%\nsecond line\nand more\n%\n%\n100% sure\n%\n");
  ASSERT_EQ(docs.size(), 3u);
  EXPECT_EQ(docs[0], "first");
  EXPECT_EQ(docs[1], "second line\nand more");
  EXPECT_EQ(docs[2], "100% sure");
  EXPECT_EQ(SplitFortunes("no separator at all").size(), 1u);
  EXPECT_TRUE(SplitFortunes("%\n%\n").empty());
}

class Corpus : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string many;
    for (int i = 0; i < 1000; ++i) many += "fortune number " + std::to_string(i) + "\n%\n";
    WriteText(dir_ / "science", many);
    WriteText(dir_ / "science.dat", "binary index");
    std::filesystem::create_symlink("science", dir_ / "science.u8");
    WriteText(dir_ / "tiny", "one\n%\ntwo\n");
  }
  TempDir dir_;
};

TEST_F(Corpus, SkipsIndexesAndLinksAndSplitsEveryDocumentOnce) {
  auto sources = LoadFortunes(dir_.path(), {.test_fraction = 0.2, .seed = 7, .min_tokens = 32});
  ASSERT_TRUE(sources.ok()) << sources.status().message();
  ASSERT_EQ(sources->size(), 1u);  // "tiny" is below min_tokens; .dat and .u8 skipped
  const TextSource& s = (*sources)[0];
  EXPECT_EQ(s.name, "science");
  EXPECT_EQ(s.train_documents + s.test_documents, 1000u);
  EXPECT_GT(s.test_documents, 150u);
  EXPECT_LT(s.test_documents, 250u);
  // Every document appears exactly once, in one of the two streams.
  auto train = ByteTokenizer::Decode(s.train), test = ByteTokenizer::Decode(s.test);
  ASSERT_TRUE(train.ok() && test.ok());
  std::set<std::string> seen;
  for (const std::string* stream : {&*train, &*test}) {
    for (auto doc : SplitFortunes(*stream)) EXPECT_TRUE(seen.insert(std::string(doc)).second) << doc;
  }
  EXPECT_EQ(seen.size(), 1000u);
  EXPECT_TRUE(seen.count("fortune number 999"));
}

TEST_F(Corpus, TheSameSeedGivesTheSameSplitAndAnotherSeedAnother) {
  auto a = LoadFortunes(dir_.path(), {.test_fraction = 0.2, .seed = 7});
  auto b = LoadFortunes(dir_.path(), {.test_fraction = 0.2, .seed = 7});
  auto c = LoadFortunes(dir_.path(), {.test_fraction = 0.2, .seed = 8});
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ((*a)[0].test, (*b)[0].test);
  EXPECT_NE((*a)[0].test, (*c)[0].test);
}

TEST_F(Corpus, BadInputNamesTheProblem) {
  auto missing = LoadFortunes(dir_ / "nowhere", {});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("nowhere"), std::string::npos);
  auto fraction = LoadFortunes(dir_.path(), {.test_fraction = 1.5});
  ASSERT_FALSE(fraction.ok());
  EXPECT_NE(fraction.status().message().find("1.5"), std::string::npos);
  auto too_big = LoadFortunes(dir_.path(), {.min_tokens = 1u << 30});
  ASSERT_FALSE(too_big.ok());
  EXPECT_NE(too_big.status().message().find(dir_.path().string()), std::string::npos);
}

// Debian's fortunes package (scripts/install-deps installs it): one client per topic.
TEST(Fortunes, TheDebianTopicsLoadAsSeparateSources) {
  auto sources = LoadFortunes(std::string(kDefaultFortunesDir), {.test_fraction = 0.1, .seed = 1, .min_tokens = 2048});
  ASSERT_TRUE(sources.ok()) << sources.status().message();
  EXPECT_GE(sources->size(), 20u);
  std::set<std::string> names;
  uint64_t tokens = 0;
  for (const auto& s : *sources) {
    names.insert(s.name);
    tokens += s.train.size() + s.test.size();
  }
  EXPECT_TRUE(names.count("science")) << "expected the 'science' topic";
  EXPECT_GT(tokens, 1'000'000u);
}

}  // namespace
}  // namespace estuary::models
