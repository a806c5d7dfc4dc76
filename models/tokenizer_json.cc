// Loading models/tokenizer.h's Tokenizer from tokenizer.json and
// tokenizer_config.json. Every refusal is one line naming the file and the
// field, as a JSON path ("tokenizer.json: model.merges[3]: ...").
#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "models/tokenizer.h"
#include "models/tokenizer_impl.h"

namespace estuary::models {

namespace {

using Json = nlohmann::json;

// A JSON value with the path that reached it, for messages.
struct Field {
  const Json& json;
  std::string path;
  const std::string& file;

  Status Error(std::string_view what) const { return InvalidArgument("{}: {}: {}", file, path, what); }
  bool Has(const char* key) const { return json.is_object() && json.contains(key) && !json[key].is_null(); }
  Field operator[](const char* key) const {
    static const Json null;
    const Json& value = json.is_object() && json.contains(key) ? json[key] : null;
    return {value, path.empty() ? key : path + "." + key, file};
  }
  Field At(size_t i) const { return {json[i], fmt::format("{}[{}]", path, i), file}; }

  Result<std::string> String() const {
    if (!json.is_string()) return Error(json.is_null() ? "missing" : "must be a string");
    return json.get<std::string>();
  }
  Result<bool> Bool(bool absent) const {
    if (json.is_null()) return absent;
    if (!json.is_boolean()) return Error("must be true or false");
    return json.get<bool>();
  }
  Result<int64_t> Int() const {
    if (!json.is_number_integer()) return Error(json.is_null() ? "missing" : "must be an integer");
    return json.get<int64_t>();
  }
  Status Array() const { return json.is_array() ? Status::Ok() : Error(json.is_null() ? "missing" : "must be an array"); }
  Result<std::string> Type() const {
    if (!json.is_object()) return Error("must be an object");
    return (*this)["type"].String();
  }
  Status Unsupported(std::string_view type) const {
    return InvalidArgument("{}: {}.type: '{}' is not supported", file, path, type);
  }
};

// A "pattern" of Replace: only a plain string is supported.
Result<std::string> PatternString(const Field& f) {
  Field pattern = f["pattern"];
  if (pattern.Has("String")) return pattern["String"].String();
  if (pattern.Has("Regex")) return pattern.Error("a Regex pattern is not supported here, only a String");
  return pattern.Error("missing");
}

Status ReadNormalizer(const Field& f, std::vector<NormalizerStep>* out) {
  if (f.json.is_null()) return Status::Ok();
  ESTUARY_ASSIGN_OR_RETURN(std::string type, f.Type());
  if (type == "Sequence") {
    Field list = f["normalizers"];
    ESTUARY_RETURN_IF_ERROR(list.Array());
    for (size_t i = 0; i < list.json.size(); ++i) ESTUARY_RETURN_IF_ERROR(ReadNormalizer(list.At(i), out));
  } else if (type == "NFC") {
    out->push_back({NormalizerStep::kNfc});
  } else if (type == "Prepend") {
    ESTUARY_ASSIGN_OR_RETURN(std::string text, f["prepend"].String());
    out->push_back({NormalizerStep::kPrepend, text});
  } else if (type == "Replace") {
    ESTUARY_ASSIGN_OR_RETURN(std::string text, PatternString(f));
    ESTUARY_ASSIGN_OR_RETURN(std::string content, f["content"].String());
    if (text.empty()) return f["pattern"].Error("must not be empty");
    out->push_back({NormalizerStep::kReplace, text, content});
  } else {
    return f.Unsupported(type);
  }
  return Status::Ok();
}

Result<PreTokenizerStep::Prepend> MetaspacePrepend(const Field& f) {
  if (f.Has("prepend_scheme")) {
    ESTUARY_ASSIGN_OR_RETURN(std::string scheme, f["prepend_scheme"].String());
    if (scheme == "always") return PreTokenizerStep::kAlways;
    if (scheme == "first") return PreTokenizerStep::kFirst;
    if (scheme == "never") return PreTokenizerStep::kNever;
    return f["prepend_scheme"].Error(fmt::format("'{}' is not always, first or never", scheme));
  }
  // Files older than prepend_scheme say add_prefix_space.
  ESTUARY_ASSIGN_OR_RETURN(bool add, f["add_prefix_space"].Bool(true));
  return add ? PreTokenizerStep::kAlways : PreTokenizerStep::kNever;
}

Status ReadPreTokenizer(const Field& f, std::vector<PreTokenizerStep>* out) {
  if (f.json.is_null()) return Status::Ok();
  ESTUARY_ASSIGN_OR_RETURN(std::string type, f.Type());
  PreTokenizerStep step;
  if (type == "Sequence") {
    Field list = f["pretokenizers"];
    ESTUARY_RETURN_IF_ERROR(list.Array());
    for (size_t i = 0; i < list.json.size(); ++i) ESTUARY_RETURN_IF_ERROR(ReadPreTokenizer(list.At(i), out));
    return Status::Ok();
  } else if (type == "Split") {
    step.kind = PreTokenizerStep::kSplit;
    Field pattern = f["pattern"];
    if (!pattern.Has("Regex")) return pattern.Error("only a Regex pattern is supported");
    ESTUARY_ASSIGN_OR_RETURN(std::string regex, pattern["Regex"].String());
    Result<SplitPattern> parsed = SplitPattern::FromRegex(regex);
    if (!parsed.ok()) return pattern["Regex"].Error(parsed.status().message());
    step.pattern = *parsed;
    ESTUARY_ASSIGN_OR_RETURN(std::string behavior, f["behavior"].String());
    if (behavior != "Isolated") return f["behavior"].Error(fmt::format("'{}' is not supported, only Isolated", behavior));
    ESTUARY_ASSIGN_OR_RETURN(bool invert, f["invert"].Bool(false));
    if (invert) return f["invert"].Error("only false is supported");
  } else if (type == "ByteLevel") {
    step.kind = PreTokenizerStep::kByteLevel;
    ESTUARY_ASSIGN_OR_RETURN(step.add_prefix_space, f["add_prefix_space"].Bool(true));
    ESTUARY_ASSIGN_OR_RETURN(step.use_regex, f["use_regex"].Bool(true));
    step.pattern = SplitPattern::Gpt2();
  } else if (type == "Metaspace") {
    step.kind = PreTokenizerStep::kMetaspace;
    ESTUARY_ASSIGN_OR_RETURN(step.replacement, f["replacement"].String());
    ESTUARY_ASSIGN_OR_RETURN(step.prepend, MetaspacePrepend(f));
    ESTUARY_ASSIGN_OR_RETURN(step.split, f["split"].Bool(true));
  } else {
    return f.Unsupported(type);
  }
  out->push_back(std::move(step));
  return Status::Ok();
}

Status ReadDecoder(const Field& f, std::vector<DecoderStep>* out) {
  ESTUARY_ASSIGN_OR_RETURN(std::string type, f.Type());
  DecoderStep step;
  if (type == "Sequence") {
    Field list = f["decoders"];
    ESTUARY_RETURN_IF_ERROR(list.Array());
    for (size_t i = 0; i < list.json.size(); ++i) ESTUARY_RETURN_IF_ERROR(ReadDecoder(list.At(i), out));
    return Status::Ok();
  } else if (type == "ByteLevel") {
    step.kind = DecoderStep::kByteLevel;
  } else if (type == "Replace") {
    step.kind = DecoderStep::kReplace;
    ESTUARY_ASSIGN_OR_RETURN(step.text, PatternString(f));
    ESTUARY_ASSIGN_OR_RETURN(step.content, f["content"].String());
  } else if (type == "ByteFallback") {
    step.kind = DecoderStep::kByteFallback;
  } else if (type == "Fuse") {
    step.kind = DecoderStep::kFuse;
  } else if (type == "Strip") {
    step.kind = DecoderStep::kStrip;
    ESTUARY_ASSIGN_OR_RETURN(step.content, f["content"].String());
    ESTUARY_ASSIGN_OR_RETURN(int64_t start, f["start"].Int());
    ESTUARY_ASSIGN_OR_RETURN(int64_t stop, f["stop"].Int());
    if (start < 0 || stop < 0) return f.Error("start and stop must be >= 0");
    step.start = int(start);
    step.stop = int(stop);
  } else if (type == "Metaspace") {
    step.kind = DecoderStep::kMetaspace;
    ESTUARY_ASSIGN_OR_RETURN(step.text, f["replacement"].String());
    ESTUARY_ASSIGN_OR_RETURN(PreTokenizerStep::Prepend prepend, MetaspacePrepend(f));
    step.prepend = prepend != PreTokenizerStep::kNever;
  } else {
    return f.Unsupported(type);
  }
  out->push_back(std::move(step));
  return Status::Ok();
}

// The single-sequence template: the special tokens before and after $A.
Status ReadPostProcessor(const Field& f, TokenizerImpl* t) {
  if (f.json.is_null()) return Status::Ok();
  ESTUARY_ASSIGN_OR_RETURN(std::string type, f.Type());
  if (type == "Sequence") {
    Field list = f["processors"];
    ESTUARY_RETURN_IF_ERROR(list.Array());
    for (size_t i = 0; i < list.json.size(); ++i) ESTUARY_RETURN_IF_ERROR(ReadPostProcessor(list.At(i), t));
    return Status::Ok();
  }
  if (type == "ByteLevel") return Status::Ok();  // offsets only
  if (type != "TemplateProcessing") return f.Unsupported(type);
  Field single = f["single"];
  ESTUARY_RETURN_IF_ERROR(single.Array());
  bool after = false;
  for (size_t i = 0; i < single.json.size(); ++i) {
    Field item = single.At(i);
    if (item.Has("Sequence")) {
      ESTUARY_ASSIGN_OR_RETURN(std::string id, item["Sequence"]["id"].String());
      if (id != "A" || after) return item.Error("the single template must hold $A once");
      after = true;
      continue;
    }
    ESTUARY_ASSIGN_OR_RETURN(std::string name, item["SpecialToken"]["id"].String());
    Field ids = f["special_tokens"][name.c_str()]["ids"];
    ESTUARY_RETURN_IF_ERROR(ids.Array());
    for (size_t k = 0; k < ids.json.size(); ++k) {
      ESTUARY_ASSIGN_OR_RETURN(int64_t id, ids.At(k).Int());
      (after ? t->template_suffix : t->template_prefix).push_back(int32_t(id));
    }
  }
  if (!after) return single.Error("the single template must hold $A once");
  return Status::Ok();
}

Status ReadModel(const Field& f, TokenizerImpl* t) {
  ESTUARY_ASSIGN_OR_RETURN(std::string type, f.Type());
  if (type != "BPE") return f.Unsupported(type);
  if (f.Has("dropout")) return f["dropout"].Error("BPE dropout is not supported (it makes encoding random)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (f.Has(key) && !(f[key].json.is_string() && f[key].json.get<std::string>().empty())) {
      return f[key].Error("only null or \"\" is supported");
    }
  }
  Bpe::Options options;
  for (const PreTokenizerStep& step : t->pre_tokenizers) options.byte_level |= step.kind == PreTokenizerStep::kByteLevel;
  ESTUARY_ASSIGN_OR_RETURN(options.byte_fallback, f["byte_fallback"].Bool(false));
  ESTUARY_ASSIGN_OR_RETURN(options.ignore_merges, f["ignore_merges"].Bool(false));
  ESTUARY_ASSIGN_OR_RETURN(options.fuse_unk, f["fuse_unk"].Bool(false));

