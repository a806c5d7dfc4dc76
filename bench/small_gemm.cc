// bench/small_gemm: libxsmm against OpenBLAS on the matrix products of a
// client's SGD step, shape by shape, in one process (models/small_gemm.h).
//
// For each layer of the model at the given batch sizes: the forward product
// (OpenBLAS: Y = X·Wᵀ; libxsmm, which takes no transposed right operand:
// Yᵀ = W·Xᵀ, with the transpose of X inside its time), the weight update
// W += dYᵀ·X (beta 1, as the fused SGD step does it) and dX = dY·W. The two
// engines run in alternating blocks, so load from other processes falls on
// both alike; each line prints both medians, GFLOP/s, the ratio, and the
// engine models::Sgemm picks for the shape.
// With --model cnn, its fully connected layers and the per-image products of its convolutions.
// Where the CPU has AVX2 and FMA, each forward also runs on models/dot_forward.h's
// kernel against OpenBLAS ("forward, dot").
//   build/bench/small_gemm [--model mlp|cnn] [--batch 10,500] [--steps 15]
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "bench/harness.h"
#include "models/dot_forward.h"
#include "models/small_gemm.h"

using namespace estuary;
using models::GemmEngine;

namespace {

struct Layer {
  const char* name;
  int in, out;
};

// Median seconds per call of `run` on each engine, alternating blocks of calls.
std::pair<double, double> Time(const bench::Repetitions& reps, const std::function<void(GemmEngine)>& run) {
  bench::Samples xsmm, blas;
  for (GemmEngine e : {GemmEngine::kXsmm, GemmEngine::kOpenBlas}) run(e);  // kernels generated, caches warm
  bench::Stopwatch probe;
  run(GemmEngine::kOpenBlas);
  const int calls = std::clamp(int(2e-3 / std::max(probe.Seconds(), 1e-9)), 1, 2000);  // ~2 ms blocks
  for (int r = 0; r < reps.timed; ++r) {
    for (GemmEngine e : {GemmEngine::kXsmm, GemmEngine::kOpenBlas}) {
      bench::Stopwatch watch;
      for (int c = 0; c < calls; ++c) run(e);
      (e == GemmEngine::kXsmm ? xsmm : blas).Add(watch.Seconds() / calls);
    }
  }
  return {xsmm.median(), blas.median()};
}

}  // namespace

