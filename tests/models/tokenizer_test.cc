// The tokenizer's parts on small hand-made files: UTF-8 repair, NFC, the
// split patterns, added-token flags, byte fallback, the refusals of
// malformed files, tokenizer_config.json, and the estuary-lm tool. The ids
// of the real tokenizers are tokenizer_oracle_test.cc's.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/pretokenizer.h"
#include "models/tokenizer.h"
#include "models/unicode.h"

namespace estuary::models {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

const fs::path kFixtures = fs::path(ESTUARY_BINARY_DIR) / "tests/models/tokenizer/tokenizers";
const std::string kFffd = "\xEF\xBF\xBD";

TEST(Unicode, InvalidUtf8BecomesOneReplacementPerMaximalSubpart) {
  using unicode::ReplaceInvalidUtf8;
  EXPECT_TRUE(unicode::Utf8Valid("h\xC3\xA9llo \xF0\x9F\xA4\x97"));
  EXPECT_FALSE(unicode::Utf8Valid("\xC0\xAF"));
  EXPECT_EQ(ReplaceInvalidUtf8("a\xFF" "b"), "a" + kFffd + "b");
  EXPECT_EQ(ReplaceInvalidUtf8("\xE2\x82" "x"), kFffd + "x");            // a truncated sequence is one subpart
  EXPECT_EQ(ReplaceInvalidUtf8("\xF0\x9F\x98"), kFffd);
  EXPECT_EQ(ReplaceInvalidUtf8("\xED\xA0\x80"), kFffd + kFffd + kFffd);  // a surrogate: ED then two strays
  EXPECT_EQ(ReplaceInvalidUtf8("\xC0\xAF"), kFffd + kFffd);              // overlong: never a lead
  EXPECT_EQ(ReplaceInvalidUtf8("\xF5\x80"), kFffd + kFffd);
}

TEST(Unicode, NfcComposesReordersAndLeavesComposedTextAlone) {
  using unicode::Nfc;
  EXPECT_EQ(Nfc("e\xCC\x81"), "\xC3\xA9");                    // e + acute -> é
  EXPECT_EQ(Nfc("\xE2\x84\xAB"), "\xC3\x85");                 // Angstrom sign -> Å (a singleton)
  EXPECT_EQ(Nfc("q\xCC\x87\xCC\xA3"), "q\xCC\xA3\xCC\x87");   // dot below (220) before dot above (230)
  EXPECT_EQ(Nfc("\xE1\x84\x92\xE1\x85\xA1\xE1\x86\xAB"), "\xED\x95\x9C");  // jamo -> 한
  EXPECT_EQ(Nfc("plain ascii"), "plain ascii");
  EXPECT_EQ(Nfc("\xCC\x81" "a"), "\xCC\x81" "a");             // a leading mark has nothing to join
}

std::vector<std::string> Split(const SplitPattern& p, std::string_view text) {
  std::vector<std::string_view> pieces;
  p.Split(text, &pieces);
  return {pieces.begin(), pieces.end()};
}

TEST(SplitPattern, Llama3CutsAsOniguruma) {
  const std::string regex =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  Result<SplitPattern> p = SplitPattern::FromRegex(regex);
  ASSERT_TRUE(p.ok()) << p.status().message();
  using V = std::vector<std::string>;
  EXPECT_EQ(Split(*p, "Hello  world"), (V{"Hello", " ", " world"}));
  EXPECT_EQ(Split(*p, "I'M 1234567"), (V{"I", "'M", " ", "123", "456", "7"}));
  EXPECT_EQ(Split(*p, "a \n\n b"), (V{"a", " \n\n", " b"}));
  EXPECT_EQ(Split(*p, "x!!\n\ny"), (V{"x", "!!\n\n", "y"}));
  EXPECT_EQ(Split(*p, "end   "), (V{"end", "   "}));
  EXPECT_EQ(Split(*p, "\tword"), (V{"\tword"}));
}

TEST(SplitPattern, Gpt2AndUnknownPatterns) {
  using V = std::vector<std::string>;
  EXPECT_EQ(Split(SplitPattern::Gpt2(), "I'm 123 x!! \n"), (V{"I", "'m", " 123", " x", "!!", " \n"}));
  Result<SplitPattern> p = SplitPattern::FromRegex(R"(\w+)");
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find(R"(\w+)"), std::string::npos);
}

