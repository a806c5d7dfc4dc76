#include "simulations/instruction_sites.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "simulations/partition.h"

namespace estuary::simulations {
namespace {

// The lines of `text` the examples came from (each example knows its line),
// each ending in a newline.
std::string LinesNumbered(std::string_view text, const std::vector<models::InstructionExample>& examples) {
  std::string out;
  size_t next = 0;  // into examples, which are in file order
  uint64_t line = 1;
  for (size_t start = 0; start < text.size() && next < examples.size(); ++line) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    if (examples[next].line == line) {
      out.append(text.substr(start, end - start)).push_back('\n');
      ++next;
    }
    start = end + 1;
  }
  return out;
}

// Each line's value of `field` (the lines already parsed as examples, so
// every one is a JSON object).
Result<std::vector<std::string>> FieldValues(const std::string& text, const std::vector<models::InstructionExample>& examples,
                                             const std::string& file, const std::string& field, const char* flag) {
  std::vector<std::string_view> lines;
  for (size_t at = 0; at < text.size();) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    lines.push_back(std::string_view(text).substr(at, end - at));
    at = end + 1;
  }
  std::vector<std::string> values;
  for (const models::InstructionExample& e : examples) {
    if (e.line == 0 || e.line > lines.size()) return Internal("{}: example of line {} past the file's end", file, e.line);
    const nlohmann::json json = nlohmann::json::parse(lines[e.line - 1], nullptr, /*allow_exceptions=*/false);
    auto it = json.is_object() ? json.find(field) : json.end();
    if (!json.is_object() || it == json.end() || it->is_null()) {
      return InvalidArgument("{}, line {}: no field '{}' ({} {})", file, e.line, field, flag, field);
    }
    if (it->is_string()) {
      values.push_back(it->get<std::string>());
    } else if (it->is_number() || it->is_boolean()) {
      values.push_back(it->dump());
    } else {
      return InvalidArgument("{}, line {}: '{}' is {}, not a string, number or boolean ({} {})", file, e.line, field,
                             it->type_name(), flag, field);
    }
  }
  return values;
}

// A site's name from a field's value: letters, digits, '.', '_' and '-'
// kept, anything else '_' (names become certificate names in loopback runs).
std::string SiteName(const std::string& value) {
  std::string name;
  for (char c : value.substr(0, 48)) {
    const bool keep = std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
    name += keep ? c : '_';
  }
  return name.empty() ? "_" : name;
}

}  // namespace

Result<InstructionSplit> SplitInstructionFile(const InstructionSplitOptions& o) {
  const bool by_field = !o.partition_by.empty(), by_dirichlet = o.dirichlet_alpha > 0 || !o.label_field.empty();
  if (by_field == by_dirichlet) {
    return InvalidArgument("sim: --data {}: split the file by --partition-by FIELD or by --dirichlet ALPHA "
                           "--label-field FIELD (one of the two)",
                           o.data.string());
  }
  if (by_dirichlet && (!(o.dirichlet_alpha > 0) || o.label_field.empty())) {
    return InvalidArgument("sim: --dirichlet {} needs ALPHA > 0 and --label-field FIELD", o.dirichlet_alpha);
  }
  ESTUARY_ASSIGN_OR_RETURN(const models::PromptTemplate t, models::PromptTemplateNamed(o.prompt_template));
  ESTUARY_ASSIGN_OR_RETURN(const models::Tokenizer tokenizer, models::Tokenizer::Load(o.tokenizer));
  std::ifstream in(o.data, std::ios::binary);
  if (!in) return IoError("{}: cannot read", o.data.string());
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string text = buffer.str();
  const std::string file = o.data.string();
  ESTUARY_ASSIGN_OR_RETURN(std::vector<models::InstructionExample> examples,
                           models::ParseInstructionJsonl(text, file));
  ESTUARY_ASSIGN_OR_RETURN(const std::vector<std::string> values,
                           FieldValues(text, examples, file, by_field ? o.partition_by : o.label_field,
                                       by_field ? "--partition-by" : "--label-field"));

  // Held out: each example with probability held_out_fraction, by seeded draws in file order.
  DeterministicRandom random(o.seed);
  std::vector<bool> held(examples.size());
  size_t held_count = 0;
  for (size_t i = 0; i < examples.size(); ++i) held_count += held[i] = random.Uniform01() < o.held_out_fraction;
  if (held_count == 0) held[examples.size() - 1] = true, ++held_count;
  std::vector<models::InstructionExample> held_out;
  std::vector<size_t> kept;  // indices of the examples the sites share
  for (size_t i = 0; i < examples.size(); ++i) {
    if (held[i]) {
      held_out.push_back(examples[i]);
    } else {
      kept.push_back(i);
    }
  }
  InstructionSplit split;
  split.held_out_jsonl = LinesNumbered(text, held_out);

  // Distinct values, in sorted order: a site (by field) or a class (Dirichlet) each.
  std::map<std::string, int32_t> index_of;
  for (size_t i : kept) index_of.emplace(values[i], 0);
  int32_t next = 0;
  for (auto& [value, index] : index_of) index = next++;
  std::vector<std::vector<uint32_t>> members;  // per site, indices into `kept`
  if (by_field) {
    if (o.sites != 0 && o.sites != index_of.size()) {
      return InvalidArgument("sim: --sites {} but '{}' takes {} values in {} (one site each)", o.sites,
                             o.partition_by, index_of.size(), file);
    }
    members.resize(index_of.size());
    for (uint32_t k = 0; k < kept.size(); ++k) members[size_t(index_of[values[kept[k]]])].push_back(k);
    for (const auto& [value, index] : index_of) split.names.push_back(SiteName(value));
    std::vector<std::string> sorted = split.names;
    std::sort(sorted.begin(), sorted.end());
    if (auto dup = std::adjacent_find(sorted.begin(), sorted.end()); dup != sorted.end()) {
      return InvalidArgument("sim: two values of '{}' in {} make the same site name '{}'", o.partition_by, file,
                             *dup);
    }
  } else {
    std::vector<int32_t> labels;
    for (size_t i : kept) labels.push_back(index_of[values[i]]);
    ESTUARY_ASSIGN_OR_RETURN(members, Partition(labels, int(index_of.size()), int(o.sites),
                                                {.kind = PartitionSpec::kDirichlet, .alpha = o.dirichlet_alpha},
                                                o.seed));
    for (uint32_t i = 0; i < o.sites; ++i) split.names.push_back(fmt::format("client-{:03}", i));
  }
  for (size_t s = 0; s < members.size(); ++s) {
    std::vector<models::InstructionExample> mine;
    for (uint32_t k : members[s]) mine.push_back(examples[kept[k]]);
    ESTUARY_ASSIGN_OR_RETURN(models::InstructionSet set,
                             models::EncodeInstructionSet(mine, tokenizer, t, file));
    split.sites.push_back(std::move(set));
  }
  ESTUARY_ASSIGN_OR_RETURN(const models::InstructionSet evaluation,
                           models::EncodeInstructionSet(held_out, tokenizer, t, file));
  split.held_out = std::make_shared<const models::TokenRows>(models::PackForTraining(evaluation, o.seq_len).rows);
  return split;
}

}  // namespace estuary::simulations
