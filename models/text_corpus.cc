#include "models/text_corpus.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "base/seed.h"

namespace estuary::models {

namespace fs = std::filesystem;

std::vector<int32_t> ByteTokenizer::Encode(std::string_view text) {
  std::vector<int32_t> tokens(text.size());
  for (size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<unsigned char>(text[i]);
  return tokens;
}

Result<std::string> ByteTokenizer::Decode(std::span<const int32_t> tokens) {
  std::string text(tokens.size(), '\0');
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= kVocabSize) {
      return InvalidArgument("tokenizer: token {} at position {} is not a byte", tokens[i], i);
    }
    text[i] = static_cast<char>(tokens[i]);
  }
  return text;
}

std::vector<std::string_view> SplitFortunes(std::string_view text) {
  std::vector<std::string_view> documents;
  size_t begin = 0;
  auto flush = [&](size_t end) {
    std::string_view doc = text.substr(begin, end - begin);
    while (!doc.empty() && (doc.back() == '\n' || doc.back() == '\r')) doc.remove_suffix(1);
    if (!doc.empty()) documents.push_back(doc);
  };
  size_t line = 0;
  while (line < text.size()) {
    size_t next = text.find('\n', line);
    if (next == std::string_view::npos) next = text.size();
    std::string_view content = text.substr(line, next - line);
    if (!content.empty() && content.back() == '\r') content.remove_suffix(1);
    if (content == "%") {
      flush(line);
      begin = std::min(next + 1, text.size());
    }
    line = next + 1;
  }
  if (begin < text.size()) flush(text.size());
  return documents;
}

namespace {

bool LooksLikeFortuneFile(const fs::directory_entry& entry) {
  std::error_code ec;
  if (!entry.is_regular_file(ec) || entry.is_symlink(ec)) return false;
  const std::string name = entry.path().filename().string();
  return !name.empty() && name[0] != '.' && entry.path().extension().empty();
}

void Append(std::vector<int32_t>& stream, std::string_view document) {
  static constexpr std::string_view kSeparator = "\n%\n";
  for (char c : document) stream.push_back(static_cast<unsigned char>(c));
  for (char c : kSeparator) stream.push_back(static_cast<unsigned char>(c));
}

}  // namespace

Result<std::vector<TextSource>> LoadFortunes(const fs::path& dir, const CorpusOptions& options) {
  if (!(options.test_fraction > 0 && options.test_fraction < 1)) {
    return InvalidArgument("corpus: test fraction {} not in (0, 1)", options.test_fraction);
  }
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return NotFound("{}: no such text directory (Debian's fortunes package installs one)", dir.string());
  }
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (LooksLikeFortuneFile(entry)) files.push_back(entry.path());
  }
  if (ec) return IoError("{}: cannot list: {}", dir.string(), ec.message());
  std::sort(files.begin(), files.end());

  // Documents go to test when a uniform draw from their own hash falls
  // below the fraction: independent of every other document.
  const uint64_t threshold = static_cast<uint64_t>(options.test_fraction * 18446744073709551616.0);
  std::vector<TextSource> sources;
  for (const fs::path& file : files) {
    std::ifstream in(file, std::ios::binary);
    if (!in) return IoError("{}: cannot open", file.string());
    std::ostringstream text;
    text << in.rdbuf();
    if (in.bad()) return IoError("{}: read failed", file.string());
    const std::string content = std::move(text).str();
    TextSource source;
    source.name = file.filename().string();
    const uint64_t source_seed = MixSeed(options.seed, source.name);
    const auto documents = SplitFortunes(content);
    for (size_t i = 0; i < documents.size(); ++i) {
      if (MixSeed(source_seed, uint64_t{i}) < threshold) {
        Append(source.test, documents[i]);
        ++source.test_documents;
      } else {
        Append(source.train, documents[i]);
        ++source.train_documents;
      }
    }
    if (source.train.size() >= options.min_tokens && source.test.size() >= options.min_tokens &&
        !source.train.empty() && !source.test.empty()) {
      sources.push_back(std::move(source));
    }
  }
  if (sources.empty()) {
    return NotFound("{}: no fortune file with at least {} train and test tokens among {} files", dir.string(),
                    options.min_tokens, files.size());
  }
  return sources;
}

}  // namespace estuary::models
