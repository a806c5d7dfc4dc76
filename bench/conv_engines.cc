// bench/conv_engines: oneDNN against the CNN's own convolutions and max-pooling
// (models/layers.h: im2col + libxsmm per image), on the MNIST CNN's two layers,
// in one process.
//
// For each batch and layer: forward (with the ReLU fused, as the model runs
// it), backward-data (dX) and backward-weights (dW and db), and the 2x2
// max-pool's forward and backward. oneDNN runs in three ways where the CPU
// offers them: "plain" (NCHW/OIHW tensors, the model's own layouts, so a
// drop-in), "blocked" (the layouts oneDNN prefers, format any), timed with
// the reorders from and to the model's layouts and without them (what a
// network kept blocked end to end would pay), and Winograd. Every variant
// alternates with the current path in blocks of ~2 ms, so load from other
// processes falls on all alike; each line prints the medians, the ratio
// (current / variant: above 1, oneDNN is faster), oneDNN's implementation and
// the largest |difference| from the current path's result on the same inputs.
// oneDNN runs single-threaded, as a site's trainer does.
//   build/bench/conv_engines [--batch 10,32] [--steps 15]
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "bench/harness.h"
#include "models/conv_dnnl.h"
#include "models/layers.h"

#ifdef ESTUARY_HAVE_DNNL
#include <oneapi/dnnl/dnnl.hpp>

extern "C" void omp_set_num_threads(int);  // libgomp's: Debian's oneDNN threads with OpenMP
#endif

using namespace estuary;

namespace {

std::string CpuName() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown CPU";
}

// Median seconds per call of each of `runs`, in alternating blocks of calls.
std::vector<double> Time(const bench::Repetitions& reps, const std::vector<std::function<void()>>& runs) {
  for (const auto& run : runs) run();  // primitives' first use, caches warm
  bench::Stopwatch probe;
  runs[0]();
  const int calls = std::clamp(int(2e-3 / std::max(probe.Seconds(), 1e-9)), 1, 2000);
  std::vector<bench::Samples> samples(runs.size());
  for (int r = 0; r < reps.timed; ++r) {
    for (size_t v = 0; v < runs.size(); ++v) {
      bench::Stopwatch watch;
      for (int c = 0; c < calls; ++c) runs[v]();
      samples[v].Add(watch.Seconds() / calls);
    }
  }
  std::vector<double> medians;
  for (const auto& s : samples) medians.push_back(s.median());
  return medians;
}

float MaxDiff(const std::vector<float>& a, const std::vector<float>& b) {
  float d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::fabs(a[i] - b[i]));
  return d;
}

void Fill(std::vector<float>& v, uint32_t seed, float scale) {
  uint32_t s = seed;
  for (float& x : v) {
    s = s * 1664525u + 1013904223u;
    x = (float(s >> 8) / float(1 << 24) - 0.5f) * scale;
  }
}

void Line(const std::string& what, double current, double other, const std::string& impl, float diff) {
  fmt::print("{:<44} {:>10.1f} {:>10.1f} {:>7.2f}  {:<16} {:.1e}\n", what, current * 1e6, other * 1e6,
             current / other, impl, diff);
}

#ifdef ESTUARY_HAVE_DNNL
using dnnl::memory;
using Tag = memory::format_tag;

// One tensor a primitive reads or writes: the model's plain buffer, and where
// the primitive wants another layout, its own copy with the reorders both ways.
struct Arg {
  memory user, inner;
  dnnl::reorder in, out;  // user -> inner, inner -> user
  bool reordered = false;
};

Arg Bind(const dnnl::engine& eng, const memory::desc& want, const memory& user) {
  Arg a;
  a.user = user;
  if (want == user.get_desc()) {
    a.inner = user;
    return a;
  }
  a.inner = memory(want, eng);
  a.in = dnnl::reorder(a.user, a.inner);
  a.out = dnnl::reorder(a.inner, a.user);
  a.reordered = true;
  return a;
}

struct Tensors {
  std::vector<float> x, w, b, y, dy, dx, dw, db;
};

