// The tokenizers against the JavaScript port of Hugging Face's tokenizers:
// every line of Debian's fortunes and every edge case of
// tests/models/tokenizer/edge_cases.txt must give the ids it gave, for
// Llama 2 (SentencePiece-style BPE; also written with a Metaspace
// pre-tokenizer, as TinyLlama and Mistral are), Llama 3 and Qwen 3
// (byte-level BPE);
// decode(encode(x)) must be x exactly where it was there, and decoding must
// give its text. tests/models/tokenizer/make_fixtures.js wrote the fixtures.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <openssl/evp.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "models/tokenizer.h"
#include "models/unicode.h"

namespace estuary::models {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

const fs::path kFixtures = fs::path(ESTUARY_BINARY_DIR) / "tests/models/tokenizer";

std::string ReadAll(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::string> SplitLines(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t nl; (nl = text.find('\n', start)) != std::string::npos; start = nl + 1) {
    lines.push_back(text.substr(start, nl - start));
  }
  if (start < text.size()) lines.push_back(text.substr(start));
  return lines;
}

std::string Sha256Hex(const std::string& bytes) {
  unsigned char digest[32];
  unsigned int size = 0;
  EVP_Digest(bytes.data(), bytes.size(), digest, &size, EVP_sha256(), nullptr);
  std::string hex;
  for (unsigned i = 0; i < size; ++i) hex += fmt::format("{:02x}", digest[i]);
  return hex;
}

// The corpus the fixtures were made from, read as make_fixtures.js reads it.
struct Corpus {
  std::vector<std::string> lines;
  std::string sha256;
};

Corpus ReadFortunes(const Json& manifest) {
  Corpus corpus;
  std::string all;
  for (const auto& file : manifest["files"]) {
    const std::string text = ReadAll(fs::path(manifest["folder"].get<std::string>()) / file.get<std::string>());
    all += text;
    for (std::string& line : SplitLines(text)) corpus.lines.push_back(std::move(line));
  }
  corpus.sha256 = Sha256Hex(all);
  return corpus;
}

// edge_cases.txt's escapes (see the file's head).
std::string Unescape(const std::string& line) {
  std::string out;
  for (size_t i = 0; i < line.size();) {
    if (line[i] != '\\') {
      out += line[i++];
      continue;
    }
    const char c = line[i + 1];
    if (c == 'n') out += '\n';
    else if (c == 'r') out += '\r';
    else if (c == 't') out += '\t';
    else if (c == '\\') out += '\\';
    else if (c == 'x') {
      out += char(std::stoi(line.substr(i + 2, 2), nullptr, 16));
      i += 4;
      continue;
    } else if (c == 'u') {
      const size_t end = line.find('}', i);
      unicode::AppendUtf8(char32_t(std::stoul(line.substr(i + 3, end - i - 3), nullptr, 16)), &out);
      i = end + 1;
      continue;
    } else {
      ADD_FAILURE() << "bad escape in " << line;
    }
    i += 2;
  }
  return out;
}

std::vector<std::string> EdgeCases() {
  std::vector<std::string> cases;
  for (const std::string& line : SplitLines(ReadAll(fs::path(ESTUARY_SOURCE_DIR) / "tests/models/tokenizer/edge_cases.txt"))) {
    if (!line.empty() && !line.starts_with("# ")) cases.push_back(Unescape(line));
  }
  return cases;
}

std::vector<int32_t> ParseIds(const std::string& line) {
  std::vector<int32_t> ids;
  std::istringstream in(line);
  for (int32_t id; in >> id;) ids.push_back(id);
  return ids;
}

std::string Show(const std::vector<int32_t>& ids) { return fmt::format("[{}]", fmt::join(ids, ",")); }

class Oracle : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    Result<Tokenizer> loaded = Tokenizer::Load(kFixtures / "tokenizers" / GetParam() / "tokenizer.json");
    ASSERT_TRUE(loaded.ok()) << loaded.status().message();
    tokenizer_.emplace(*loaded);
  }
  std::optional<Tokenizer> tokenizer_;
};

