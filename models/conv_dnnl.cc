#include "models/conv_dnnl.h"

#include <cstdio>
#include <cstdlib>

#include "models/layers.h"

#ifdef ESTUARY_HAVE_DNNL
#include <algorithm>
#include <memory>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

// Debian's oneDNN threads with OpenMP (libgomp, which it links); declared here
// rather than through <omp.h>, which would put -fopenmp on the models library.
extern "C" void omp_set_num_threads(int);
#endif

namespace estuary::models {

#ifndef ESTUARY_HAVE_DNNL

bool ConvOnDnnl(const Conv2d&) { return false; }
void DnnlConvForward(const Conv2d&, const float*, int, float*, float*, bool) { std::abort(); }
void DnnlConvBackward(const Conv2d&, const float*, const float*, int, float*, float*, float*) { std::abort(); }

#else

namespace {

using dnnl::memory;
using Tag = memory::format_tag;

// 64-byte aligned floats, for oneDNN's blocked copies and its scratchpad.
struct Buffer {
  std::unique_ptr<float, decltype(&std::free)> data{nullptr, &std::free};
  void Reset(size_t bytes) {
    data.reset(static_cast<float*>(std::aligned_alloc(64, (std::max<size_t>(bytes, 64) + 63) / 64 * 64)));
  }
};

// One thread's engine and stream, with OpenMP's thread count on this thread set to 1 before oneDNN
// first asks for it (its kernels' blocking depends on the count it sees when a primitive is made).
struct Context {
  Context() { omp_set_num_threads(1); }
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
};

Context& ThreadContext() {
  thread_local Context context;
  return context;
}

// A reorder between two of the plan's tensors, or nothing where the layouts agree.
struct Reorder {
  dnnl::reorder prim;
  memory::desc scratch_desc;
  memory scratch;
  bool needed = false;
};

class Plan {
 public:
  Plan(const Conv2d& c, int n) : ic_(c.in_channels), oc_(c.out_channels), k_(c.kernel), pad_(c.pad),
                                 height_(c.height), width_(c.width), n_(n) {
    Context& cx = ThreadContext();
    const dnnl::engine& eng = cx.engine;
    // The output is h x w, as im2col's: padding pad before and k - 1 - pad after.
    const memory::dims src{n, ic_, height_, width_}, wei{oc_, ic_, k_, k_}, bia{oc_},
        dst{n, oc_, height_, width_}, one{1, 1}, pad{pad_, pad_}, pad_r{k_ - 1 - pad_, k_ - 1 - pad_};
    const auto f32 = memory::data_type::f32;
    const memory::desc any_src(src, f32, Tag::any), any_wei(wei, f32, Tag::any), any_dst(dst, f32, Tag::any),
        bias(bia, f32, Tag::x);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    dnnl::primitive_attr relu_attr;  // its own: a copy of a oneDNN handle shares the object
    relu_attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    dnnl::post_ops ops;
    ops.append_eltwise(1.0f, dnnl::algorithm::eltwise_relu, 0.0f, 0.0f);
    relu_attr.set_post_ops(ops);
    const auto direct = dnnl::algorithm::convolution_direct;
    const dnnl::convolution_forward::desc fd(dnnl::prop_kind::forward_training, direct, any_src, any_wei, bias,
                                             any_dst, one, pad, pad_r);
    fwd_pd_[0] = dnnl::convolution_forward::primitive_desc(fd, attr, eng);
    // With the ReLU, on the layouts the plain forward chose: the passes share the tensors below.
    fwd_pd_[1] = dnnl::convolution_forward::primitive_desc(
        dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, direct, fwd_pd_[0].src_desc(),
                                        fwd_pd_[0].weights_desc(), bias, fwd_pd_[0].dst_desc(), one, pad, pad_r),
        relu_attr, eng);
    bd_pd_ = dnnl::convolution_backward_data::primitive_desc(
        dnnl::convolution_backward_data::desc(direct, any_src, any_wei, any_dst, one, pad, pad_r), attr, eng,
        fwd_pd_[0]);
    bw_pd_ = dnnl::convolution_backward_weights::primitive_desc(
        dnnl::convolution_backward_weights::desc(direct, any_src, any_wei, bias, any_dst, one, pad, pad_r), attr,
        eng, fwd_pd_[0]);
    for (int r = 0; r < 2; ++r) fwd_[r] = dnnl::convolution_forward(fwd_pd_[r]);
    bd_ = dnnl::convolution_backward_data(bd_pd_);
    bw_ = dnnl::convolution_backward_weights(bw_pd_);