// One oneDNN convolution (5x5, pad 2, stride 1) with its three passes.
class DnnlConv {
 public:
  DnnlConv(const dnnl::engine& eng, int n, int ic, int oc, int h, int w, dnnl::algorithm alg, bool blocked,
           Tensors& t)
      : eng_(eng), strm_(eng) {
    const memory::dims src{n, ic, h, w}, wei{oc, ic, 5, 5}, bia{oc}, dst{n, oc, h, w}, st{1, 1}, pad{2, 2};
    auto md = [&](const memory::dims& d, Tag tag) {
      return memory::desc(d, memory::data_type::f32, blocked && tag != Tag::x ? Tag::any : tag);
    };
    auto user = [&](const memory::dims& d, Tag tag, std::vector<float>& v) {
      return memory(memory::desc(d, memory::data_type::f32, tag), eng, v.data());
    };
    dnnl::primitive_attr attr;
    dnnl::post_ops ops;
    ops.append_eltwise(1.0f, dnnl::algorithm::eltwise_relu, 0.0f, 0.0f);
    attr.set_post_ops(ops);
    fwd_pd_ = dnnl::convolution_forward::primitive_desc(
        dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, alg, md(src, Tag::nchw),
                                        md(wei, Tag::oihw), md(bia, Tag::x), md(dst, Tag::nchw), st, pad, pad),
        attr, eng);
    bd_pd_ = dnnl::convolution_backward_data::primitive_desc(
        dnnl::convolution_backward_data::desc(alg, md(src, Tag::nchw), md(wei, Tag::oihw), md(dst, Tag::nchw), st,
                                              pad, pad),
        eng, fwd_pd_);
    bw_pd_ = dnnl::convolution_backward_weights::primitive_desc(
        dnnl::convolution_backward_weights::desc(alg, md(src, Tag::nchw), md(wei, Tag::oihw), md(bia, Tag::x),
                                                 md(dst, Tag::nchw), st, pad, pad),
        eng, fwd_pd_);
    fwd_ = dnnl::convolution_forward(fwd_pd_);
    bd_ = dnnl::convolution_backward_data(bd_pd_);
    bw_ = dnnl::convolution_backward_weights(bw_pd_);
    f_src_ = Bind(eng, fwd_pd_.src_desc(), user(src, Tag::nchw, t.x));
    f_wei_ = Bind(eng, fwd_pd_.weights_desc(), user(wei, Tag::oihw, t.w));
    f_bia_ = Bind(eng, fwd_pd_.bias_desc(), user(bia, Tag::x, t.b));
    f_dst_ = Bind(eng, fwd_pd_.dst_desc(), user(dst, Tag::nchw, t.y));
    d_ddst_ = Bind(eng, bd_pd_.diff_dst_desc(), user(dst, Tag::nchw, t.dy));
    d_wei_ = Bind(eng, bd_pd_.weights_desc(), user(wei, Tag::oihw, t.w));
    d_dsrc_ = Bind(eng, bd_pd_.diff_src_desc(), user(src, Tag::nchw, t.dx));
    w_src_ = Bind(eng, bw_pd_.src_desc(), user(src, Tag::nchw, t.x));
    w_ddst_ = Bind(eng, bw_pd_.diff_dst_desc(), user(dst, Tag::nchw, t.dy));
    w_dwei_ = Bind(eng, bw_pd_.diff_weights_desc(), user(wei, Tag::oihw, t.dw));
    w_dbia_ = Bind(eng, bw_pd_.diff_bias_desc(), user(bia, Tag::x, t.db));
  }

  std::string impl() const { return fwd_pd_.impl_info_str(); }
  std::string impl_bd() const { return bd_pd_.impl_info_str(); }
  std::string impl_bw() const { return bw_pd_.impl_info_str(); }
  bool reorders() const { return f_src_.reordered || f_dst_.reordered || f_wei_.reordered; }

  // with_reorders: the model's tensors in, the model's tensors out.
  void Forward(bool with_reorders) {
    In({&f_src_, &f_wei_, &f_bia_}, with_reorders);
    fwd_.execute(strm_, {{DNNL_ARG_SRC, f_src_.inner},
                         {DNNL_ARG_WEIGHTS, f_wei_.inner},
                         {DNNL_ARG_BIAS, f_bia_.inner},
                         {DNNL_ARG_DST, f_dst_.inner}});
    Out({&f_dst_}, with_reorders);
  }
  void BackwardData(bool with_reorders) {
    In({&d_ddst_, &d_wei_}, with_reorders);
    bd_.execute(strm_, {{DNNL_ARG_DIFF_DST, d_ddst_.inner},
                        {DNNL_ARG_WEIGHTS, d_wei_.inner},
                        {DNNL_ARG_DIFF_SRC, d_dsrc_.inner}});
    Out({&d_dsrc_}, with_reorders);
  }
  void BackwardWeights(bool with_reorders) {
    In({&w_src_, &w_ddst_}, with_reorders);
    bw_.execute(strm_, {{DNNL_ARG_SRC, w_src_.inner},
                        {DNNL_ARG_DIFF_DST, w_ddst_.inner},
                        {DNNL_ARG_DIFF_WEIGHTS, w_dwei_.inner},
                        {DNNL_ARG_DIFF_BIAS, w_dbia_.inner}});
    Out({&w_dwei_, &w_dbia_}, with_reorders);
  }

 private:
  void In(std::initializer_list<Arg*> args, bool with_reorders) {
    for (Arg* a : args) {
      if (a->reordered && with_reorders) a->in.execute(strm_, a->user, a->inner);
    }
  }
  void Out(std::initializer_list<Arg*> args, bool with_reorders) {
    for (Arg* a : args) {
      if (a->reordered && with_reorders) a->out.execute(strm_, a->inner, a->user);
    }
  }

  dnnl::engine eng_;
  dnnl::stream strm_;
  dnnl::convolution_forward::primitive_desc fwd_pd_;
  dnnl::convolution_backward_data::primitive_desc bd_pd_;
  dnnl::convolution_backward_weights::primitive_desc bw_pd_;
  dnnl::convolution_forward fwd_;
  dnnl::convolution_backward_data bd_;
  dnnl::convolution_backward_weights bw_;
  Arg f_src_, f_wei_, f_bia_, f_dst_, d_ddst_, d_wei_, d_dsrc_, w_src_, w_ddst_, w_dwei_, w_dbia_;
};

