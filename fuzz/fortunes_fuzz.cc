// A fortune file's text through models::SplitFortunes and the byte
// tokenizer. Each document must be a non-empty piece of the text that holds no
// `%` separator line and does not end in a line break; the tokenizer must
// give the bytes back.
#include <string_view>

#include "fuzz/fuzz_util.h"
#include "models/text_corpus.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace estuary;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const char* end = text.data() + text.size();
  for (std::string_view doc : models::SplitFortunes(text)) {
    FUZZ_CHECK(!doc.empty() && doc.data() >= text.data() && doc.data() + doc.size() <= end);
    FUZZ_CHECK(doc.back() != '\n' && doc.back() != '\r');
    // No line ended by a line break inside it is a separator ("%", or "%\r").
    // (The last line may read "%" once trimmed: "%\r\r" is no separator.)
    for (size_t line = 0, next; (next = doc.find('\n', line)) != std::string_view::npos; line = next + 1) {
      std::string_view content = doc.substr(line, next - line);
      if (content.ends_with('\r')) content.remove_suffix(1);
      FUZZ_CHECK(content != "%", "a separator inside a document at byte %zu", line);
    }
  }
  auto decoded = models::ByteTokenizer::Decode(models::ByteTokenizer::Encode(text));
  FUZZ_CHECK(decoded.ok() && *decoded == text);
  return 0;
}