  Field vocab = f["vocab"];
  if (!vocab.json.is_object()) return vocab.Error(vocab.json.is_null() ? "missing" : "must be an object");
  std::vector<std::pair<std::string, int32_t>> entries;
  entries.reserve(vocab.json.size());
  int64_t max_id = -1;
  for (const auto& [token, id] : vocab.json.items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > (int64_t(1) << 30)) {
      return vocab.Error(fmt::format("'{}' must map to an id in [0, 2^30]", token));
    }
    entries.emplace_back(token, int32_t(id.get<int64_t>()));
    max_id = std::max(max_id, id.get<int64_t>());
  }
  if (f.Has("unk_token")) {
    ESTUARY_ASSIGN_OR_RETURN(std::string unk, f["unk_token"].String());
    if (!vocab.json.contains(unk)) return f["unk_token"].Error(fmt::format("'{}' is not in the vocabulary", unk));
    options.unk_id = vocab.json[unk].get<int32_t>();
  }
  t->model.emplace(options);
  t->tokens.assign(size_t(max_id + 1), "");
  t->has_token.assign(size_t(max_id + 1), false);
  for (auto& [token, id] : entries) {
    if (t->has_token[id]) return vocab.Error(fmt::format("id {} is given to two tokens", id));
    ESTUARY_RETURN_IF_ERROR(t->model->AddToken(token, id));
    t->ids.emplace(token, id);
    t->tokens[id] = std::move(token);
    t->has_token[id] = true;
  }