// oneDNN's 2x2 max-pool, stride 2, forward (training: it keeps a workspace) and backward.
class DnnlPool {
 public:
  DnnlPool(const dnnl::engine& eng, int n, int c, int h, int w, Tag tag, std::vector<float>& x, std::vector<float>& y,
           std::vector<float>& dy, std::vector<float>& dx)
      : strm_(eng) {
    const memory::dims src{n, c, h, w}, dst{n, c, h / 2, w / 2}, k{2, 2}, zero{0, 0};
    const memory::desc src_md(src, memory::data_type::f32, tag), dst_md(dst, memory::data_type::f32, tag);
    fwd_pd_ = dnnl::pooling_forward::primitive_desc(
        dnnl::pooling_forward::desc(dnnl::prop_kind::forward_training, dnnl::algorithm::pooling_max, src_md, dst_md,
                                    k, k, zero, zero),
        eng);
    bwd_pd_ = dnnl::pooling_backward::primitive_desc(
        dnnl::pooling_backward::desc(dnnl::algorithm::pooling_max, src_md, dst_md, k, k, zero, zero), eng, fwd_pd_);
    fwd_ = dnnl::pooling_forward(fwd_pd_);
    bwd_ = dnnl::pooling_backward(bwd_pd_);
    // Blocked layouts are timed on the same bytes: the values are what they are, the time is the layout's.
    x_ = memory(src_md, eng, x.data());
    y_ = memory(dst_md, eng, y.data());
    dy_ = memory(dst_md, eng, dy.data());
    dx_ = memory(src_md, eng, dx.data());
    ws_ = memory(fwd_pd_.workspace_desc(), eng);
  }
  std::string impl() const { return fwd_pd_.impl_info_str(); }
  void Forward() { fwd_.execute(strm_, {{DNNL_ARG_SRC, x_}, {DNNL_ARG_DST, y_}, {DNNL_ARG_WORKSPACE, ws_}}); }
  void Backward() {
    bwd_.execute(strm_, {{DNNL_ARG_DIFF_DST, dy_}, {DNNL_ARG_DIFF_SRC, dx_}, {DNNL_ARG_WORKSPACE, ws_}});
  }

