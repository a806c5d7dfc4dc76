// The LLaMA decoder's ops against PyTorch, forward and backward. The
// references are written by torch_llama.py, which ctest runs as a fixture; the
// error metric everywhere is max|a - b| / max|b| over a tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/transformer_ops.h"

namespace estuary::models {
namespace {

using Values = std::vector<float>;
using Ids = std::vector<int32_t>;
namespace fs = std::filesystem;

const fs::path kReference = fs::path(ESTUARY_BINARY_DIR) / "tests/models/llama_reference";

nlohmann::json Fixture(const std::string& name) {
  std::ifstream in(kReference / (name + ".json"));
  EXPECT_TRUE(in.good()) << "missing fixture " << name << " (the models_torch_llama step writes it)";
  return nlohmann::json::parse(in, nullptr, false);
}

Values Get(const nlohmann::json& f, const std::string& key) { return f.at(key).get<Values>(); }
Ids GetIds(const nlohmann::json& f, const std::string& key) {
  Ids ids;
  for (double v : f.at(key)) ids.push_back(int32_t(v));
  return ids;
}

double RelativeError(const float* a, const Values& b) {
  double diff = 0, scale = 1e-30;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, double(std::abs(a[i] - b[i])));
    scale = std::max(scale, double(std::abs(b[i])));
  }
  return diff / scale;
}

constexpr double kOpTolerance = 1e-5;

// ------------------------------------------------------------------- ops

TEST(LlamaOps, EmbeddingGathersAndScatterAdds) {
  auto f = Fixture("op_embedding");
  Values table = Get(f, "table"), dout = Get(f, "dout");
  Ids tokens = GetIds(f, "tokens");
  const int n = int(tokens.size()), dim = 6;
  Values out(n * dim, 99.0f);
  EmbeddingForward(tokens.data(), n, table.data(), dim, out.data());
  EXPECT_LE(RelativeError(out.data(), Get(f, "out")), kOpTolerance);
  // Backward adds: start from 0.5 everywhere and take it off again.
  Values dtable(table.size(), 0.5f);
  EmbeddingBackward(tokens.data(), n, dout.data(), dim, dtable.data());
  for (float& v : dtable) v -= 0.5f;
  EXPECT_LE(RelativeError(dtable.data(), Get(f, "dtable")), kOpTolerance);
}

TEST(LlamaOps, RmsNorm) {
  auto f = Fixture("op_rmsnorm");
  Values x = Get(f, "x"), w = Get(f, "weight"), dy = Get(f, "dy");
  const int dim = 16, n = int(x.size()) / dim;
  Values y(x.size()), rstd(n), dx(x.size(), 0.25f), dw(dim, 99.0f);
  RmsNormForward(x.data(), w.data(), n, dim, f.at("eps").get<float>(), y.data(), rstd.data());
  EXPECT_LE(RelativeError(y.data(), Get(f, "y")), kOpTolerance);
  RmsNormBackward(x.data(), w.data(), rstd.data(), dy.data(), n, dim, dx.data(), dw.data());
  for (float& v : dx) v -= 0.25f;  // dx is added to what was there
  EXPECT_LE(RelativeError(dx.data(), Get(f, "dx")), kOpTolerance);
  EXPECT_LE(RelativeError(dw.data(), Get(f, "dweight")), kOpTolerance);
}

TEST(LlamaOps, RopeInsideWiderRows) {
  auto f = Fixture("op_rope");
  const int batch = f["batch"], seq = f["seq"], heads = f["heads"], head_dim = f["head_dim"];
  const int width = heads * head_dim, stride = width + 5;  // as q inside a fused qkv row
  Values cos(seq * head_dim / 2), sin(cos.size());
  RopeTables(seq, head_dim, f["theta"].get<double>(), cos.data(), sin.data());
  auto run = [&](const Values& in, bool forward) {
    Values rows(size_t(batch) * seq * stride, -7.0f), out;
    for (int r = 0; r < batch * seq; ++r) std::copy_n(in.begin() + r * width, width, rows.begin() + r * stride);
    if (forward) {
      RopeForward(rows.data(), batch, seq, heads, head_dim, stride, cos.data(), sin.data());
    } else {
      RopeBackward(rows.data(), batch, seq, heads, head_dim, stride, cos.data(), sin.data());
    }
    for (int r = 0; r < batch * seq; ++r) {
      out.insert(out.end(), rows.begin() + r * stride, rows.begin() + r * stride + width);
      for (int c = width; c < stride; ++c) EXPECT_EQ(rows[r * stride + c], -7.0f) << "wrote outside the heads";
    }
    return out;
  };
  EXPECT_LE(RelativeError(run(Get(f, "x"), true).data(), Get(f, "y")), kOpTolerance);
  EXPECT_LE(RelativeError(run(Get(f, "dy"), false).data(), Get(f, "dx")), kOpTolerance);
}

TEST(LlamaOps, SwiGlu) {
  auto f = Fixture("op_swiglu");
  Values gate_up = Get(f, "gate_up"), dout = Get(f, "dout");
  const int hidden = f["hidden"], n = int(gate_up.size()) / (2 * hidden);
  Values out(n * hidden), dgate_up(gate_up.size(), 99.0f);
  SwiGluForward(gate_up.data(), n, hidden, out.data());
  SwiGluBackward(gate_up.data(), dout.data(), n, hidden, dgate_up.data());
  EXPECT_LE(RelativeError(out.data(), Get(f, "out")), kOpTolerance);
  EXPECT_LE(RelativeError(dgate_up.data(), Get(f, "dgate_up")), kOpTolerance);
}

class LlamaAttentionOp : public ::testing::TestWithParam<const char*> {};

TEST_P(LlamaAttentionOp, MatchesTorch) {
  auto f = Fixture(std::string("op_attention_") + GetParam());
  const int batch = f["batch"], seq = f["seq"], heads = f["heads"], kv_heads = f["kv_heads"],
            head_dim = f["head_dim"];
  Values qkv = Get(f, "qkv"), dout = Get(f, "dout");
  Values probs(size_t(batch) * heads * seq * seq, 99.0f), out(size_t(batch) * seq * heads * head_dim, 99.0f);
  Values dscores(seq * seq), dqkv(qkv.size(), 99.0f);  // poisoned: every element must be written
  AttentionForward(qkv.data(), batch, seq, heads, kv_heads, head_dim, probs.data(), out.data());
  AttentionBackward(qkv.data(), probs.data(), dout.data(), batch, seq, heads, kv_heads, head_dim, dscores.data(),
                    dqkv.data());
  EXPECT_LE(RelativeError(probs.data(), Get(f, "probs")), kOpTolerance);
  EXPECT_LE(RelativeError(out.data(), Get(f, "out")), kOpTolerance);
  EXPECT_LE(RelativeError(dqkv.data(), Get(f, "dqkv")), kOpTolerance);
}

INSTANTIATE_TEST_SUITE_P(Heads, LlamaAttentionOp, ::testing::Values("gqa", "mqa", "mha"));

}  // namespace
}  // namespace estuary::models