// A character-level tokenizer to try the added tokens' flags on.
Json CharTokenizer() {
  Json vocab = {{"<unk>", 0}, {" ", 1}, {"a", 2}, {"b", 3}, {"c", 4}, {"x", 5}, {"Y", 6}, {"<0xC3>", 7}, {"<0xA9>", 8}, {"ab", 9}};
  return {
      {"normalizer", {{"type", "Replace"}, {"pattern", {{"String", "y"}}}, {"content", "Y"}}},
      {"pre_tokenizer", nullptr},
      {"model",
       {{"type", "BPE"}, {"vocab", vocab}, {"merges", Json::array({"a b"})}, {"unk_token", "<unk>"},
        {"fuse_unk", true}, {"byte_fallback", true}}},
      {"added_tokens",
       {{{"id", 20}, {"content", "[A]"}, {"lstrip", true}, {"special", true}},
        {{"id", 21}, {"content", "[B]"}, {"rstrip", true}},
        {{"id", 22}, {"content", "cab"}, {"single_word", true}, {"normalized", false}},
        {{"id", 23}, {"content", "xY"}, {"normalized", true}}}},
      {"decoder", {{"type", "Sequence"}, {"decoders", {{{"type", "ByteFallback"}}, {{"type", "Fuse"}}}}}},
  };
}

Tokenizer MustParse(const Json& json) {
  Result<Tokenizer> t = Tokenizer::FromJson(json.dump(), "", "test/tokenizer.json");
  EXPECT_TRUE(t.ok()) << t.status().message();
  return *t;
}

TEST(Tokenizer, AddedTokensStripSingleWordAndNormalizedAsHuggingFace) {
  const Tokenizer t = MustParse(CharTokenizer());
  using V = std::vector<int32_t>;
  EXPECT_EQ(t.Encode("c [A] c", false), (V{4, 20, 1, 4}));  // lstrip takes the space before
  EXPECT_EQ(t.Encode("c [B] c", false), (V{4, 1, 21, 4}));  // rstrip the one after
  EXPECT_EQ(t.Encode("cab", false), (V{22}));
  EXPECT_EQ(t.Encode("acab", false), (V{2, 4, 9}));         // single_word: not inside a word (and a b merges)
  EXPECT_EQ(t.Encode("xy", false), (V{23}));                // normalized: matched after y -> Y
  EXPECT_EQ(t.Encode("zz", false), (V{0}));                 // unknown, fused
  EXPECT_EQ(t.Encode("\xC3\xA9", false), (V{7, 8}));        // byte fallback
  EXPECT_EQ(t.Decode(V{2, 7, 8, 20, 3}, false), "a\xC3\xA9[A]b");
  EXPECT_EQ(t.Decode(V{2, 7, 8, 20, 3}, true), "a\xC3\xA9" "b");  // [A] is special
  EXPECT_EQ(t.Decode(V{7, 2}, false), kFffd + "a");               // a lone byte: U+FFFD
  EXPECT_EQ(t.Decode(V{2, 999, -1}, false), "a");                 // unknown ids are left out
  EXPECT_TRUE(t.IsSpecial(20));
  EXPECT_FALSE(t.IsSpecial(21));
  EXPECT_EQ(t.TokenToId("[B]"), 21);
  EXPECT_EQ(t.vocab_size(), 24);
}

