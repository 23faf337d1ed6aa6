// Quantization steps in one pass per row: W8A8's per-token int8 quantization of activations, a
// row rounded through fp8 e4m3 and back (FP8 layers' inputs), and the W8A8 epilogue that scales a
// product's rows.
#include "quantize.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>

#include "fp8.h"
#include "ops.h"
#include "tensor_args.h"
#include "vec.h"

namespace qpipe_cpu {

// W8A8 activation quantization, one pass for the absmax and one to quantize per row, instead of
// ~8 eager ops.
void quantize_per_token_int8(at::Tensor& q, at::Tensor& scales, const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "q must be contiguous int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "scales must be contiguous float32");
  quantize_rows(q.data_ptr<int8_t>(), scales.data_ptr<float>(), x);
}

// x rounded through fp8 e4m3 and back per row, in one pass instead of ~10 eager ops, with the
// eager path's roundings (layers/fp8.py `quantize_fp8`, compressed-tensors' rule): the scale
// is absmax / 448 per row in the model dtype (its epsilon for a row of zeros), or the given
// static one; x / scale is rounded to the model dtype, clamped to +-448, rounded to e4m3, and
// times the scale rounded to the model dtype again. The same bits as the eager ops.
void fake_quantize_fp8(at::Tensor& out, const at::Tensor& x,
                       const c10::optional<at::Tensor>& scale) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.sizes() == x.sizes(),
              "out must be shaped and typed as x");
  const bool is_static = scale.has_value() && scale->defined();
  TORCH_CHECK(!is_static || scale->numel() == 1, "a static scale must be one value");
  const float static_scale = is_static ? scale->to(at::kFloat).item<float>() : 0.f;
  const int64_t rows = x.size(0), n = x.size(1);
  dispatch(x, "fake_quantize_fp8", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* in = ptr<T>(x);
    T* dst = ptr<T>(out);
    const float eps = std::is_same_v<T, float> ? std::numeric_limits<float>::epsilon() : 0.0078125f;
    const int64_t xs = x.stride(0), os = out.stride(0);
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* __restrict__ row = in + r * xs;
        T* __restrict__ o = dst + r * os;
        float s = rnd<T>(static_scale);
        if (!is_static) {
          float top = 0.f, probe = 0.f;  // probe: NaN when the row holds a NaN or an inf
#pragma omp simd reduction(max : top) reduction(+ : probe)
          for (int64_t i = 0; i < n; ++i) {
            const float v = ld(row + i);
            top = std::max(top, std::fabs(v));
            probe += v - v;
          }
          s = rnd<T>(top / kE4m3Max);
          s = s == 0.f ? eps : s;
          // eager's absmax is NaN there: a NaN or inf anywhere makes the whole row NaN
          s = probe != probe ? std::numeric_limits<float>::quiet_NaN() : s;
        }
        for_lanes(n, [&](int64_t i, auto lane) {
          using V = decltype(lane);
          st(o + i, saturated_e4m3(rnd<T>(load<V>(row + i) / s)) * s);
        });
      }
    });
  });
}

// out = x * row_scale (+ fp32 bias), rounded once to the model dtype: the W8A8 epilogue after a
// GEMM that already applied the per-channel weight scales in fp32.
void scale_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& row_scales,
                const c10::optional<at::Tensor>& bias) {
  check_rows(out, "out");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32");
  TORCH_CHECK(row_scales.scalar_type() == at::kFloat, "row_scales must be float32");
  const int64_t rows = out.size(0), n = out.size(1);
  TORCH_CHECK(x.size(0) == rows && x.size(1) == n && row_scales.numel() == rows,
              "x, row_scales and out disagree in shape");
  dispatch(out, "scale_rows", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const float* a = x.data_ptr<float>();
    const float* rs = row_scales.data_ptr<float>();
    const bool has_bias = bias.has_value() && bias->defined();
    TORCH_CHECK(!has_bias || bias->scalar_type() == at::kFloat, "bias must be float32");
    const float* b = has_bias ? bias->data_ptr<float>() : nullptr;
    T* o = ptr<T>(out);
    const int64_t os = out.stride(0);
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* src = a + r * n;
        T* dst = o + r * os;
        const float s = rs[r];
        if (b != nullptr) {
          for_lanes(n, [&](int64_t i, auto lane) {
            using V = decltype(lane);
            st(dst + i, load<V>(src + i) * s + load<V>(b + i));
          });
        } else {
          for_lanes(n, [&](int64_t i, auto lane) {
            st(dst + i, load<decltype(lane)>(src + i) * s);
          });
        }
      }
    });
  });
}

}  // namespace qpipe_cpu