  // Merges are "left right" strings or, in newer files, [left, right] pairs.
  Field merges = f["merges"];
  ESTUARY_RETURN_IF_ERROR(merges.Array());
  for (size_t i = 0; i < merges.json.size(); ++i) {
    const Json& m = merges.json[i];
    std::string left, right;
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
        return merges.At(i).Error("a merge must be two tokens separated by one space");
      }
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      return merges.At(i).Error("a merge must be \"left right\" or [left, right]");
    }
    Status s = t->model->AddMerge(left, right);
    if (!s.ok()) return merges.At(i).Error(s.message());
  }
  Status s = t->model->Finish();
  if (!s.ok()) return vocab.Error(s.message());
  return Status::Ok();
}

Status ReadAddedTokens(const Field& list, TokenizerImpl* t) {
  if (list.json.is_null()) return Status::Ok();
  ESTUARY_RETURN_IF_ERROR(list.Array());
  for (size_t i = 0; i < list.json.size(); ++i) {
    Field f = list.At(i);
    AddedToken token;
    ESTUARY_ASSIGN_OR_RETURN(int64_t id, f["id"].Int());
    if (id < 0 || id > (int64_t(1) << 30)) return f["id"].Error("must be in [0, 2^30]");
    token.id = int32_t(id);
    ESTUARY_ASSIGN_OR_RETURN(token.content, f["content"].String());
    if (token.content.empty()) return f["content"].Error("must not be empty");
    ESTUARY_ASSIGN_OR_RETURN(token.special, f["special"].Bool(false));
    ESTUARY_ASSIGN_OR_RETURN(token.single_word, f["single_word"].Bool(false));
    ESTUARY_ASSIGN_OR_RETURN(token.lstrip, f["lstrip"].Bool(false));
    ESTUARY_ASSIGN_OR_RETURN(token.rstrip, f["rstrip"].Bool(false));
    ESTUARY_ASSIGN_OR_RETURN(token.normalized, f["normalized"].Bool(!token.special));
    if (size_t(token.id) >= t->tokens.size()) {
      t->tokens.resize(token.id + 1);
      t->has_token.resize(token.id + 1, false);
    }
    t->tokens[token.id] = token.content;
    t->has_token[token.id] = true;
    t->ids[token.content] = token.id;
    t->added.push_back(std::move(token));
  }
  t->special.assign(t->tokens.size(), false);
  for (size_t i = 0; i < t->added.size(); ++i) {
    const AddedToken& token = t->added[i];
    if (token.special) t->special[token.id] = true;
    if (token.normalized) t->normalized_added.Add(t->Normalize(token.content), i);
    else t->raw_added.Add(token.content, i);
  }
  return Status::Ok();
}