    // The caller's tensors (plain, PyTorch's layouts), bound to their buffers at each call.
    x_ = User(memory::desc(src, f32, Tag::nchw));
    y_ = User(memory::desc(dst, f32, Tag::nchw));
    w_ = User(memory::desc(wei, f32, Tag::oihw));
    b_ = User(bias);
    dy_ = User(memory::desc(dst, f32, Tag::nchw));
    dx_ = User(memory::desc(src, f32, Tag::nchw));
    dw_ = User(memory::desc(wei, f32, Tag::oihw));
    db_ = User(bias);
    // oneDNN's: the kept input lives in the caller's `keep`; the rest in the plan.
    keep_ = User(fwd_pd_[0].src_desc());
    fwd_wei_ = Own(fwd_pd_[0].weights_desc(), w_);
    fwd_dst_ = Own(fwd_pd_[0].dst_desc(), y_);
    bd_ddst_ = Own(bd_pd_.diff_dst_desc(), dy_);
    bd_wei_ = Own(bd_pd_.weights_desc(), w_);
    bd_dsrc_ = Own(bd_pd_.diff_src_desc(), dx_);
    bw_src_ = Own(bw_pd_.src_desc(), keep_);
    bw_ddst_ = Own(bw_pd_.diff_dst_desc(), bd_ddst_);
    bw_dwei_ = Own(bw_pd_.diff_weights_desc(), dw_);
    bw_dbia_ = Own(bw_pd_.diff_bias_desc(), db_);

    // Every reorder the passes may need, made now; all share one scratchpad.
    x_to_keep_ = MakeReorder(x_, keep_, attr, /*always=*/true);
    w_to_fwd_ = MakeReorder(w_, fwd_wei_, attr);
    fwd_to_y_ = MakeReorder(fwd_dst_, y_, attr);
    dy_to_bd_ = MakeReorder(dy_, bd_ddst_, attr);
    w_to_bd_ = MakeReorder(w_, bd_wei_, attr);
    bd_to_dx_ = MakeReorder(bd_dsrc_, dx_, attr);
    keep_to_bw_ = MakeReorder(keep_, bw_src_, attr);
    bd_to_bw_ = MakeReorder(bd_ddst_, bw_ddst_, attr);
    bw_to_dw_ = MakeReorder(bw_dwei_, dw_, attr);
    bw_to_db_ = MakeReorder(bw_dbia_, db_, attr);
    for (const auto* pd : std::initializer_list<const dnnl::primitive_desc_base*>{&fwd_pd_[0], &fwd_pd_[1], &bd_pd_,
                                                                                    &bw_pd_}) {
      scratch_bytes_ = std::max(scratch_bytes_, pd->scratchpad_desc().get_size());
    }
    scratch_.Reset(scratch_bytes_);
    for (int r = 0; r < 2; ++r) fwd_scratch_[r] = Scratch(fwd_pd_[r].scratchpad_desc());
    bd_scratch_ = Scratch(bd_pd_.scratchpad_desc());
    bw_scratch_ = Scratch(bw_pd_.scratchpad_desc());
    for (Reorder* r : {&x_to_keep_, &w_to_fwd_, &fwd_to_y_, &dy_to_bd_, &w_to_bd_, &bd_to_dx_, &keep_to_bw_,
                       &bd_to_bw_, &bw_to_dw_, &bw_to_db_}) {
      if (r->needed) r->scratch = Scratch(r->scratch_desc);
    }
  }

  bool Matches(const Conv2d& c, int n) const {
    return ic_ == c.in_channels && oc_ == c.out_channels && k_ == c.kernel && pad_ == c.pad && height_ == c.height &&
           width_ == c.width && n_ == n;
  }
  int64_t kept_floats() const { return int64_t(fwd_pd_[0].src_desc().get_size() / sizeof(float)); }

