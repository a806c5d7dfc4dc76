// A site of your own model, written against Estuary's client API only
// (estuary/client.h): linear regression y = w·x + b, whose tensors are named
// as torch.nn.Linear(D, 1)'s state dict names them.
//
//   linreg-site --server HOST:PORT --ca ca.pem --cert site.pem --key site.key --data site.csv [--check-model]
//               [--delta] [--eval-data held-out.csv]
//
// site.csv holds one example per line: D features, then y. Each round runs
// the task's epochs of full-batch gradient descent on the mean squared error
// at the task's learning rate, from the global model. With --check-model the
// site refuses a federation of any model but its own (ModelName of its
// tensors), as a site whose model file differs from the server's should.
// With --delta it returns local minus global instead of the local weights
// (the same update: the server computes that difference itself otherwise).
// With --eval-data the site scores the global model on those held-out
// examples when the server asks (federated evaluation): their mean squared
// error; without it, it answers that it does not evaluate.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "estuary/client.h"

namespace {

struct Example {
  std::vector<double> x;
  double y = 0;
};

std::vector<Example> ReadCsv(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot read it");
  std::vector<Example> examples;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (line.empty()) continue;
    std::vector<double> values;
    std::stringstream fields(line);
    for (std::string field; std::getline(fields, field, ',');) {
      char* end = nullptr;
      values.push_back(std::strtod(field.c_str(), &end));
      if (end == field.c_str()) throw std::runtime_error(path + ":" + std::to_string(number) + ": not a number");
    }
    if (values.size() < 2 || (!examples.empty() && values.size() != examples[0].x.size() + 1)) {
      throw std::runtime_error(path + ":" + std::to_string(number) + ": expected the same D features and y per line");
    }
    examples.push_back({{values.begin(), values.end() - 1}, values.back()});
  }
  if (examples.empty()) throw std::runtime_error(path + ": no examples");
  return examples;
}

class LinearRegression : public estuary::Trainer {
 public:
  LinearRegression(std::vector<Example> examples, bool delta, std::vector<Example> held_out = {})
      : examples_(std::move(examples)), delta_(delta), held_out_(std::move(held_out)) {}

  size_t features() const { return examples_[0].x.size(); }

  std::vector<estuary::TensorLayout> Layout() const {
    return {{"linear.weight", {1, int64_t(features())}, "F32"}, {"linear.bias", {1}, "F32"}};
  }

  uint64_t num_examples() const override { return examples_.size(); }

  estuary::TrainResult Train(const std::vector<estuary::Tensor>& global, const estuary::TaskInfo& task) override {
    std::vector<float> w0, b0;
    for (const estuary::Tensor& t : global) {
      if (t.name == "linear.weight") w0 = t.data;
      if (t.name == "linear.bias") b0 = t.data;
    }
    std::vector<double> w(w0.begin(), w0.end()), b(b0.begin(), b0.end());
    if (w.size() != features() || b.size() != 1) throw std::runtime_error("the global model is not this Linear");
    const double n = double(examples_.size());
    double loss = 0;
    for (uint32_t epoch = 0; epoch < task.epochs; ++epoch) {
      std::vector<double> grad_w(w.size(), 0.0);
      double grad_b = 0;
      loss = 0;
      for (const Example& e : examples_) {
        double prediction = b[0];
        for (size_t j = 0; j < w.size(); ++j) prediction += w[j] * e.x[j];
        const double error = prediction - e.y;
        loss += error * error / n;
        for (size_t j = 0; j < w.size(); ++j) grad_w[j] += 2 * error * e.x[j] / n;
        grad_b += 2 * error / n;
      }
      for (size_t j = 0; j < w.size(); ++j) w[j] -= task.learning_rate * grad_w[j];
      b[0] -= task.learning_rate * grad_b;
    }
    estuary::TrainResult result;
    result.tensors = {{"linear.weight", {1, int64_t(w.size())}, {w.begin(), w.end()}},
                      {"linear.bias", {1}, {b.begin(), b.end()}}};
    if (delta_) {
      // In fp32, as the server would subtract: the same update either way.
      for (size_t j = 0; j < w.size(); ++j) result.tensors[0].data[j] -= w0[j];
      result.tensors[1].data[0] -= b0[0];
      result.is_delta = true;
    }
    result.num_examples = examples_.size();
    result.metrics = {{"loss", loss}};
    return result;
  }

  estuary::EvalResult Evaluate(const std::vector<estuary::Tensor>& global, const estuary::TaskInfo&) override {
    estuary::EvalResult result;
    if (held_out_.empty()) return result;  // not supported: no held-out examples
    const std::vector<float>* w = nullptr;
    const std::vector<float>* b = nullptr;
    for (const estuary::Tensor& t : global) {
      if (t.name == "linear.weight") w = &t.data;
      if (t.name == "linear.bias") b = &t.data;
    }
    if (!w || !b || b->size() != 1 || w->size() != held_out_[0].x.size()) {
      throw std::runtime_error("the global model is not a Linear of the held-out examples' width");
    }
    double loss = 0;
    for (const Example& e : held_out_) {
      double error = (*b)[0] - e.y;
      for (size_t j = 0; j < w->size(); ++j) error += (*w)[j] * e.x[j];
      loss += error * error;
    }
    result.supported = true;
    result.num_examples = held_out_.size();
    result.loss = loss / double(held_out_.size());
    return result;
  }

 private:
  std::vector<Example> examples_;
  bool delta_;
  std::vector<Example> held_out_;
};

}  // namespace

int main(int argc, char** argv) {
  estuary::SiteOptions options;
  std::string data, eval_data;
  bool check_model = false, delta = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--check-model" || flag == "--delta") {
      (flag == "--delta" ? delta : check_model) = true;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s: needs a value\n", flag.c_str());
      return 2;
    }
    const std::string value = argv[++i];
    if (flag == "--server") {
      options.server = value;
    } else if (flag == "--ca") {
      options.ca = value;
    } else if (flag == "--cert") {
      options.cert = value;
    } else if (flag == "--key") {
      options.key = value;
    } else if (flag == "--data") {
      data = value;
    } else if (flag == "--eval-data") {
      eval_data = value;
    } else if (flag == "--max-backoff") {
      options.max_backoff_s = std::atof(value.c_str());
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  try {
    LinearRegression trainer(ReadCsv(data), delta, eval_data.empty() ? std::vector<Example>() : ReadCsv(eval_data));
    if (check_model) options.expected_model = estuary::ModelName(trainer.Layout());
    const estuary::SiteResult result = estuary::RunSite(options, trainer);
    if (!result.ok) {
      std::fprintf(stderr, "site: %s\n", result.error.c_str());
      return 1;
    }
    std::printf("federation complete: trained %llu rounds\n", (unsigned long long)result.rounds_trained);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "site: %s\n", e.what());
    return 1;
  }
}