TEST(Tokenizer, MetaspaceEncodesAndDecodesAsHuggingFace) {
  Json vocab = {{"<unk>", 0}, {"\u2581", 1}, {"a", 2}, {"b", 3}, {"\u2581a", 4}, {"</s>", 5}};
  Json json = {
      {"pre_tokenizer", {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "first"}, {"split", true}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", Json::array({"\u2581 a"})}, {"unk_token", "<unk>"}}},
      {"added_tokens", {{{"id", 5}, {"content", "</s>"}, {"special", true}}}},
      {"decoder", {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "first"}}},
  };
  const Tokenizer t = MustParse(json);
  using V = std::vector<int32_t>;
  // "first": only the text at the input's start gets the prepended marker; split: each marker starts a word.
  EXPECT_EQ(t.Encode("a b</s>a", false), (V{4, 1, 3, 5, 2}));
  EXPECT_EQ(t.Encode("</s>a a", false), (V{5, 2, 4}));
  // The decoder drops every marker of the first token, and turns the others into spaces.
  EXPECT_EQ(t.Decode(V{4, 1, 3}, false), "a b");
  EXPECT_EQ(t.Decode(V{3, 4, 1, 4}, false), "b a  a");
  EXPECT_EQ(t.Decode(V{1, 4}, false), " a");
}

void ExpectRefused(const Json& json, const std::string& message) {
  Result<Tokenizer> t = Tokenizer::FromJson(json.is_null() ? "{" : json.dump(), "", "m/tokenizer.json");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(), message);
}

TEST(Tokenizer, AMalformedFileIsRefusedNamingTheFileAndTheField) {
  ExpectRefused(nullptr, "m/tokenizer.json: not valid JSON (at byte 2)");
  ExpectRefused(Json::array(), "m/tokenizer.json: not a JSON object");
  Json j = CharTokenizer();
  j["model"]["type"] = "WordPiece";
  ExpectRefused(j, "m/tokenizer.json: model.type: 'WordPiece' is not supported");
  j = CharTokenizer();
  j["model"]["merges"] = {"a q"};
  ExpectRefused(j, "m/tokenizer.json: model.merges[0]: merge 'a q': 'q' is not a token");
  j = CharTokenizer();
  j["model"]["merges"] = {"a b", "a c"};
  ExpectRefused(j, "m/tokenizer.json: model.merges[1]: merge 'a c': 'ac' is not a token");
  j = CharTokenizer();
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {{{"type", "Metaspace"}, {"replacement", "_"}}, {{"type", "Digits"}}}}};
  ExpectRefused(j, "m/tokenizer.json: pre_tokenizer.pretokenizers[1].type: 'Digits' is not supported");
  j = CharTokenizer();
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "a+"}}}, {"behavior", "Isolated"}};
  ExpectRefused(j, "m/tokenizer.json: pre_tokenizer.pattern.Regex: the Split pattern a+ is not one this tokenizer "
                   "knows (Llama 3's, Qwen's or GPT-2's)");
  j = CharTokenizer();
  j["added_tokens"][1].erase("content");
  ExpectRefused(j, "m/tokenizer.json: added_tokens[1].content: missing");
  j = CharTokenizer();
  j["model"]["vocab"]["d"] = "seven";
  ExpectRefused(j, "m/tokenizer.json: model.vocab: 'd' must map to an id in [0, 2^30]");
  j = CharTokenizer();
  j["model"]["dropout"] = 0.1;
  ExpectRefused(j, "m/tokenizer.json: model.dropout: BPE dropout is not supported (it makes encoding random)");
}