 private:
  dnnl::stream strm_;
  dnnl::pooling_forward::primitive_desc fwd_pd_;
  dnnl::pooling_backward::primitive_desc bwd_pd_;
  dnnl::pooling_forward fwd_;
  dnnl::pooling_backward bwd_;
  memory x_, y_, dy_, dx_, ws_;
};

void Convolutions(const bench::Repetitions& reps, const dnnl::engine& eng, int n, const char* name, int ic, int oc,
                  int h, int w) {
  // The current path's tensors (t) and each oneDNN variant's own, from the same inputs.
  auto make = [&] {
    Tensors t;
    t.x.resize(size_t(n) * ic * h * w);
    t.w.resize(size_t(oc) * ic * 25);
    t.b.resize(oc);
    t.y.resize(size_t(n) * oc * h * w);
    t.dy.resize(t.y.size());
    t.dx.resize(t.x.size());
    t.dw.resize(t.w.size());
    t.db.resize(oc);
    Fill(t.x, 1, 2.0f);
    Fill(t.w, 2, 0.2f);
    Fill(t.b, 3, 0.2f);
    Fill(t.dy, 4, 0.01f);
    return t;
  };
  fmt::print("{} n={}: the model's Conv2d runs it on {}\n", name, n,
             models::ConvOnDnnl(models::Conv2d{ic, oc, 5, 2, h, w}) ? "oneDNN" : "im2col + libxsmm");
  Tensors cur = make();
  models::Conv2d conv{ic, oc, 5, 2, h, w, cur.w.data(), cur.b.data(), cur.dw.data(), cur.db.data(), true};
  std::vector<float> cols(size_t(n) * conv.col_size()), dcol(conv.col_size());
  auto cur_fwd = [&] { conv.Forward(cur.x.data(), n, cols.data(), cur.y.data(), models::Activation::kRelu); };
  auto cur_bd = [&] { conv.InputGradient(cur.dy.data(), n, dcol.data(), cur.dx.data()); };
  auto cur_bw = [&] { conv.Backward(cols.data(), cur.dy.data(), n, dcol.data(), nullptr); };
  cur_fwd();
  cur_bd();
  cur_bw();

  struct Variant {
    std::string label;
    dnnl::algorithm alg;
    bool blocked;
  };
  for (const Variant& v : {Variant{"plain", dnnl::algorithm::convolution_direct, false},
                           Variant{"blocked", dnnl::algorithm::convolution_direct, true},
                           Variant{"winograd", dnnl::algorithm::convolution_winograd, true},
                           Variant{"auto", dnnl::algorithm::convolution_auto, false}}) {
    Tensors t = make();
    std::unique_ptr<DnnlConv> d;
    try {
      d = std::make_unique<DnnlConv>(eng, n, ic, oc, h, w, v.alg, v.blocked, t);
    } catch (const dnnl::error& e) {
      fmt::print("{:<44} not offered on this CPU ({})\n", fmt::format("{} n={} {}", name, n, v.label), e.what());
      continue;
    }
    const std::string prefix = fmt::format("{} n={} {}", name, n, v.label);
    d->Forward(true);
    d->BackwardData(true);
    d->BackwardWeights(true);
    const float dfwd = MaxDiff(cur.y, t.y), dbd = MaxDiff(cur.dx, t.dx);
    const float dbw = std::max(MaxDiff(cur.dw, t.dw), MaxDiff(cur.db, t.db));
    const bool reorders = d->reorders();
    auto timed = [&](const char* pass, const std::function<void()>& ours, const std::function<void(bool)>& theirs,
                     const std::string& impl, float diff) {
      if (reorders) {
        const auto m = Time(reps, {ours, [&] { theirs(true); }, [&] { theirs(false); }});
        Line(prefix + " " + pass, m[0], m[1], impl, diff);
        Line(prefix + " " + pass + " (no reorders)", m[0], m[2], impl, diff);
      } else {
        const auto m = Time(reps, {ours, [&] { theirs(false); }});
        Line(prefix + " " + pass, m[0], m[1], impl, diff);
      }
    };
    timed("fwd+relu", cur_fwd, [&](bool r) { d->Forward(r); }, d->impl(), dfwd);
    if (ic > 1) timed("bwd-data", cur_bd, [&](bool r) { d->BackwardData(r); }, d->impl_bd(), dbd);
    timed("bwd-weights", cur_bw, [&](bool r) { d->BackwardWeights(r); }, d->impl_bw(), dbw);
  }
}

