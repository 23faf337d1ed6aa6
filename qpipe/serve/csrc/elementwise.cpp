// The elementwise steps of a decoder layer, each one pass over its rows instead of several eager
// ops: RMSNorm (alone or after the residual add), rotary embedding, SiLU * up.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ops.h"
#include "tensor_args.h"
#include "vec.h"

namespace qpipe_cpu {
namespace {

// RMSNorm of one row as Llama computes it: statistics in fp32, normalized row rounded to the model
// dtype, then multiplied by the weight in the model dtype.
template <typename T>
void norm_row(T* out, const T* x, const T* w, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float v = ld(x + i);
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for_lanes(n, [&](int64_t i, auto lane) {
    using V = decltype(lane);
    st(out + i, load<V>(w + i) * rnd<T>(load<V>(x + i) * inv));
  });
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  const int64_t rows = x.size(0), n = x.size(1);
  dispatch(x, "rms_norm", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* o = ptr<T>(out);
    const T* in = ptr<T>(x);
    const T* w = ptr<T>(weight);
    const int64_t os = out.stride(0), xs = x.stride(0);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) norm_row(o + r * os, in + r * xs, w, n, float(eps));
    });
  });
}

// residual += x (rounded to the model dtype, as the eager add), then x = RMSNorm(residual):
// the residual stream and the next layer's normalized input in one pass.
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  const int64_t rows = x.size(0), n = x.size(1);
  dispatch(x, "fused_add_rms_norm", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* xp = ptr<T>(x);
    T* rp = ptr<T>(residual);
    const T* w = ptr<T>(weight);
    const int64_t xs = x.stride(0), rs = residual.stride(0);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* __restrict__ xr = xp + r * xs;
        T* __restrict__ res = rp + r * rs;
        for_lanes(n, [&](int64_t i, auto lane) {
          using V = decltype(lane);
          st(res + i, load<V>(res + i) + load<V>(xr + i));
        });
        norm_row(xr, res, w, n, float(eps));
      }
    });
  });
}

// Rotates the first `heads` heads of each row of qkv in place: x * cos + roll(x, half) * sin, with
// `sin` carrying rotate_half's sign (see layers/rotary.py). Tables are fp32 [max_pos, head_dim].
void rotary(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
            const at::Tensor& sin, int64_t heads, int64_t head_dim) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rotary tables must be float32");
  TORCH_CHECK(positions.scalar_type() == at::kLong, "positions must be int64");
  const int64_t tokens = qkv.size(0), half = head_dim / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  dispatch(qkv, "rotary", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* base = ptr<T>(qkv);
    const int64_t stride = qkv.stride(0);
    const float* cos_table = cos.data_ptr<float>();
    const float* sin_table = sin.data_ptr<float>();
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* __restrict__ c = cos_table + pos[t] * head_dim;
        const float* __restrict__ s = sin_table + pos[t] * head_dim;
        for (int64_t h = 0; h < heads; ++h) {
          T* __restrict__ x = base + t * stride + h * head_dim;
          for_lanes(half, [&](int64_t i, auto lane) {
            using V = decltype(lane);
            const V a = load<V>(x + i), b = load<V>(x + i + half);
            st(x + i, a * load<V>(c + i) + b * load<V>(s + i));
            st(x + i + half, b * load<V>(c + i + half) + a * load<V>(s + i + half));
          });
        }
      }
    });
  });
}

// out = silu(gate) * up for x = [gate | up] per row; silu rounded to the model dtype first, as
// the eager `act(gate) * up` does.
void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  check_rows(x, "x");
  check_rows(out, "out");
  const int64_t rows = x.size(0), n = out.size(1);
  TORCH_CHECK(x.size(1) == 2 * n, "x must be [rows, 2 * out columns]");
  dispatch(x, "silu_and_mul", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* in = ptr<T>(x);
    T* dst = ptr<T>(out);
    const int64_t xs = x.stride(0), os = out.stride(0);
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* __restrict__ g = in + r * xs;
        T* __restrict__ o = dst + r * os;
        for_lanes(n, [&](int64_t i, auto lane) {
          using V = decltype(lane);
          st(o + i, rnd<T>(silu(load<V>(g + i))) * load<V>(g + n + i));
        });
      }
    });
  });
}

}  // namespace qpipe_cpu