int main(int argc, char** argv) {
  openblas_set_num_threads(1);
  bench::Bench bench("small_gemm", "libxsmm against OpenBLAS on the products of a client's SGD step");
  std::string model = "mlp";
  std::vector<int> batches = {10, 500};
  bench::Repetitions reps{1, 15};
  bench.app().add_option("--model", model, "mlp (784-200-200-10) | cnn (its two fully connected layers)");
  bench.app().add_option("--batch", batches, "batch sizes")->delimiter(',');
  bench.AddRepetitions(reps);
  if (auto code = bench.Parse(argc, argv)) return *code;
  if (!models::HaveXsmm()) return bench.NothingMeasured("built without libxsmm (libxsmm-dev)");
  std::vector<Layer> layers;
  if (model == "mlp") {
    layers = {{"fc1", 784, 200}, {"fc2", 200, 200}, {"fc3", 200, 10}};
  } else if (model == "cnn") {
    layers = {{"fc1", 3136, 512}, {"fc2", 512, 10}};
  } else {
    return bench.Fail(InvalidArgument("--model {}: expected mlp or cnn", model));
  }

  fmt::print("libxsmm {} kernels; OpenBLAS single-threaded\n", models::XsmmTarget());
  fmt::print("{:<28} {:>11} {:>11} {:>9} {:>9} {:>8}  {}\n", "product", "libxsmm us", "OpenBLAS us", "xsmm GF/s",
             "blas GF/s", "ratio", "picked");
  for (int n : batches) {
    for (const Layer& l : layers) {
      std::vector<float> x(size_t(n) * l.in), xt(x.size()), w(size_t(l.out) * l.in), y(size_t(n) * l.out),
          dy(y.size()), dx(x.size());
      for (size_t i = 0; i < x.size(); ++i) x[i] = float(i % 7) * 0.1f;
      for (size_t i = 0; i < w.size(); ++i) w[i] = float(int(i % 13) - 6) * 1e-3f;
      for (size_t i = 0; i < dy.size(); ++i) dy[i] = float(int(i % 5) - 2) * 1e-4f;
      const double flop = 2.0 * n * l.in * l.out;
      auto line = [&](const std::string& what, std::pair<double, double> t, GemmEngine picked) {
        fmt::print("{:<28} {:>11.2f} {:>11.2f} {:>9.1f} {:>9.1f} {:>8.2f}  {}\n", what, t.first * 1e6, t.second * 1e6,
                   flop / t.first / 1e9, flop / t.second / 1e9, t.second / t.first,
                   picked == GemmEngine::kXsmm ? "libxsmm" : "OpenBLAS");
      };
      const std::string shape = fmt::format("{} n={}", l.name, n);
      line(shape + " forward", Time(reps, [&](GemmEngine e) {
             if (e == GemmEngine::kXsmm) {
               for (int i = 0; i < n; ++i) {
                 for (int j = 0; j < l.in; ++j) xt[size_t(j) * n + i] = x[size_t(i) * l.in + j];
               }
               models::SgemmOn(e, false, false, l.out, n, l.in, 1.0f, w.data(), l.in, xt.data(), n, 0.0f, y.data(), n);
             } else {
               models::SgemmOn(e, false, true, n, l.out, l.in, 1.0f, x.data(), l.in, w.data(), l.in, 0.0f, y.data(),
                               l.out);
             }
           }),
           models::XsmmForwardPays(n, l.in, l.out) ? GemmEngine::kXsmm : GemmEngine::kOpenBlas);
      if (models::HaveDotForward()) {  // the AVX2 dot-product forward, same product, against OpenBLAS
        const auto [dot, blas] = Time(reps, [&](GemmEngine e) {
          if (e == GemmEngine::kXsmm) {
            models::DotForward(x.data(), n, l.in, w.data(), l.out, nullptr, false, y.data());
          } else {
            models::SgemmOn(e, false, true, n, l.out, l.in, 1.0f, x.data(), l.in, w.data(), l.in, 0.0f, y.data(),
                            l.out);
          }
        });
        fmt::print("{:<28} {:>11.2f} {:>11.2f} {:>9.1f} {:>9.1f} {:>8.2f}  (dot kernel in the first column)\n",
                   shape + " forward, dot", dot * 1e6, blas * 1e6, flop / dot / 1e9, flop / blas / 1e9, blas / dot);
      }
      line(shape + " W += dYt.X", Time(reps, [&](GemmEngine e) {
             models::SgemmOn(e, true, false, l.out, l.in, n, 1.0f, dy.data(), l.out, x.data(), l.in, 1.0f, w.data(),
                             l.in);
           }),
           models::ChooseGemmEngine(true, false, l.out, l.in, n, 1.0f, 1.0f));
      line(shape + " dX = dY.W", Time(reps, [&](GemmEngine e) {
             models::SgemmOn(e, false, false, n, l.in, l.out, 1.0f, dy.data(), l.out, w.data(), l.in, 0.0f,
                             dx.data(), l.in);
           }),
           models::ChooseGemmEngine(false, false, n, l.in, l.out, 1.0f, 0.0f));
    }
  }
  if (model == "cnn") {
    // The convolutions' products, per image (im2col), as Conv2d forms them: W [c_out, c_in·25] · cols
    // [c_in·25, h·w] forward, Wᵀ · dY for the columns' gradient, and the weight gradient transposed,
    // dWᵀ += cols · dYᵀ (dY · colsᵀ would transpose B, which libxsmm cannot; beta 1, as from the second
    // image on). The batch does not enter these shapes.
    struct Product {
      const char* name;
      bool trans_a;
      int m, n, k;
    };
    for (const Product& p : {Product{"conv1 forward", false, 32, 784, 25},
                             Product{"conv1 dWt += cols.dYt", false, 25, 32, 784},
                             Product{"conv2 forward", false, 64, 196, 800},
                             Product{"conv2 dWt += cols.dYt", false, 800, 64, 196},
                             Product{"conv2 dcols = Wt.dY", true, 800, 196, 64}}) {
      std::vector<float> a(size_t(p.m) * p.k, 0.01f), b(size_t(p.k) * p.n, 0.5f), c(size_t(p.m) * p.n);
      const int lda = p.trans_a ? p.m : p.k;
      const auto t = Time(reps, [&](GemmEngine e) {
        models::SgemmOn(e, p.trans_a, false, p.m, p.n, p.k, 1.0f, a.data(), lda, b.data(), p.n, 1.0f, c.data(), p.n);
      });
      const double flop = 2.0 * p.m * p.n * p.k;
      fmt::print("{:<28} {:>11.2f} {:>11.2f} {:>9.1f} {:>9.1f} {:>8.2f}  {}\n", p.name, t.first * 1e6, t.second * 1e6,
                 flop / t.first / 1e9, flop / t.second / 1e9, t.second / t.first,
                 models::ChooseGemmEngine(p.trans_a, false, p.m, p.n, p.k, 1.0f, 1.0f) == GemmEngine::kXsmm
                     ? "libxsmm"
                     : "OpenBLAS");
    }
  }
  return 0;
}