void Pooling(const bench::Repetitions& reps, const dnnl::engine& eng, int n, const char* name, int c, int h, int w) {
  std::vector<float> x(size_t(n) * c * h * w), y(x.size() / 4), dy(y.size()), dx(x.size());
  Fill(x, 5, 2.0f);
  Fill(dy, 6, 0.01f);
  std::vector<float> y2(y.size()), dx2(dx.size());
  std::vector<int32_t> argmax(y.size());
  models::MaxPool2 pool{c, h, w};
  auto cur_fwd = [&] { pool.Forward(x.data(), n, y.data(), argmax.data()); };
  auto cur_bwd = [&] { pool.Backward(dy.data(), argmax.data(), n, dx.data()); };
  cur_fwd();
  cur_bwd();
  for (Tag tag : {Tag::nchw, Tag::nChw8c}) {
    DnnlPool d(eng, n, c, h, w, tag, x, y2, dy, dx2);
    d.Forward();
    d.Backward();
    const bool plain = tag == Tag::nchw;
    const std::string prefix = fmt::format("{} n={} {}", name, n, plain ? "plain" : "blocked");
    auto m = Time(reps, {cur_fwd, [&] { d.Forward(); }});
    Line(prefix + " fwd", m[0], m[1], d.impl(), plain ? MaxDiff(y, y2) : NAN);
    m = Time(reps, {cur_bwd, [&] { d.Backward(); }});
    Line(prefix + " bwd", m[0], m[1], d.impl(), plain ? MaxDiff(dx, dx2) : NAN);
  }
}
#endif

}  // namespace

int main(int argc, char** argv) {
  bench::Bench bench("conv_engines", "oneDNN against the CNN's own convolutions and max-pooling");
  std::vector<int> batches = {10, 32};
  bench::Repetitions reps{1, 15};
  bench.app().add_option("--batch", batches, "batch sizes (10: training; 32: evaluation)")->delimiter(',');
  bench.AddRepetitions(reps);
  if (auto code = bench.Parse(argc, argv)) return *code;
#ifndef ESTUARY_HAVE_DNNL
  return bench.NothingMeasured("built without oneDNN (libdnnl-dev)");
#else
  openblas_set_num_threads(1);
  omp_set_num_threads(1);  // oneDNN's threads (OpenMP in Debian's build): one, as a site's trainer has
  const dnnl::version_t* v = dnnl_version();
  const char* isa = "other";
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::avx2: isa = "avx2"; break;
    case dnnl::cpu_isa::avx2_vnni: isa = "avx2_vnni"; break;
    case dnnl::cpu_isa::avx512_core: isa = "avx512_core"; break;
    case dnnl::cpu_isa::avx512_core_vnni: isa = "avx512_core_vnni"; break;
    case dnnl::cpu_isa::avx512_core_bf16: isa = "avx512_core_bf16"; break;
    case dnnl::cpu_isa::avx512_core_amx: isa = "avx512_core_amx"; break;
    default: break;
  }
  fmt::print("{}; oneDNN {}.{}.{} ({}), single-threaded; current path: im2col + libxsmm per image\n", CpuName(),
             v->major, v->minor, v->patch, isa);
  fmt::print("{:<44} {:>10} {:>10} {:>7}  {:<16} {}\n", "pass", "im2col us", "oneDNN us", "ratio", "oneDNN impl",
             "max |diff|");
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  for (int n : batches) {
    Convolutions(reps, eng, n, "conv1", 1, 32, 28, 28);
    Convolutions(reps, eng, n, "conv2", 32, 64, 14, 14);
    Pooling(reps, eng, n, "pool1", 32, 28, 28);
    Pooling(reps, eng, n, "pool2", 64, 14, 14);
  }
  return 0;
#endif
}