TEST(Tokenizer, SpecialTokensComeFromTheConfigBesideTheFile) {
  Result<Tokenizer> llama2 = Tokenizer::Load(kFixtures / "llama2/tokenizer.json");
  Result<Tokenizer> llama3 = Tokenizer::Load(kFixtures / "llama3/tokenizer.json");
  Result<Tokenizer> qwen3 = Tokenizer::Load(kFixtures / "qwen3/tokenizer.json");
  ASSERT_TRUE(llama2.ok() && llama3.ok() && qwen3.ok());
  EXPECT_EQ(llama2->bos_id(), 1);
  EXPECT_EQ(llama2->eos_id(), 2);
  EXPECT_EQ(llama2->pad_id(), std::nullopt);
  EXPECT_EQ(llama3->bos_id(), 128000);
  EXPECT_EQ(llama3->eos_id(), 128001);
  EXPECT_EQ(qwen3->bos_id(), std::nullopt);
  EXPECT_EQ(qwen3->eos_id(), qwen3->TokenToId("<|im_end|>"));
  EXPECT_EQ(qwen3->pad_id(), 151643);
  EXPECT_EQ(llama2->Encode("", true), (std::vector<int32_t>{1}));  // the template's BOS, as there

  Json config = {{"bos_token", {{"content", "<nope>"}, {"__type", "AddedToken"}}}};
  Result<Tokenizer> t = Tokenizer::FromJson(CharTokenizer().dump(), config.dump(), "m/tokenizer.json");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(), "m/tokenizer_config.json: bos_token: '<nope>' is not a token of the tokenizer");
  Result<Tokenizer> missing = Tokenizer::Load("/nonexistent/tokenizer.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/tokenizer.json: cannot open"), std::string::npos);
}

struct ShellRun {
  int exit_code;
  std::string output;
};

ShellRun RunShell(const std::string& command) {
  ShellRun run{-1, ""};
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;) run.output.append(buffer, n);
  const int status = pclose(pipe);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

const std::string kLm = std::string(ESTUARY_BINARY_DIR) + "/models/estuary-lm";

TEST(EstuaryLm, TokenizeWritesOneJsonArrayPerLineAndDecodesThemBack) {
  const std::string llama3 = (kFixtures / "llama3/tokenizer.json").string();
  ShellRun run = RunShell(fmt::format("printf 'Hello world\\n\\n<|begin_of_text|>hi\\n' | {} tokenize --tokenizer {}", kLm, llama3));
  EXPECT_EQ(run.exit_code, 0);
  EXPECT_EQ(run.output, "[9906,1917]\n[]\n[128000,6151]\n");
  run = RunShell(fmt::format("printf '[9906,1917]\\n[128000,6151]\\n' | {} tokenize --decode --skip-special-tokens --tokenizer {}",
                             kLm, llama3));
  EXPECT_EQ(run.exit_code, 0);
  EXPECT_EQ(run.output, "Hello world\nhi\n");
  const std::string llama2 = (kFixtures / "llama2/tokenizer.json").string();
  run = RunShell(fmt::format("echo 'Hello world' | {} tokenize --add-special-tokens --tokenizer {}", kLm, llama2));
  EXPECT_EQ(run.output, "[1,22557,1526]\n");
}

TEST(EstuaryLm, ErrorsAreOneLine) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("estuary-lm-test-{}", getpid());
  fs::create_directories(dir);
  Json bad = CharTokenizer();
  bad["decoder"]["decoders"][1]["type"] = "CTC";
  std::ofstream(dir / "tokenizer.json") << bad.dump();
  ShellRun run = RunShell(fmt::format("echo hi | {} tokenize --tokenizer {}", kLm, (dir / "tokenizer.json").string()));
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_EQ(run.output, fmt::format("estuary-lm: {}: decoder.decoders[1].type: 'CTC' is not supported\n",
                                    (dir / "tokenizer.json").string()));
  std::ofstream(dir / "tokenizer.json") << CharTokenizer().dump();
  run = RunShell(fmt::format("printf '[1]\\n[1,\"x\"]\\n' | {} tokenize --decode --tokenizer {}", kLm,
                             (dir / "tokenizer.json").string()));
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_EQ(run.output, " \nestuary-lm: standard input, line 2: not a JSON array of token ids\n");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace estuary::models