TEST_P(Oracle, EveryFortunesLineGivesTheSameIds) {
  const Json manifest = Json::parse(ReadAll(kFixtures / "expected/corpus.json"));
  // Not skipped: scripts/test installs the corpus, and a missing oracle is a failure.
  ASSERT_TRUE(fs::is_directory(manifest["folder"].get<std::string>()))
      << manifest["folder"] << " is missing: install Debian's fortunes (scripts/install-deps)";
  const Corpus corpus = ReadFortunes(manifest);
  ASSERT_EQ(corpus.sha256, manifest["sha256"]) << "the fortunes corpus differs from the one the fixtures were made from";
  ASSERT_EQ(corpus.lines.size(), manifest["lines"].get<size_t>());
  const std::vector<std::string> expected = SplitLines(ReadAll(kFixtures / "expected" / (GetParam() + ".fortunes.ids")));
  ASSERT_EQ(expected.size(), corpus.lines.size());
  const Json summary = Json::parse(ReadAll(kFixtures / "expected" / (GetParam() + ".fortunes.json")));
  const std::set<size_t> not_round_trip = summary["not_round_trip"].get<std::set<size_t>>();

  size_t tokens = 0, mismatches = 0, round_trip_failures = 0;
  for (size_t i = 0; i < corpus.lines.size(); ++i) {
    const std::string& line = corpus.lines[i];
    const std::vector<int32_t> ids = tokenizer_->Encode(line, false);
    const std::vector<int32_t> want = ParseIds(expected[i]);
    tokens += ids.size();
    if (ids != want && ++mismatches <= 5) {
      ADD_FAILURE() << GetParam() << ": fortunes line " << i << " '" << line << "': " << Show(ids) << ", want "
                    << Show(want);
    }
    const bool round_trip = tokenizer_->Decode(ids, false) == unicode::ReplaceInvalidUtf8(line);
    if (round_trip == not_round_trip.contains(i) && ++round_trip_failures <= 5) {
      ADD_FAILURE() << GetParam() << ": fortunes line " << i << " '" << line << "' decodes "
                    << (round_trip ? "to itself, but not there" : "to something else");
    }
  }
  EXPECT_EQ(mismatches, 0u) << "lines with other ids";
  EXPECT_EQ(round_trip_failures, 0u);
  EXPECT_GT(tokens, 600000u);  // the whole corpus was read
}

TEST_P(Oracle, EveryEdgeCaseGivesTheSameIdsAndText) {
  const std::vector<std::string> cases = EdgeCases();
  const Json expected = Json::parse(ReadAll(kFixtures / "expected" / (GetParam() + ".edge.json")));
  ASSERT_EQ(cases.size(), expected.size()) << "edge_cases.txt changed since make_fixtures.js ran";
  for (size_t i = 0; i < cases.size(); ++i) {
    const Json& want = expected[i];
    SCOPED_TRACE(fmt::format("{}: edge case {}: '{}'", GetParam(), i, cases[i]));
    EXPECT_EQ(Show(tokenizer_->Encode(cases[i], false)), Show(want["ids"].get<std::vector<int32_t>>()));
    const std::vector<int32_t> with_special = tokenizer_->Encode(cases[i], true);
    EXPECT_EQ(Show(with_special), Show(want["ids_with_special"].get<std::vector<int32_t>>()));
    EXPECT_EQ(tokenizer_->Decode(with_special, false), want["decoded"].get<std::string>());
    EXPECT_EQ(tokenizer_->Decode(with_special, true), want["decoded_skip_special"].get<std::string>());
  }
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, Oracle, ::testing::Values("llama2", "llama3", "qwen3", "llama2-metaspace"),
                         [](const auto& info) { std::string n = info.param; std::replace(n.begin(), n.end(), '-', '_'); return n; });

}  // namespace
}  // namespace estuary::models
