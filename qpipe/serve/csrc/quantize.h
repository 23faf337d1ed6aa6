// Per-token int8 quantization of rows (W8A8 activations), shared by the quantization op and the
// int8 linear layers, and the W8A8 epilogue that scales a product's rows.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>

#include "tensor_args.h"

namespace qpipe_cpu {

// Dynamic per-token int8 quantization of one row with compressed-tensors' rule (scale =
// absmax / 127.5, round half to even, clamp to [-128, 127]) so results match what llm-compressor
// calibrated against; returns the scale. D: int8_t; uint8_t for the values + 128 (oneDNN's int8
// GEMM input, `int8_product`); or float for the values as floats (the input of the fp32 products
// on CPUs without VNNI).
template <typename D, typename S>
float quantize_row(D* __restrict__ dst, const S* __restrict__ row, int64_t n) {
  constexpr float offset = std::is_same_v<D, uint8_t> ? 128.f : 0.f;
  float top = 0.f;
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < n; ++i) top = std::max(top, std::fabs(ld(row + i)));
  const float s = std::max(top, std::numeric_limits<float>::min()) / 127.5f;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::nearbyint(ld(row + i) / s);
    dst[i] = static_cast<D>(std::min(std::max(v, -128.f), 127.f) + offset);
  }
  return s;
}

// quantize_row for every row of x into `out` (contiguous rows of D) and `scale`.
template <typename D>
void quantize_rows(D* out, float* scale, const at::Tensor& x) {
  const int64_t rows = x.size(0), n = x.size(1);
  dispatch(x, "quantize_per_token_int8", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* in = ptr<T>(x);
    const int64_t xs = x.stride(0);
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) scale[r] = quantize_row(out + r * n, in + r * xs, n);
    });
  });
}

// out = x * row_scales (+ fp32 bias), rounded once to out's dtype (quantize.cpp).
void scale_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& row_scales,
                const c10::optional<at::Tensor>& bias);

}  // namespace qpipe_cpu
