// FedProx's proximal term in DataParallel, against PyTorch: three local SGD
// steps of the MLP on cross-entropy + μ/2 ‖w − w₀‖² with the gradient clipped
// after the term (torch_reference.py's fedprox_mlp, the models_torch fixture).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>

#include "comm/communicator.h"
#include "models/model.h"
#include "models/optimizer.h"
#include "parallel/data_parallel.h"

namespace estuary::parallel {
namespace {

nlohmann::json Fixture(const std::string& name) {
  std::ifstream in(std::string(ESTUARY_BINARY_DIR) + "/tests/models/reference/" + name + ".json");
  EXPECT_TRUE(in.good()) << "missing fixture " << name << " (the models_torch_reference step writes it)";
  return nlohmann::json::parse(in, nullptr, false);
}

std::vector<float> Get(const nlohmann::json& f, const std::string& key) { return f.at(key).get<std::vector<float>>(); }

// The largest |a - b| / max|b| over one tensor.
double Error(const float* a, const std::vector<float>& b) {
  double worst = 0, largest = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    worst = std::max(worst, std::abs(double(a[i]) - b[i]));
    largest = std::max(largest, std::abs(double(b[i])));
  }
  return worst / largest;
}

// The MLP after the fixture's three steps, with the proximal term's μ given.
std::unique_ptr<models::Model> Train(const nlohmann::json& f, float mu) {
  auto made = models::MakeModel("mlp");
  EXPECT_TRUE(made.ok());
  std::unique_ptr<models::Model> model = std::move(*made);
  for (const TensorSpec& t : model->manifest().tensors) {
    const std::vector<float> v = Get(f, t.name);
    std::copy(v.begin(), v.end(), model->parameters().begin() + t.offset);
  }
  auto comm = comm::MakeSoloCommunicator(Device::kCpu);
  DataParallelOptions options;
  options.broadcast_parameters = false;
  options.max_grad_norm = Get(f, "max_norm")[0];
  options.proximal_mu = mu;
  auto dp = DataParallel::Create(*comm, *model, options);
  EXPECT_TRUE(dp.ok()) << dp.status().ToString();
  models::Sgd sgd(Get(f, "lr")[0], 0.9f, 1e-4f);
  for (int step = 0; step < 3; ++step) {
    const std::vector<float> x = Get(f, "x" + std::to_string(step));
    const auto labels = f.at("labels" + std::to_string(step)).get<std::vector<int32_t>>();
    model->ForwardBackward(x.data(), labels.data(), 10, (*dp)->MicroBatch(1.0, true));
    auto stepped = (*dp)->Step([&](std::span<const models::ParameterSlice> s) { sgd.Step(s); });
    EXPECT_TRUE(stepped.ok()) << stepped.status().ToString();
    if (mu > 0) {
      // The norm clipped is the gradient's with the proximal term in it, as torch's.
      EXPECT_NEAR(stepped->grad_norm, Get(f, "norms")[step], 1e-4 * Get(f, "norms")[step]) << step;
    }
  }
  return model;
}

TEST(Proximal, ThreeClippedSgdStepsFollowTorchsFedProxLoss) {
  const nlohmann::json f = Fixture("fedprox_mlp");
  const float mu = Get(f, "mu")[0];
  auto fedprox = Train(f, mu);
  auto plain = Train(f, 0);
  double without = 0;
  for (const TensorSpec& t : fedprox->manifest().tensors) {
    const std::vector<float> expected = Get(f, t.name + ".after");
    EXPECT_LE(Error(fedprox->parameters().data() + t.offset, expected), 1e-5) << t.name;
    without = std::max(without, Error(plain->parameters().data() + t.offset, expected));
  }
  EXPECT_GT(without, 1e-3) << "without the term the steps must land elsewhere, or this test proves nothing";
}

TEST(Proximal, ANegativeOrNonFiniteMuIsRefused) {
  auto made = models::MakeModel("mlp");
  ASSERT_TRUE(made.ok());
  auto comm = comm::MakeSoloCommunicator(Device::kCpu);
  for (float mu : {-0.1f, NAN, INFINITY}) {
    DataParallelOptions options;
    options.proximal_mu = mu;
    auto dp = DataParallel::Create(*comm, **made, options);
    ASSERT_FALSE(dp.ok()) << mu;
    EXPECT_NE(dp.status().message().find("proximal_mu"), std::string::npos) << dp.status().message();
  }
}

}  // namespace
}  // namespace estuary::parallel
