// Simulated sites drawn from one JSON Lines file of instruction examples
// (models/instruction_data.h): a seeded share of the examples is held out
// for the evaluator (their response loss), and the rest is split among the
// sites either
//
//   by field      one site per distinct value of a field of each line
//                 (--partition-by FIELD: "source", "language", ...), named
//                 after the value; or
//   by Dirichlet  Hsu et al.'s split over the values of a label field
//                 (--dirichlet ALPHA --label-field FIELD) among --sites K
//                 sites (simulations/partition.h, seeded).
//
// A field's value is a string, or a number or boolean read as its JSON text;
// a line without it fails the split naming the file, the line and the field.
// Every site's examples are rendered with the federation's template and the
// tokenizer (models/instruction_set.h).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "models/instruction_set.h"
#include "models/lm_sequences.h"

namespace estuary::simulations {

struct InstructionSplitOptions {
  std::filesystem::path data;       // the JSON Lines file
  std::filesystem::path tokenizer;  // tokenizer.json
  std::string prompt_template;      // the federation's
  uint32_t sites = 0;               // by field: 0 or the number of distinct values
  std::string partition_by;         // by field
  double dirichlet_alpha = 0;       // by Dirichlet, with label_field
  std::string label_field;
  double held_out_fraction = 0.1;   // of the examples, at least one
  int seq_len = 128;                // the held-out rows'
  uint64_t seed = 0;
};

struct InstructionSplit {
  std::vector<std::string> names;                 // per site
  std::vector<models::InstructionSet> sites;      // per site
  std::shared_ptr<const models::TokenRows> held_out;
  std::string held_out_jsonl;  // the held-out examples' lines as the file has them (a server scores them)
};

Result<InstructionSplit> SplitInstructionFile(const InstructionSplitOptions& options);

}  // namespace estuary::simulations
