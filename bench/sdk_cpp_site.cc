// The C++ baseline of bench/python_sdk.py: a site written against the client
// API (estuary/client.h) whose Trainer does what the Python site's fit does,
// w * 0.999 on every tensor, and prints the seconds between the starts of its
// consecutive rounds (download, the work, upload, the server's fold: a round
// as the site lives it) and those of each Train call.
//
//   sdk_cpp_site --server HOST:PORT --ca ca.pem --cert site.pem --key site.key
#include <algorithm>
#include <chrono>
#include <iterator>
#include <cstdio>
#include <string>
#include <vector>

#include "estuary/client.h"

namespace {

class Decay : public estuary::Trainer {
 public:
  uint64_t num_examples() const override { return 100; }

  estuary::TrainResult Train(const std::vector<estuary::Tensor>& global, const estuary::TaskInfo& task) override {
    starts_.push_back(std::chrono::steady_clock::now());
    estuary::TrainResult result;
    result.tensors.reserve(global.size());
    for (const estuary::Tensor& t : global) {
      estuary::Tensor& out = result.tensors.emplace_back(estuary::Tensor{t.name, t.shape, {}});
      out.data.reserve(t.data.size());
      std::transform(t.data.begin(), t.data.end(), std::back_inserter(out.data), [](float v) { return v * 0.999f; });
    }
    result.num_examples = 100;
    result.metrics = {{"loss", 1.0}};
    train_s_.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - starts_.back()).count());
    return result;
  }

  const std::vector<std::chrono::steady_clock::time_point>& starts() const { return starts_; }
  const std::vector<double>& train_s() const { return train_s_; }

 private:
  std::vector<std::chrono::steady_clock::time_point> starts_;
  std::vector<double> train_s_;
};

}  // namespace

int main(int argc, char** argv) {
  estuary::SiteOptions options;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--server") options.server = value;
    if (flag == "--ca") options.ca = value;
    if (flag == "--cert") options.cert = value;
    if (flag == "--key") options.key = value;
  }
  options.max_backoff_s = 1;
  Decay trainer;
  const estuary::SiteResult result = estuary::RunSite(options, trainer);
  if (!result.ok) {
    std::fprintf(stderr, "sdk_cpp_site: %s\n", result.error.c_str());
    return 1;
  }
  std::printf("round_seconds");
  for (size_t i = 1; i < trainer.starts().size(); ++i) {
    std::printf(" %.6f", std::chrono::duration<double>(trainer.starts()[i] - trainer.starts()[i - 1]).count());
  }
  std::printf("\ntrain_seconds");
  for (double t : trainer.train_s()) std::printf(" %.9f", t);
  std::printf("\n");
  return 0;
}