// A token of tokenizer_config.json: a string, an AddedToken object, or null.
Result<std::optional<int32_t>> ConfigToken(const Field& f, const TokenizerImpl& t) {
  if (f.json.is_null()) return std::optional<int32_t>();
  std::string content;
  if (f.json.is_object()) {
    ESTUARY_ASSIGN_OR_RETURN(content, f["content"].String());
  } else {
    ESTUARY_ASSIGN_OR_RETURN(content, f.String());
  }
  auto it = t.ids.find(content);
  if (it == t.ids.end()) return f.Error(fmt::format("'{}' is not a token of the tokenizer", content));
  return std::optional<int32_t>(it->second);
}

// The file's JSON object; a syntax error names the byte where it was found.
Result<Json> ParseObject(std::string_view text, const std::string& name) {
  Json json;
  try {
    json = Json::parse(text);
  } catch (const Json::parse_error& e) {
    return InvalidArgument("{}: not valid JSON (at byte {})", name, e.byte);
  }
  if (!json.is_object()) return InvalidArgument("{}: not a JSON object", name);
  return json;
}

Result<std::string> ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("{}: cannot open: {}", path.string(), std::strerror(errno));
  std::stringstream text;
  text << in.rdbuf();
  if (!in.good() && !in.eof()) return IoError("{}: cannot read", path.string());
  return text.str();
}

}  // namespace