  void Forward(const float* x, float* keep, const float* w, const float* b, float* y, bool relu) {
    Bind(x_, x);
    Bind(keep_, keep);
    Bind(w_, w);
    Bind(b_, b);
    Bind(y_, y);
    Run(x_to_keep_, x_, keep_);
    Run(w_to_fwd_, w_, fwd_wei_.mem);
    Exec(fwd_[relu ? 1 : 0], fwd_scratch_[relu ? 1 : 0],
         {{DNNL_ARG_SRC, &keep_},
          {DNNL_ARG_WEIGHTS, &fwd_wei_.mem},
          {DNNL_ARG_BIAS, &b_},
          {DNNL_ARG_DST, &fwd_dst_.mem}});
    Run(fwd_to_y_, fwd_dst_.mem, y_);
  }

  void Backward(const float* keep, const float* dy, const float* w, float* dx, float* dw, float* db) {
    Bind(keep_, keep);
    Bind(dy_, dy);
    Run(dy_to_bd_, dy_, bd_ddst_.mem);
    if (dx) {
      Bind(w_, w);
      Bind(dx_, dx);
      Run(w_to_bd_, w_, bd_wei_.mem);
      Exec(bd_, bd_scratch_,
           {{DNNL_ARG_DIFF_DST, &bd_ddst_.mem}, {DNNL_ARG_WEIGHTS, &bd_wei_.mem}, {DNNL_ARG_DIFF_SRC, &bd_dsrc_.mem}});
      Run(bd_to_dx_, bd_dsrc_.mem, dx_);
    }
    if (dw) {
      Bind(dw_, dw);
      Bind(db_, db);
      Run(keep_to_bw_, keep_, bw_src_.mem);
      Run(bd_to_bw_, bd_ddst_.mem, bw_ddst_.mem);
      Exec(bw_, bw_scratch_,
           {{DNNL_ARG_SRC, &bw_src_.mem},
            {DNNL_ARG_DIFF_DST, &bw_ddst_.mem},
            {DNNL_ARG_DIFF_WEIGHTS, &bw_dwei_.mem},
            {DNNL_ARG_DIFF_BIAS, &bw_dbia_.mem}});
      Run(bw_to_dw_, bw_dwei_.mem, dw_);
      Run(bw_to_db_, bw_dbia_.mem, db_);
    }
  }

 private:
  struct Own_ {
    memory mem;
    Buffer buffer;
  };

  memory User(const memory::desc& desc) { return memory(desc, ThreadContext().engine, DNNL_MEMORY_NONE); }

  // A tensor in `desc`; where that is the layout of `plain`, the same memory (no copy, no reorder).
  Own_ Own(const memory::desc& desc, const memory& plain) {
    Own_ t;
    if (desc == plain.get_desc()) {
      t.mem = plain;
      return t;
    }
    t.buffer.Reset(desc.get_size());
    t.mem = memory(desc, ThreadContext().engine, t.buffer.data.get());
    return t;
  }
  Own_ Own(const memory::desc& desc, const Own_& plain) { return Own(desc, plain.mem); }

  Reorder MakeReorder(const memory& from, const Own_& to, const dnnl::primitive_attr& attr) {
    return MakeReorder(from, to.mem, attr);
  }
  Reorder MakeReorder(const Own_& from, const memory& to, const dnnl::primitive_attr& attr) {
    return MakeReorder(from.mem, to, attr);
  }
  Reorder MakeReorder(const Own_& from, const Own_& to, const dnnl::primitive_attr& attr) {
    return MakeReorder(from.mem, to.mem, attr);
  }
  Reorder MakeReorder(const memory& from, const memory& to, const dnnl::primitive_attr& attr, bool always = false) {
    Reorder r;
    if (!always && from.get() == to.get()) return r;
    const dnnl::engine& eng = ThreadContext().engine;
    dnnl::reorder::primitive_desc pd(eng, from.get_desc(), eng, to.get_desc(), attr);
    r.scratch_desc = pd.scratchpad_desc();
    scratch_bytes_ = std::max(scratch_bytes_, r.scratch_desc.get_size());
    r.prim = dnnl::reorder(pd);
    r.needed = true;
    return r;
  }
  memory Scratch(const memory::desc& desc) { return memory(desc, ThreadContext().engine, scratch_.data.get()); }

