// Size and pointer arithmetic the host side of models/cuda shares (internal).
//
// CheckedProduct is how the ops check a shape before launching: the product
// of its dimensions, or -1 when a dimension is negative or the product
// overflows an int64. Advance steps a pointer over elements of a dtype, for
// the column blocks of a fused row (q, k and v of qkv; an adapter's slice).
#pragma once

#include <cstdint>
#include <initializer_list>

#include "models/tensor.h"

namespace estuary::models::cuda {

inline int64_t CheckedProduct(std::initializer_list<int64_t> factors) {
  int64_t p = 1;
  for (int64_t f : factors) {
    if (f < 0 || (f > 0 && p > INT64_MAX / f)) return -1;
    p *= f;
  }
  return p;
}

inline const void* Advance(const void* p, int64_t elements, DType dtype) {
  return static_cast<const char*>(p) + elements * int64_t(DTypeSize(dtype));
}
inline void* Advance(void* p, int64_t elements, DType dtype) {
  return static_cast<char*>(p) + elements * int64_t(DTypeSize(dtype));
}

}  // namespace estuary::models::cuda
