// A model the server knows only as a safetensors file: named tensors, each
// with a shape and a dtype, and no architecture (`estuary-server serve
// --initial-model FILE.safetensors`).
//
// The federation averages one flat fp32 buffer, so each tensor is one of two
// kinds:
//   federated  F32, BF16 and F16 tensors with at least one element. They
//              are widened exactly to fp32 (every half value is a float),
//              travel to the sites and are aggregated like any model's
//              weights; on export each is narrowed back to its own dtype,
//              rounding to nearest, ties to even (as torch's .to() does), so
//              a value the federation never changed comes back bit for bit.
//              A 0-d tensor travels as shape [1] and is exported as 0-d.
//   held       integer and bool tensors (I8..I64, U8..U64, BOOL) and tensors
//              of no elements: buffers such as BatchNorm's
//              num_batches_tracked, a count of the steps one site took that
//              no average makes meaningful. They are not sent, not averaged
//              and not trained by the federation: every export carries the
//              initial file's bytes unchanged (each site keeps its own
//              counts, as load_state_dict(strict=False) leaves them).
// F64 and the 8-bit float formats are refused: the fp32 average cannot give
// them back exactly, and the file should be converted first.
//
// The model's name is "custom@" and the first 12 hex digits of the SHA-256
// of its layout (CustomModelName): every tensor, held ones too, sorted by
// name, one line "name\tDTYPE\tdim,dim,...\n" each (a 0-d tensor's dims
// empty). A site computes the same from its own model's state dict to check
// that it trains what the server federates.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "base/manifest.h"
#include "base/status.h"

namespace estuary::models {

struct CustomTensor {
  std::string name;
  std::vector<int64_t> shape;  // as the file has it; may be empty (0-d)
  std::string dtype;           // as safetensors spells it: "F32", "BF16", "I64", ...
};

struct CustomModel {
  std::string name;                     // "custom@0123456789ab"
  std::string source;                   // the file it was read from
  std::vector<CustomTensor> layout;     // every tensor, in the file's data order
  Manifest manifest;                    // the federated tensors, fp32, in layout order
  std::vector<float> values;            // their values, manifest layout
  std::map<std::string, std::string> held;  // held tensor -> its bytes, as in the file
};

// "custom@" + 12 hex digits of the layout's SHA-256, as above.
std::string CustomModelName(const std::vector<CustomTensor>& layout);

// True for the dtypes the federation averages (F32, BF16, F16).
bool IsFederatedDType(const std::string& dtype);

// Reads a safetensors file. Every error is one line naming the file and
// what is wrong in it (a tensor, its dtype, the header).
Result<CustomModel> LoadCustomModel(const std::filesystem::path& path);

// What the server's operator must know of it, in one line: its name, where
// from, its tensors federated and held, and that the server can score none.
std::string DescribeCustomModel(const CustomModel& model);

// The checkpoint metadata that lets `estuary-server export` write the model
// back without the initial file: "custom_layout" (the layout, JSON) and
// "custom_held" (the held tensors' bytes, hex, JSON), beside the model's name.
std::map<std::string, std::string> CustomModelMetadata(const CustomModel& model);
// The model those keys describe, with `values` over its manifest (a
// checkpoint's data); errors name `where`.
Result<CustomModel> CustomModelFromMetadata(const std::map<std::string, std::string>& metadata,
                                            std::vector<float> values, const std::string& where);

// Writes `model` (its values narrowed to each tensor's dtype, its held
// tensors' bytes as they are) as a safetensors file with the file's names,
// shapes and dtypes, atomically.
Status SaveCustomModel(const std::filesystem::path& path, const CustomModel& model,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace estuary::models