  static void Bind(memory& m, const float* p) { m.set_data_handle(const_cast<float*>(p)); }

  void Run(Reorder& r, const memory& from, const memory& to) {
    if (!r.needed) return;
    Exec(r.prim, r.scratch, {{DNNL_ARG_FROM, &from}, {DNNL_ARG_TO, &to}});
  }

  // Through the C API: the C++ one gathers its arguments in an unordered_map, an allocation a call.
  void Exec(const dnnl::primitive& p, const memory& scratch,
            std::initializer_list<std::pair<int, const memory*>> args) {
    dnnl_exec_arg_t list[6];
    int count = 0;
    for (const auto& [arg, mem] : args) list[count++] = {arg, mem->get()};
    if (scratch.get(true) && scratch.get_desc().get_size() > 0) list[count++] = {DNNL_ARG_SCRATCHPAD, scratch.get()};
    dnnl::error::wrap_c_api(dnnl_primitive_execute(p.get(), ThreadContext().stream.get(), count, list),
                            "dnnl_primitive_execute");
  }

  int ic_, oc_, k_, pad_, height_, width_, n_;
  dnnl::convolution_forward::primitive_desc fwd_pd_[2];  // [relu]
  dnnl::convolution_backward_data::primitive_desc bd_pd_;
  dnnl::convolution_backward_weights::primitive_desc bw_pd_;
  dnnl::convolution_forward fwd_[2];
  dnnl::convolution_backward_data bd_;
  dnnl::convolution_backward_weights bw_;
  memory x_, y_, w_, b_, dy_, dx_, dw_, db_, keep_;
  Own_ fwd_wei_, fwd_dst_, bd_ddst_, bd_wei_, bd_dsrc_, bw_src_, bw_ddst_, bw_dwei_, bw_dbia_;
  Reorder x_to_keep_, w_to_fwd_, fwd_to_y_, dy_to_bd_, w_to_bd_, bd_to_dx_, keep_to_bw_, bd_to_bw_, bw_to_dw_,
      bw_to_db_;
  size_t scratch_bytes_ = 0;
  Buffer scratch_;
  memory fwd_scratch_[2], bd_scratch_, bw_scratch_;
};

Plan& PlanFor(const Conv2d& c, int n) {
  thread_local std::vector<std::unique_ptr<Plan>> plans;
  for (auto& p : plans) {
    if (p->Matches(c, n)) return *p;
  }
  auto plan = std::make_unique<Plan>(c, n);
  // The kept input goes where im2col's columns would: it must fit their room.
  if (plan->kept_floats() > int64_t(n) * c.col_size()) {
    std::fprintf(stderr, "models: oneDNN's kept input of %lld floats exceeds the %lld of the columns\n",
                 (long long)plan->kept_floats(), (long long)(int64_t(n) * c.col_size()));
    std::abort();
  }
  plans.push_back(std::move(plan));
  return *plans.back();
}

}  // namespace

bool ConvOnDnnl(const Conv2d& c) {
  // k >= 3: the input in a layout padded to 16 channels still fits in the columns' room (k² ≥ 2 × channels).
  return !c.im2col_only && c.in_channels > 0 && c.in_channels % 8 == 0 && c.out_channels > 0 &&
         c.out_channels % 8 == 0 && c.kernel >= 3 && c.pad >= 0 && c.pad < c.kernel;
}

void DnnlConvForward(const Conv2d& c, const float* x, int n, float* keep, float* y, bool relu) {
  if (n == 0) return;
  PlanFor(c, n).Forward(x, keep, c.w, c.b, y, relu);
}

void DnnlConvBackward(const Conv2d& c, const float* keep, const float* dy, int n, float* dx, float* dw_plain,
                      float* db_plain) {
  if (n == 0) {
    if (dw_plain) std::fill(dw_plain, dw_plain + c.out_channels * c.in_channels * c.kernel * c.kernel, 0.0f);
    if (db_plain) std::fill(db_plain, db_plain + c.out_channels, 0.0f);
    return;
  }
  PlanFor(c, n).Backward(keep, dy, c.w, dx, dw_plain, db_plain);
}

#endif

}  // namespace estuary::models
