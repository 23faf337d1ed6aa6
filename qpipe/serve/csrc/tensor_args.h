// What the ops do with their tensor arguments: dispatch on the element type, raw pointers, checks.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "fp8.h"
#include "vec.h"

namespace qpipe_cpu {

// Calls body with a null pointer of t's element type, float or bf16: the ops' generic lambdas
// read its type to pick their instantiation.
template <typename F>
void dispatch(const at::Tensor& t, const char* op, F&& body) {
  if (t.scalar_type() == at::kFloat) {
    body(static_cast<float*>(nullptr));
  } else if (t.scalar_type() == at::kBFloat16) {
    body(static_cast<bf16*>(nullptr));
  } else {
    TORCH_CHECK(false, op, ": float32 or bfloat16 only, got ", t.scalar_type());
  }
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

inline void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, what, " must be 2-D with contiguous rows");
}

// Calls body with a null pointer of the KV cache's element type: float, bf16 or e4m3.
template <typename F>
void dispatch_cache(const at::Tensor& cache, const char* op, F&& body) {
  if (cache.scalar_type() == at::kFloat8_e4m3fn) {
    body(static_cast<e4m3*>(nullptr));
  } else {
    dispatch(cache, op, body);
  }
}

}  // namespace qpipe_cpu