Result<Tokenizer> Tokenizer::FromJson(std::string_view json_text, std::string_view config_text, const std::string& name) {
  auto t = std::make_shared<TokenizerImpl>();
  t->name = name;
  ESTUARY_ASSIGN_OR_RETURN(const Json json, ParseObject(json_text, name));
  const Field root{json, "", name};
  ESTUARY_RETURN_IF_ERROR(ReadNormalizer(root["normalizer"], &t->normalizers));
  ESTUARY_RETURN_IF_ERROR(ReadPreTokenizer(root["pre_tokenizer"], &t->pre_tokenizers));
  ESTUARY_RETURN_IF_ERROR(ReadModel(root["model"], t.get()));
  ESTUARY_RETURN_IF_ERROR(ReadAddedTokens(root["added_tokens"], t.get()));
  if (t->special.size() < t->tokens.size()) t->special.resize(t->tokens.size(), false);
  ESTUARY_RETURN_IF_ERROR(ReadPostProcessor(root["post_processor"], t.get()));
  for (int32_t id : t->template_prefix) {
    if (size_t(id) >= t->tokens.size() || !t->has_token[id]) return root["post_processor"].Error(fmt::format("id {} is not a token", id));
  }
  if (root.Has("decoder")) {
    t->has_decoder = true;
    ESTUARY_RETURN_IF_ERROR(ReadDecoder(root["decoder"], &t->decoders));
  }
  if (!config_text.empty()) {
    const std::string config_name = (std::filesystem::path(name).parent_path() / "tokenizer_config.json").string();
    ESTUARY_ASSIGN_OR_RETURN(const Json config, ParseObject(config_text, config_name));
    const Field c{config, "", config_name};
    ESTUARY_ASSIGN_OR_RETURN(t->bos, ConfigToken(c["bos_token"], *t));
    ESTUARY_ASSIGN_OR_RETURN(t->eos, ConfigToken(c["eos_token"], *t));
    ESTUARY_ASSIGN_OR_RETURN(t->pad, ConfigToken(c["pad_token"], *t));
  }
  return Tokenizer(std::move(t));
}

Result<Tokenizer> Tokenizer::Load(const std::filesystem::path& tokenizer_json) {
  ESTUARY_ASSIGN_OR_RETURN(std::string json, ReadFile(tokenizer_json));
  std::string config;
  const std::filesystem::path config_path = tokenizer_json.parent_path() / "tokenizer_config.json";
  if (std::filesystem::exists(config_path)) {
    ESTUARY_ASSIGN_OR_RETURN(config, ReadFile(config_path));
  }
  return FromJson(json, config, tokenizer_json.string());
}

}  // namespace estuary::models
