#include "models/cuda/layers.h"

#include <climits>

#include "models/cuda/check.h"
#include "models/cuda/kernels.h"
#include "models/cuda/sizes.h"

namespace estuary::models::cuda {

Status BroadcastBias(const float* bias, int64_t outer, int64_t channels, int64_t inner, float* y,
                     cudaStream_t stream) {
  const int64_t total = CheckedProduct({outer, channels, inner});
  if (total < 0) return InvalidArgument("cuda bias: bad shape [{}, {}, {}]", outer, channels, inner);
  if (total == 0) return Status::Ok();
  if (!bias || !y) return InvalidArgument("cuda bias: null buffer");
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::BroadcastBias(bias, outer, channels, inner, y, stream));
  return Status::Ok();
}

Status BiasGradient(const float* dy, int64_t outer, int64_t channels, int64_t inner, float* dbias,
                    cudaStream_t stream) {
  if (CheckedProduct({outer, channels, inner}) < 0) {
    return InvalidArgument("cuda bias gradient: bad shape [{}, {}, {}]", outer, channels, inner);
  }
  if (channels == 0) return Status::Ok();
  if (!dbias || (outer * inner > 0 && !dy)) return InvalidArgument("cuda bias gradient: null buffer");
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::BiasGradient(dy, outer, channels, inner, dbias, stream));
  return Status::Ok();
}

Status ReluForward(float* x, int64_t count, cudaStream_t stream) {
  if (count < 0) return InvalidArgument("cuda relu: negative count {}", count);
  if (count > 0 && !x) return InvalidArgument("cuda relu: null buffer");
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::ReluForward(x, count, internal::IsAligned(x, 16), stream));
  return Status::Ok();
}

Status ReluBackward(const float* y, float* dy, int64_t count, cudaStream_t stream) {
  if (count < 0) return InvalidArgument("cuda relu backward: negative count {}", count);
  if (count > 0 && (!y || !dy)) return InvalidArgument("cuda relu backward: null buffer");
  const bool vec = internal::IsAligned(y, 16) && internal::IsAligned(dy, 16);
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::ReluBackward(y, dy, count, vec, stream));
  return Status::Ok();
}

namespace {

Status CheckConv(const char* what, const ConvShape& s) {
  if (s.n < 0 || s.channels < 1 || s.height < 1 || s.width < 1 || s.kernel < 1 || s.pad < 0 || s.pad >= s.kernel ||
      CheckedProduct({s.n, s.channels, s.kernel, s.kernel, s.height, s.width}) < 0) {
    return InvalidArgument("{}: bad shape n={} c={} h={} w={} kernel={} pad={}", what, s.n, s.channels, s.height,
                           s.width, s.kernel, s.pad);
  }
  return Status::Ok();
}

Status CheckPool(const char* what, int n, int channels, int height, int width) {
  if (n < 0 || channels < 1 || height < 2 || width < 2 || height % 2 || width % 2) {
    return InvalidArgument("{}: shape [{}, {}, {}, {}] needs n >= 0, c >= 1 and even h, w >= 2", what, n, channels,
                           height, width);
  }
  // argmax holds indices into the whole batch as int32, like the CPU layer.
  if (CheckedProduct({n, channels, height, width}) > INT32_MAX) {
    return InvalidArgument("{}: {} inputs overflow the int32 argmax", what,
                           CheckedProduct({n, channels, height, width}));
  }
  return Status::Ok();
}

// Im2Col and Col2Im: the same checks, then `layout` moves `in` into `out`'s layout.
Status ConvLayout(const char* what, decltype(&internal::Im2Col) layout, const float* in, const ConvShape& s,
                  float* out, cudaStream_t stream) {
  ESTUARY_RETURN_IF_ERROR(CheckConv(what, s));
  if (s.n == 0) return Status::Ok();
  if (!in || !out) return InvalidArgument("{}: null buffer", what);
  ESTUARY_CUDA_RETURN_IF_ERROR(layout(in, s.n, s.channels, s.height, s.width, s.kernel, s.pad, out, stream));
  return Status::Ok();
}

}  // namespace

Status Im2Col(const float* x, const ConvShape& s, float* cols, cudaStream_t stream) {
  return ConvLayout("cuda im2col", internal::Im2Col, x, s, cols, stream);
}

Status Col2Im(const float* cols, const ConvShape& s, float* dx, cudaStream_t stream) {
  return ConvLayout("cuda col2im", internal::Col2Im, cols, s, dx, stream);
}

Status MaxPool2Forward(const float* x, int n, int channels, int height, int width, float* y, int32_t* argmax,
                       cudaStream_t stream) {
  ESTUARY_RETURN_IF_ERROR(CheckPool("cuda max-pool", n, channels, height, width));
  if (n == 0) return Status::Ok();
  if (!x || !y || !argmax) return InvalidArgument("cuda max-pool: null buffer");
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::MaxPool2Forward(x, n, channels, height, width, y, argmax, stream));
  return Status::Ok();
}

Status MaxPool2Backward(const float* dy, const int32_t* argmax, int n, int channels, int height, int width, float* dx,
                        cudaStream_t stream) {
  ESTUARY_RETURN_IF_ERROR(CheckPool("cuda max-pool backward", n, channels, height, width));
  if (n == 0) return Status::Ok();
  if (!dy || !argmax || !dx) return InvalidArgument("cuda max-pool backward: null buffer");
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::MaxPool2Backward(dy, argmax, n, channels, height, width, dx, stream));
  return Status::Ok();
}

Status SoftmaxCrossEntropy(const float* logits, const int32_t* labels, int n, int classes, float* dlogits,
                           float* loss, int64_t* correct, Arena& arena, cudaStream_t stream, float grad_scale) {
  if (n < 1 || classes < 1 || CheckedProduct({n, classes}) < 0) {
    return InvalidArgument("cuda cross-entropy: needs n >= 1 rows of classes >= 1, got n={} classes={}", n, classes);
  }
  if (!logits || !labels || !loss) return InvalidArgument("cuda cross-entropy: null buffer");
  ESTUARY_ASSIGN_OR_RETURN(float* row_loss, arena.Allocate<float>(n));
  ESTUARY_ASSIGN_OR_RETURN(int32_t* row_correct, arena.Allocate<int32_t>(n));
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::SoftmaxCrossEntropy(logits, labels, n, classes, dlogits, grad_scale,
                                                             row_loss, row_correct, loss, correct, stream));
  return Status::Ok();
}

}  // namespace estuary::models::cuda
