// CPU kernels for the serving engine's memory-bound steps, registered as torch.ops.qpipe_cpu.*.
//
// Why by hand: on a 2-core CPU a decode step of a small model is dominated not by its GEMMs but by
// (a) gathering each sequence's K/V blocks into a padded copy before SDPA and (b) ~30 small eager
// ops per layer (norms, rotary, SiLU, residual adds), each a full pass over memory plus dispatch.
// These kernels read the paged cache in place and do each of those steps in one pass. They compute
// in fp32 and round once to the model dtype where the eager path rounds the same way.
//
// Built at first use by qpipe/serve/layers/cpu_kernels.py with -O3 -march=native: loops are
// written so that GCC vectorizes them (contiguous inner loops, `omp simd` reductions, no calls).
// -ffp-contract=off keeps fp32 results equal to torch's unfused multiply-then-add.

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cpu/Utils.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using bf16 = uint16_t;  // raw bfloat16 bits

inline float ld(const float* p) { return *p; }
inline float ld(const bf16* p) {
  uint32_t u = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline void st(float* p, float v) { *p = v; }
inline void st(bf16* p, float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
  *p = static_cast<bf16>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);  // NaN stays NaN
}
// The value after a round trip through T: what an eager op in dtype T would have produced.
template <typename T>
inline float rnd(float v) {
  T t;
  st(&t, v);
  return ld(&t);
}

// kLanes floats as one value (GCC/Clang vector extension), one register of the CPU's own width:
// 16 floats with AVX-512, 8 otherwise. Used where auto-vectorization keeps accumulators in
// memory, and where the bf16 rounding below has a native instruction that GCC does not emit on
// its own. The width must be the CPU's: GCC lowers 16-float vectors on AVX2 as pieces that go
// through the stack (measured on a Zen 3: decode attention 1.7 -> 0.44 ms per SmolLM2 layer at
// 32 sequences, SiLU * up 2.2x slower than eager torch, until the type became 8 floats there).
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint16_t vbits16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t vbits32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline vfloat loadv(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// a * b + c rounded once, written out: `#pragma GCC optimize("fp-contract=fast")` does not reach
// lambdas, so a function of that region inlined into one (GCC 12) lost its fused multiply-adds and
// gave other bits than its out-of-line copies.
inline vfloat fmadd(vfloat a, vfloat b, vfloat c) {
#if defined(__AVX512F__)
  return reinterpret_cast<vfloat>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a),
                                                  reinterpret_cast<__m512>(b),
                                                  reinterpret_cast<__m512>(c)));
#elif defined(__FMA__)
  return reinterpret_cast<vfloat>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a),
                                                  reinterpret_cast<__m256>(b),
                                                  reinterpret_cast<__m256>(c)));
#else
  return a * b + c;
#endif
}
// bf16 bits to floats. GCC splits the generic widening into four instructions; AVX-512 has one.
inline vfloat widen(vbits16 h) {
#if defined(__AVX512F__)
  const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(h)), 16);
#else
  const vbits32 w = __builtin_convertvector(h, vbits32) << 16;
#endif
  vfloat v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
inline vfloat loadv(const bf16* p) {
  vbits16 h;
  std::memcpy(&h, p, sizeof h);
  return widen(h);
}
// Raw bits of an fp8 e4m3 value (the OCP "fn" form: no infinities, max 448), as a KV cache holds
// them. Loads of them give the value times 2^-8 (callers scale by kUnscale), which the CPU makes
// from them exactly in one instruction: with the sign moved to the top and exponent and mantissa
// 7 places up, an e4m3 value's bits are an fp16 whose exponent is biased by 15 instead of 7,
// subnormals included. Without F16C, a table of the 256 values.
struct e4m3 {
  uint8_t bits;
};
inline float ld(const e4m3* p) {
  static const std::vector<float> values = [] {
    std::vector<float> table(256);
    for (int b = 0; b < 256; ++b) {
      const int exponent = (b >> 3) & 15, mantissa = b & 7;
      const float magnitude = exponent ? std::ldexp(8.f + mantissa, exponent - 18)
                                       : std::ldexp(static_cast<float>(mantissa), -17);
      table[b] = b & 0x80 ? -magnitude : magnitude;
    }
    return table;
  }();
  return values[p->bits];
}
inline vfloat loadv(const e4m3* p) {
#if defined(__AVX512F__)
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(
      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
  return reinterpret_cast<vfloat>(_mm512_cvtph_ps(h));
#elif defined(__AVX2__) && defined(__F16C__)
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
  return reinterpret_cast<vfloat>(_mm256_cvtph_ps(h));
#else
  vfloat v;
  for (int64_t l = 0; l < kLanes; ++l) v[l] = ld(p + l);
  return v;
#endif
}
// What a load's values are multiplied by to be the stored ones.
template <typename C>
constexpr float kUnscale = std::is_same_v<C, e4m3> ? 256.f : 1.f;
// kLanes floats rounded to bf16 bits. With AVX512-BF16 one instruction instead of seven (measured
// here per 2048-token layer in bf16: SiLU * up 2.5 -> 1.7 ms, residual add + RMSNorm 0.36 ->
// 0.27 ms), the same round-to-nearest-even as `st` except that it flushes subnormals
// (|v| < 1.2e-38) to zero and keeps a NaN's sign and payload; elsewhere `st`'s integer rule.
inline vbits16 to_bf16(vfloat v) {
#if defined(__AVX512BF16__)
  vbits16 h;
  const auto packed = _mm512_cvtneps_pbh(reinterpret_cast<__m512>(v));
  std::memcpy(&h, &packed, sizeof h);
  return h;
#else
  vbits32 u;
  std::memcpy(&u, &v, sizeof u);
  const vbits32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vbits32 nan = vbits32{} + 0x7fc0u;
  return __builtin_convertvector((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded, vbits16);
#endif
}
inline void st(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }
inline void st(bf16* p, vfloat v) {
  const vbits16 h = to_bf16(v);
  std::memcpy(p, &h, sizeof h);
}
template <typename T>
inline vfloat rnd(vfloat v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return widen(to_bf16(v));
  }
}

// One float or kLanes of them from memory, so that one generic loop body (`for_lanes`) serves the
// vector part of a row and its scalar tail.
template <typename V, typename T>
inline V load(const T* p) {
  if constexpr (std::is_same_v<V, float>) {
    return ld(p);
  } else {
    return loadv(p);
  }
}

// body(i, lane) over [0, n): kLanes elements at a time with `lane` a vfloat, then one at a time
// with `lane` a float; the body reads its type to pick the loads.
template <typename Body>
inline void for_lanes(int64_t n, Body&& body) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) body(i, vfloat{});
  for (; i < n; ++i) body(i, 0.f);
}

inline float clamp(float x, float lo, float hi) { return std::min(std::max(x, lo), hi); }
inline vfloat clamp(vfloat x, float lo, float hi) {
  x = x < lo ? vfloat{} + lo : x;
  return x > hi ? vfloat{} + hi : x;
}
inline float floor_small(float x) { return std::floor(x); }
// floor for |x| < 2^31 (exp's range reduction), where truncation to int is exact.
inline vfloat floor_small(vfloat x) {
  const vfloat t = __builtin_convertvector(__builtin_convertvector(x, vint), vfloat);
  return t > x ? t - 1.f : t;
}
inline float exponent_scale(float n) {
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return scale;
}
inline vfloat exponent_scale(vfloat n) {
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return scale;
}

// exp for softmax and SiLU: Cephes' range reduction and polynomial (about 1 ulp), written without
// calls so loops over it vectorize; std::exp would run one element at a time. Scalar and vector
// forms give the same bits.
template <typename V>
inline V fast_exp(V x) {
  x = clamp(x, -87.3f, 88.7f);
  const V n = floor_small(x * 1.44269504088896341f + 0.5f);
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const V y = p * r * r + r + 1.0f;
  return y * exponent_scale(n);
}

template <typename V>
inline V silu(V v) {
  return v / (1.f + fast_exp(-v));
}

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

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, what, " must be 2-D with contiguous rows");
}

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

// W8A8 activation quantization, one pass for the absmax and one to quantize per row, instead of
// ~8 eager ops.
void quantize_per_token_int8(at::Tensor& q, at::Tensor& scales, const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "q must be contiguous int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "scales must be contiguous float32");
  quantize_rows(q.data_ptr<int8_t>(), scales.data_ptr<float>(), x);
}

// v's bits as another type of the same size (std::bit_cast is C++20), and the unsigned type of a
// float's or a vfloat's bits.
template <typename To, typename From>
inline To bit_cast(const From& v) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast between types of different sizes");
  To t;
  std::memcpy(&t, &v, sizeof t);
  return t;
}
template <typename V>
using bits_t = std::conditional_t<std::is_same_v<V, float>, uint32_t, vbits32>;

// The fp8 e4m3 value nearest to v, ties to even, for |v| <= 448 (callers clamp first), as torch's
// conversion to float8_e4m3fn and back gives it: 3 mantissa bits from 2^-6 up (a carry out of
// them lands in the exponent), steps of 2^-9 below, the subnormals, rounded by the FPU's own ties
// to even in an addition whose result's last place is 2^-9. NaN stays NaN.
template <typename V>
inline V round_to_e4m3(V v) {
  using U = bits_t<V>;
  const U u = bit_cast<U>(v);
  const U magnitude = u & 0x7fffffffu;
  const U normal = (magnitude + 0x7ffffu + ((magnitude >> 20) & 1u)) & 0xfff00000u;
  const V a = bit_cast<V>(magnitude);
  const V subnormal = (a + 16384.f) - 16384.f;
  const V rounded = a < 0.015625f ? subnormal : bit_cast<V>(normal);
  const V signed_rounded = bit_cast<V>(bit_cast<U>(rounded) | (u & 0x80000000u));
  return magnitude > 0x7f800000u ? v : signed_rounded;
}

// fp8 e4m3's largest finite value, and v rounded to e4m3 with everything beyond it saturated there
// (what fp8 weights' quantization and an fp8 KV cache store).
constexpr float kE4m3Max = 448.f;
template <typename V>
inline V saturated_e4m3(V v) {
  return round_to_e4m3(clamp(v, -kE4m3Max, kE4m3Max));
}

// x rounded through fp8 e4m3 and back per row, in one pass instead of ~10 eager ops, with the
// eager path's roundings (layers/linear.py `quantize_fp8`, compressed-tensors' rule): the scale
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

// Weight-only quantized linear (int8 values one per byte, int4 two: `kNibbles`; per-group fp32
// scales and optional zero points; AWQ, GPTQ and qpipe's int4-wo/int8-wo outputs, and W8A8 on
// CPUs without VNNI): out = x @ dequant(w).T. The eager path expands the whole weight to the
// model dtype on every call, which at decode sizes costs more than the GEMM (4-byte weights
// written, then read again): measured on a Zen 3 with SmolLM2 W4A16, 166 ms per token at
// concurrency 1.
//
// Here the weight is laid out once at load in tiles of kTile output features, k-major inside a
// tile ([tiles, in_features, kTile], the layer's `pack_for_cpu`), and read once per call at its
// own bit width. The threads split the tiles; each tile is expanded into an fp32 panel
// (in_features x kTile: L1/L2-sized), and every block of input rows runs an outer-product
// micro-kernel against it: one input value broadcast times kTile weights per multiply-add, with
// the block's accumulators in registers and no sums across lanes. Measured on a Zen 3, 32 rows x
// 576 -> 3072 with the weight in cache: 66 GFLOP/s for the earlier dot-product form on the plain
// layout, 139 here, as fast as oneDNN's fp32 GEMM on a packed weight while reading a quarter of
// its bytes. On CPUs with AVX512-BF16, bf16 inputs of many rows take weight_only_expand and one
// GEMM instead (weight_only_product decides).
constexpr int64_t kTile = 16;  // output features per tile: 2 AVX2 vectors, 1 AVX-512 vector
constexpr int64_t kTileVecs = kTile / kLanes;
constexpr int kBlockRows = 12 / kTileVecs;  // 12 accumulators: 6 rows on AVX2, 12 on AVX-512

inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

// kLanes int8 values as floats. GCC's generic conversion of a narrow int8 vector goes one
// element at a time; the sign-extend and convert instructions take two steps for all lanes.
inline vfloat widen_int8(const int8_t* p) {
  vfloat out;
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&out, &v, sizeof out);
#elif defined(__AVX2__)
  const __m256 v = _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&out, &v, sizeof out);
#else
  for (int64_t l = 0; l < kLanes; ++l) out[l] = static_cast<float>(p[l]);
#endif
  return out;
}

// int4 weights are kept two to a byte: tile rows 2m and 2m + 1 of output feature f in the low and
// high nibble of byte (m, f), each value plus 8 (0..15). A tile of k rows then takes k / 2 * kTile
// bytes, half what one byte per value reads at decode sizes, where the product waits on memory,
// and one load of kLanes bytes yields a weight vector of two rows. The +8 joins the zero point:
// (u - (z + 8)) * s equals (q - z) * s exactly. Tiles of one int8 per byte hold other weights.
template <typename Q>
constexpr bool kNibbles = std::is_same_v<Q, uint8_t>;
template <typename Q>
constexpr float kZeroOffset = kNibbles<Q> ? 8.f : 0.f;

// Weight vector v of tile row i as floats, for tiles of one value per element: int8, or bf16
// (dense bf16 weights on CPUs without a native bf16 GEMM: `dense_linear`).
inline vfloat widen_row(const int8_t* q, int64_t i, int64_t v) {
  return widen_int8(q + i * kTile + v * kLanes);
}
inline vfloat widen_row(const bf16* q, int64_t i, int64_t v) {
  return loadv(q + i * kTile + v * kLanes);
}

// Weight vector v of tile rows i and i + 1 as floats (i even for nibbles).
template <typename Q>
inline void widen_rows(const Q* q, int64_t i, int64_t v, vfloat& a, vfloat& b) {
  a = widen_row(q, i, v);
  b = widen_row(q, i + 1, v);
}
inline void widen_rows(const uint8_t* q, int64_t i, int64_t v, vfloat& a, vfloat& b) {
  const uint8_t* p = q + i / 2 * kTile + v * kLanes;
#if defined(__AVX512F__)
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(15)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
  std::memcpy(&a, &lo, sizeof a);
  std::memcpy(&b, &hi, sizeof b);
#elif defined(__AVX2__)
  const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(15)));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4));
  std::memcpy(&a, &lo, sizeof a);
  std::memcpy(&b, &hi, sizeof b);
#else
  for (int64_t l = 0; l < kLanes; ++l) {
    a[l] = static_cast<float>(p[l] & 15);
    b[l] = static_cast<float>(p[l] >> 4);
  }
#endif
}

// A tile's scale vector v of group g; a null `scales` stands for ones (W8A8's int8 values, whose
// products are summed exactly and scaled after).
inline vfloat tile_scale(const float* scales, int64_t g, int64_t v) {
  return scales != nullptr ? loadv(scales + g * kTile + v * kLanes) : vfloat{} + 1.f;
}

// A tile's zero point vector v of group g, plus the storage's offset (`kNibbles`).
template <typename Q>
inline vfloat tile_zero(const float* zeros, int64_t g, int64_t v) {
  return (zeros != nullptr ? loadv(zeros + g * kTile + v * kLanes) : vfloat{}) + kZeroOffset<Q>;
}

// body(i, v, w) with w = (q - zero) * scale in fp32, the eager path's expansion value for value,
// for vector v of every row i of one tile; within a group and vector, rows come in order.
template <typename Q, typename Body>
inline void for_each_dequantized(const Q* q, const float* scales, const float* zeros, int64_t k,
                                 int64_t group, Body&& body) {
  for (int64_t g = 0; g < k / group; ++g) {
    for (int64_t v = 0; v < kTileVecs; ++v) {
      const vfloat s = tile_scale(scales, g, v);
      const vfloat z = tile_zero<Q>(zeros, g, v);
      const int64_t end = (g + 1) * group;
      int64_t i = g * group;
      for (; i + 2 <= end; i += 2) {
        vfloat a, b;
        widen_rows(q, i, v, a, b);
        body(i, v, (a - z) * s);
        body(i + 1, v, (b - z) * s);
      }
      if constexpr (!kNibbles<Q>) {  // a group of odd length (nibbles' groups are even)
        if (i < end) body(i, v, (widen_row(q, i, v) - z) * s);
      }
    }
  }
}

// One tile's weight dequantized in fp32, written as rows of kTile values (row i at
// dst + i * stride).
template <typename Q>
void expand_tile(float* dst, int64_t stride, const Q* q, const float* scales, const float* zeros,
                 int64_t k, int64_t group) {
  for_each_dequantized(q, scales, zeros, k, group, [&](int64_t i, int64_t v, vfloat w) {
    st(dst + i * stride + v * kLanes, w);
  });
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
// acc[r] += x[r][i] * w for ROWS input rows (row stride k): one step of the micro-kernels. The
// unroll pragma keeps the accumulators in registers.
template <int ROWS>
__attribute__((always_inline)) inline void outer_product_step(vfloat (&acc)[ROWS][kTileVecs],
                                                              const vfloat (&w)[kTileVecs],
                                                              const float* x, int64_t k,
                                                              int64_t i) {
#pragma GCC unroll 12
  for (int r = 0; r < ROWS; ++r) {
    const float xv = x[r * k + i];
    for (int64_t v = 0; v < kTileVecs; ++v) acc[r][v] += xv * w[v];
  }
}

template <int ROWS>
__attribute__((always_inline)) inline void store_sums(float* sums,
                                                      const vfloat (&acc)[ROWS][kTileVecs]) {
  for (int r = 0; r < ROWS; ++r) {
    for (int64_t v = 0; v < kTileVecs; ++v) st(sums + r * kTile + v * kLanes, acc[r][v]);
  }
}

// sums[r][c] = x[r] . panel[:, c] for ROWS input rows (row stride k) and the kTile panel columns.
template <int ROWS>
void panel_block(float* sums, const float* x, int64_t k, const float* panel) {
  vfloat acc[ROWS][kTileVecs] = {};
  for (int64_t i = 0; i < k; ++i) {
    vfloat w[kTileVecs];
    for (int64_t v = 0; v < kTileVecs; ++v) w[v] = loadv(panel + i * kTile + v * kLanes);
    outer_product_step<ROWS>(acc, w, x, k, i);
  }
  store_sums<ROWS>(sums, acc);
}

// panel_block over two adjacent one-vector tiles (AVX-512) at once, into sums0 and sums1: each
// broadcast of x feeds two multiply-adds, and 2 * ROWS of the 32 registers accumulate.
template <int ROWS>
void panel_pair_block(float* sums0, float* sums1, const float* x, int64_t k, const float* p0,
                      const float* p1) {
  vfloat acc0[ROWS] = {}, acc1[ROWS] = {};
  for (int64_t i = 0; i < k; ++i) {
    const vfloat w0 = loadv(p0 + i * kTile), w1 = loadv(p1 + i * kTile);
#pragma GCC unroll 12
    for (int r = 0; r < ROWS; ++r) {
      const float xv = x[r * k + i];
      acc0[r] += xv * w0;
      acc1[r] += xv * w1;
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    st(sums0 + r * kTile, acc0[r]);
    st(sums1 + r * kTile, acc1[r]);
  }
}

// Independent partial sums per group in direct_block: one chain of multiply-adds per output
// vector waits on the FMA's latency at one or two rows; at three or more the rows interleave.
template <int ROWS>
constexpr int kPartialSums = ROWS == 1 ? 4 : ROWS == 2 ? 2 : 1;

// panel_block for a block of up to kDirectRows rows of an input of at most kDirectMaxRows, where
// writing a panel and reading it back costs more than expanding the tile again for each block:
// each weight vector is widened in registers and used at once. Each group's sums of x * q come
// first, the scale and zero point once per group after them, s * (sum x q - z * sum x) with the
// rows' sums of x over the group in `xsum` ([ROWS, groups]; null without a zero point), instead
// of (q - z) * s for every weight: two vector operations fewer per weight vector. Measured on a
// Zen 3 (576 -> 3072, weight in cache): 4 rows 0.16 ms here, 0.31 ms through a panel; at 16 rows
// the two forms are even. With the weights from DRAM at one row, the factored form with its
// partial sums read 7.9 -> 10.4 GB/s (a plain read of the tiles: 11.8).
template <int ROWS, typename Q>
void direct_block(float* sums, const float* x, const float* xsum, int64_t k, const Q* q,
                  const float* scales, const float* zeros, int64_t group) {
  constexpr int kSets = kPartialSums<ROWS>;
  constexpr int kStep = kSets < 2 ? 2 : kSets;  // rows per iteration, read in pairs
  const int64_t groups = k / group;
  vfloat acc[ROWS][kTileVecs] = {};
  for (int64_t g = 0; g < groups; ++g) {
    vfloat part[kSets][ROWS][kTileVecs] = {};
    const int64_t end = (g + 1) * group;
    int64_t i = g * group;
    for (; i + kStep <= end; i += kStep) {
#pragma GCC unroll 4
      for (int u = 0; u < kStep; u += 2) {
        vfloat a[kTileVecs], b[kTileVecs];
        for (int64_t v = 0; v < kTileVecs; ++v) widen_rows(q, i + u, v, a[v], b[v]);
        outer_product_step<ROWS>(part[u % kSets], a, x, k, i + u);
        outer_product_step<ROWS>(part[(u + 1) % kSets], b, x, k, i + u + 1);
      }
    }
    for (; i + 2 <= end; i += 2) {  // a group of a length that kStep does not divide
      vfloat a[kTileVecs], b[kTileVecs];
      for (int64_t v = 0; v < kTileVecs; ++v) widen_rows(q, i, v, a[v], b[v]);
      outer_product_step<ROWS>(part[0], a, x, k, i);
      outer_product_step<ROWS>(part[0], b, x, k, i + 1);
    }
    if constexpr (!kNibbles<Q>) {  // a group of odd length (nibbles' groups are even)
      if (i < end) {
        vfloat w[kTileVecs];
        for (int64_t v = 0; v < kTileVecs; ++v) w[v] = widen_row(q, i, v);
        outer_product_step<ROWS>(part[0], w, x, k, i);
      }
    }
    for (int64_t v = 0; v < kTileVecs; ++v) {
      const vfloat s = tile_scale(scales, g, v);
      const vfloat z = tile_zero<Q>(zeros, g, v);
      for (int r = 0; r < ROWS; ++r) {
        vfloat t = part[0][r][v];
        for (int u = 1; u < kSets; ++u) t += part[u][r][v];
        if (xsum != nullptr) t -= z * xsum[r * groups + g];
        acc[r][v] += t * s;
      }
    }
  }
  store_sums<ROWS>(sums, acc);
}
#pragma GCC pop_options

constexpr int kDirectRows = 4;  // 8 partial sums and 8 accumulators on AVX2
constexpr int64_t kDirectMaxRows = 16;

// body(std::integral_constant<int, count>) for 1 <= count <= ROWS: a block's row count as a
// compile-time constant, so that its accumulators are registers.
template <int ROWS, typename Body>
void with_block_rows(int64_t count, Body&& body) {
  if constexpr (ROWS > 0) {
    if (count == ROWS) {
      body(std::integral_constant<int, ROWS>{});
    } else {
      with_block_rows<ROWS - 1>(count, body);
    }
  }
}

// What a product does to its sums before the bias: W8A8 on CPUs without VNNI sums the int8
// values' products exactly, then scales them per output feature (the weight's scales) and per row
// (the tokens'), in that order, as the unfused `.mul_(weight_scale)` and `scale_rows` did.
struct Epilogue {
  const float* col_scale = nullptr;  // [out_features], or none
  const float* row_scale = nullptr;  // [rows], or none
};

template <typename V>
inline V scaled(V sum, const Epilogue& e, const V& col_scale, int64_t row) {
  if (e.col_scale != nullptr) sum = sum * col_scale;
  if (e.row_scale != nullptr) sum = sum * e.row_scale[row];
  return sum;
}

// Rows [r, r + count) of one tile's output, columns [first, first + cols) of `o` (row stride n),
// from `sums` (kTile per row) through the epilogue plus the bias. A whole tile's columns go a
// vector at a time: one element at a time cost ~5 % of the GEMM at 32-512 rows on a Zen 3 (+4 %
// offline at c=32).
template <typename T, typename B>
void store_tile_rows(T* o, int64_t n, const B* b, int64_t first, int64_t cols, const float* sums,
                     int64_t r, int64_t count, const Epilogue& e) {
  for (int64_t i = 0; i < count; ++i) {
    if (cols == kTile) {
      for (int64_t v = 0; v < kTileVecs; ++v) {
        const int64_t c = first + v * kLanes;
        const vfloat add = b != nullptr ? loadv(b + c) : vfloat{};
        const vfloat col = e.col_scale != nullptr ? loadv(e.col_scale + c) : vfloat{};
        st(o + (r + i) * n + c, scaled(loadv(sums + i * kTile + v * kLanes), e, col, r + i) + add);
      }
      continue;
    }
    for (int64_t c = first; c < first + cols; ++c) {
      const float add = b != nullptr ? ld(b + c) : 0.f;
      const float col = e.col_scale != nullptr ? e.col_scale[c] : 0.f;
      st(o + (r + i) * n + c, scaled(sums[i * kTile + c - first], e, col, r + i) + add);
    }
  }
}

// One tile's output for all `rows` of x (row stride k): every block of kBlockRows rows against
// the tile's fp32 panel [k, kTile].
template <typename T, typename B>
void panel_rows(T* o, int64_t n, const B* b, int64_t first, int64_t cols, const float* xs,
                int64_t rows, int64_t k, const float* panel, const Epilogue& e) {
  float sums[kBlockRows * kTile];
  for (int64_t r = 0; r < rows; r += kBlockRows) {
    const int64_t count = std::min<int64_t>(kBlockRows, rows - r);
    with_block_rows<kBlockRows>(count, [&](auto c) {
      panel_block<decltype(c)::value>(sums, xs + r * k, k, panel);
    });
    store_tile_rows(o, n, b, first, cols, sums, r, count, e);
  }
}

// out_features fill `tiles` tiles, the last one possibly padded.
void check_fits_tiles(int64_t out_features, int64_t tiles) {
  TORCH_CHECK(out_features > 0 && out_features > (tiles - 1) * kTile &&
                  out_features <= tiles * kTile,
              "out_features ", out_features, " does not fit ", tiles, " tiles");
}

// Whether a packed weight is the kernels' tiles of `dtype`, `width` values to a row.
bool tiles_of(const at::Tensor& weight, at::ScalarType dtype, int64_t width) {
  return weight.scalar_type() == dtype && !weight.is_mkldnn() && weight.dim() == 3 &&
         weight.size(2) == width;
}

// A weight in tiles of `dtype` (named `dtype_name` in the message) holding out_features rows.
void check_tiles(const at::Tensor& weight, at::ScalarType dtype, const char* dtype_name,
                 int64_t out_features) {
  TORCH_CHECK(tiles_of(weight, dtype, kTile) && weight.is_contiguous(),
              "weight must be contiguous ", dtype_name, " tiles [tiles, in_features, ", kTile, "]");
  check_fits_tiles(out_features, weight.size(0));
}

// Whether a linear layer has a bias, which must be contiguous [out_features] in x's dtype.
bool has_bias_for(const c10::optional<at::Tensor>& bias, const at::Tensor& x,
                  int64_t out_features) {
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->numel() == out_features &&
                            bias->scalar_type() == x.scalar_type() && bias->is_contiguous()),
              "bias must be contiguous [out] in x's dtype");
  return has_bias;
}

// The in_features of a weight-only weight in tiles: uint8 tiles hold int4 pairs (`kNibbles`).
int64_t tile_in_features(const at::Tensor& weight) {
  return weight.size(1) * (weight.scalar_type() == at::kByte ? 2 : 1);
}

// body(q) with the tiles' values as `const int8_t*` or, for int4 pairs, `const uint8_t*`.
template <typename Body>
void with_tile_values(const at::Tensor& weight, Body&& body) {
  if (weight.scalar_type() == at::kByte) {
    body(weight.data_ptr<uint8_t>());
  } else {
    body(weight.data_ptr<int8_t>());
  }
}

void check_weight_only(const at::Tensor& weight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& zeros, int64_t out_features) {
  const bool nibbles = weight.scalar_type() == at::kByte;
  check_tiles(weight, nibbles ? at::kByte : at::kChar, nibbles ? "uint8 (int4 pairs)" : "int8",
              out_features);
  const int64_t k = tile_in_features(weight);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == weight.size(0) && scales.size(2) == kTile &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(1) > 0 && k % scales.size(1) == 0,
              "scales must be contiguous float32 tiles [tiles, groups, ", kTile,
              "] with groups dividing in_features");
  TORCH_CHECK(!nibbles || (k / scales.size(1)) % 2 == 0,
              "int4 pairs need groups of even length, got ", k / scales.size(1));
  TORCH_CHECK(!zeros.has_value() || !zeros->defined() ||
                  (zeros->sizes() == scales.sizes() && zeros->scalar_type() == at::kFloat &&
                   zeros->is_contiguous()),
              "zero points must be contiguous float32 shaped as scales");
}

// The whole weight expanded to fp32 and transposed, [in_features, tiles * kTile] (the padding
// columns are zero), in one parallel pass: for bf16 inputs of many rows, where one bf16 GEMM on
// the expanded weight beats the panels and the expansion is paid once.
at::Tensor weight_only_expand(const at::Tensor& weight, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& zeros, int64_t out_features) {
  check_weight_only(weight, scales, zeros, out_features);
  const int64_t tiles = weight.size(0), k = tile_in_features(weight), group = k / scales.size(1);
  const int64_t width = tiles * kTile, tile_bytes = weight.size(1) * kTile;
  at::Tensor out = at::empty({k, width}, scales.options());
  const float* z = zeros.has_value() && zeros->defined() ? zeros->data_ptr<float>() : nullptr;
  const int64_t tile_scales = scales.size(1) * kTile;
  float* o = out.data_ptr<float>();
  const float* s = scales.data_ptr<float>();
  with_tile_values(weight, [&](const auto* q) {
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        expand_tile(o + t * kTile, width, q + t * tile_bytes, s + t * tile_scales,
                    z != nullptr ? z + t * tile_scales : nullptr, k, group);
      }
    });
  });
  return out;
}

// o [rows, n] = x's fp32 rows (row stride k) times the tiled int8, int4-pair or bf16 weight
// (scales and zero points per group and tile, or none: `tile_scale`), through the epilogue, plus
// the bias (of type B: the output's, or fp32 for W8A8). The threads split the tiles.
template <typename T, typename B, typename Q>
void tiles_product(T* o, const float* xs, int64_t rows, int64_t k, int64_t n, int64_t tiles,
                   const Q* q, const float* s, const float* z, int64_t group, const B* b,
                   const Epilogue& e) {
  const int64_t groups = k / group, tile_scales = groups * kTile;
  const int64_t tile_values = k / (kNibbles<Q> ? 2 : 1) * kTile;
  const bool direct = rows <= kDirectMaxRows;
  const bool zero_points = z != nullptr || kNibbles<Q>;
  std::vector<float> xsum;  // each row's sum over each group, for the direct blocks' zero points
  if (direct && zero_points) {
    xsum.assign(rows * groups, 0.f);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        float sum = 0.f;
        for (int64_t i = g * group; i < (g + 1) * group; ++i) sum += xs[r * k + i];
        xsum[r * groups + g] = sum;
      }
    }
  }
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(direct ? 0 : k * kTile);
    float sums[kDirectRows * kTile];
    for (int64_t t = begin; t < end; ++t) {
      // a thread's tiles are one contiguous stretch of the weight: fetch the next one
      if (t + 1 < end) prefetch_bytes(q + (t + 1) * tile_values, tile_values * sizeof(Q));
      const Q* q_tile = q + t * tile_values;
      const float* s_tile = s != nullptr ? s + t * tile_scales : nullptr;
      const float* z_tile = z != nullptr ? z + t * tile_scales : nullptr;
      const int64_t first = t * kTile, cols = std::min(kTile, n - first);
      if (!direct) {
        expand_tile(panel.data(), kTile, q_tile, s_tile, z_tile, k, group);
        panel_rows(o, n, b, first, cols, xs, rows, k, panel.data(), e);
        continue;
      }
      for (int64_t r = 0; r < rows; r += kDirectRows) {
        const int64_t count = std::min<int64_t>(kDirectRows, rows - r);
        with_block_rows<kDirectRows>(count, [&](auto c) {
          const float* row_sums = zero_points ? xsum.data() + r * groups : nullptr;
          direct_block<decltype(c)::value>(sums, xs + r * k, row_sums, k, q_tile, s_tile, z_tile,
                                           group);
        });
        store_tile_rows(o, n, b, first, cols, sums, r, count, e);
      }
    }
  });
}

// Whether the CPU multiplies bf16 pairs itself (AVX512-BF16, compiled for with -march=native), so
// that torch's bf16 GEMM and oneDNN's micro-GEMM run natively. Elsewhere torch's bf16 GEMM is
// emulated: measured on a Zen 3 (AVX2), SmolLM2 W4A16's 120 products per step at 33 / 64 / 512 rows
// took 7.2 / 13.8 / 121 s that way, 0.20 / 0.30 / 2.5 s on the panels in fp32, so bf16 inputs stay
// on the panels there.
#if defined(__AVX512BF16__)
constexpr bool kNativeBf16Gemm = true;
#else
constexpr bool kNativeBf16Gemm = false;
#endif

// Whether torch's oneDNN micro-GEMM (brgemm) multiplies bf16 here: on AMX tiles where the CPU has
// them and the kernel grants them to this process (`init_amx` asks first: some VMs report AMX but
// fault on its first instruction without that grant), or on AVX512-BF16's dot product (a Zen 4).
bool bf16_brgemm_usable() {
  static const bool usable = at::cpu::init_amx() || kNativeBf16Gemm;
  return usable;
}

// The brgemm path's blocking, measured on a Sapphire Rapids VM (2 cores, AMX) over SmolLM2's 120
// products per step: 4 tiles (N = 64) beat 2 and 8; 256-row calls took 512 rows in 63 ms against
// 94 ms in 32-row calls (oneDNN's bf16 GEMM on a packed bf16 weight: 58 ms).
constexpr int64_t kBrgemmTiles = 4;
constexpr int64_t kBrgemmRows = 256;  // input rows per brgemm call
// bf16 inputs of more rows than this take the brgemm path where it is usable. Below, the direct
// blocks read the weight faster than any expansion: measured as above, 2 / 4 / 8 / 12 / 16 rows
// 6.2 / 8.4 / 13.7 / 19.1 / 24.2 ms direct against 13.7-14.5 ms through AMX at any of them; on a
// Zen 4 (AVX512-BF16, no AMX) 8 rows 14.8 ms direct, 9 rows 15.9 ms through brgemm.
constexpr int64_t kBrgemmMinRows = 8;

// `count` tiles of a weight-only weight (from tile `q`, scales `s`, zero points `z`, each tile
// `tile_bytes` and `tile_scales` after the last) as bf16 (q - z) * s in brgemm's VNNI layout for
// bf16: [k / 2, count * kTile, 2], value (i, c) at ((i / 2) * N + c) * 2 + i % 2, so that a pair of
// tile rows becomes one 32-bit lane per feature. int4 pairs hold exactly those rows per byte.
template <typename Q>
void expand_vnni(bf16* dst, const Q* q, const float* s, const float* z, int64_t k, int64_t group,
                 int64_t count, int64_t tile_bytes, int64_t tile_scales) {
  const int64_t n = count * kTile;
  for (int64_t j = 0; j < count; ++j) {
    vbits32 even{};  // row i's bf16 bits, held until row i + 1 completes the pair
    for_each_dequantized(q + j * tile_bytes, s + j * tile_scales,
                         z != nullptr ? z + j * tile_scales : nullptr, k, group,
                         [&](int64_t i, int64_t v, vfloat w) {
                           const vbits32 bits = __builtin_convertvector(to_bf16(w), vbits32);
                           if (i % 2 == 0) {
                             even = bits;
                             return;
                           }
                           const vbits32 pair = even | (bits << 16);
                           std::memcpy(dst + ((i / 2) * n + j * kTile + v * kLanes) * 2, &pair,
                                       sizeof pair);
                         });
  }
}

// o [rows, n] = x (bf16) @ dequant(w).T + bias on brgemm (AMX or AVX512-BF16): the threads split
// the weight into blocks of kBrgemmTiles tiles; each block is expanded once into bf16 VNNI form
// (L2-sized: k * 64 * 2 bytes) and multiplied by every kBrgemmRows rows of x in one brgemm call
// (torch's oneDNN micro-GEMM), fp32 sums, then bias and one rounding to bf16. The weight is read
// at its own bit width, never written out whole. Needs an even group length, as int4 pairs do.
void weight_only_brgemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                        const at::Tensor& scales, const float* z, const bf16* bias) {
  const int64_t rows = x.size(0), k = x.size(1), n = out.size(1), tiles = weight.size(0);
  const int64_t group = k / scales.size(1), tile_bytes = weight.size(1) * kTile;
  const int64_t tile_scales = scales.size(1) * kTile;
  const bf16* xs = ptr<bf16>(x);
  bf16* o = ptr<bf16>(out);
  const float* s = scales.data_ptr<float>();
  with_tile_values(weight, [&](const auto* q) {
    const int64_t blocks = (tiles + kBrgemmTiles - 1) / kBrgemmTiles;
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<bf16> panel(k * kBrgemmTiles * kTile);
      std::vector<float> sums(kBrgemmRows * kBrgemmTiles * kTile);
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t t0 = blk * kBrgemmTiles, count = std::min(kBrgemmTiles, tiles - t0);
        const int64_t width = count * kTile, first = t0 * kTile, cols = std::min(width, n - first);
        expand_vnni(panel.data(), q + t0 * tile_bytes, s + t0 * tile_scales,
                    z != nullptr ? z + t0 * tile_scales : nullptr, k, group, count, tile_bytes,
                    tile_scales);
        for (int64_t r = 0; r < rows; r += kBrgemmRows) {
          const int64_t m = std::min(kBrgemmRows, rows - r);
          at::native::cpublas::brgemm(
              m, width, k, k, width, width, false,
              reinterpret_cast<const at::BFloat16*>(xs + r * k),
              reinterpret_cast<const at::BFloat16*>(panel.data()), sums.data());
          for (int64_t i = 0; i < m; ++i) {
            const float* row = sums.data() + i * width;
            bf16* dst = o + (r + i) * n + first;
            for_lanes(cols, [&](int64_t c, auto lane) {
              using V = decltype(lane);
              const V add = bias != nullptr ? load<V>(bias + first + c) : V{};
              st(dst + c, load<V>(row + c) + add);
            });
          }
        }
      }
      at::native::cpublas::brgemm_release();
    });
  });
}

// Whether weight_only_linear takes x to brgemm: bf16 rows enough to gain, groups of even length
// (asked before the operands are checked, so it reads their shapes with care).
bool brgemm_takes(const at::Tensor& x, const at::Tensor& scales) {
  return x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(0) > kBrgemmMinRows &&
         scales.dim() == 3 && scales.size(1) > 0 && (x.size(1) / scales.size(1)) % 2 == 0 &&
         bf16_brgemm_usable();
}

at::Tensor weight_only_linear(const at::Tensor& x, const at::Tensor& weight,
                              const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                              const c10::optional<at::Tensor>& bias, int64_t out_features) {
  check_rows(x, "x");
  check_weight_only(weight, scales, zeros, out_features);
  const int64_t rows = x.size(0), k = x.size(1), n = out_features;
  TORCH_CHECK(tile_in_features(weight) == k, "x and weight disagree on in_features");
  const bool has_zeros = zeros.has_value() && zeros->defined();
  const bool has_bias = has_bias_for(bias, x, n);
  at::Tensor out = at::empty({rows, n}, x.options());
  if (brgemm_takes(x, scales)) {
    weight_only_brgemm(out, x.contiguous(), weight, scales,
                       has_zeros ? zeros->data_ptr<float>() : nullptr,
                       has_bias ? ptr<bf16>(*bias) : nullptr);
    return out;
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  dispatch(x, "weight_only_linear", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    with_tile_values(weight, [&](const auto* q) {
      tiles_product(ptr<T>(out), xf.data_ptr<float>(), rows, k, n, weight.size(0), q,
                    scales.data_ptr<float>(), has_zeros ? zeros->data_ptr<float>() : nullptr,
                    k / scales.size(1), has_bias ? ptr<T>(*bias) : nullptr, Epilogue{});
    });
  });
  return out;
}

// x @ weight.T + bias for a bf16 weight in tiles: the weight read at 2 bytes, widened in
// registers (direct blocks) or into an fp32 panel per tile, fp32 sums, then the bias and one
// rounding to x's dtype. For bf16 x on CPUs whose bf16 GEMM is emulated, as a bf16 GEMM with fp32
// accumulation computes it: measured on a Zen 3 (AVX2), SmolLM2 served in bf16 at concurrency 8,
// 13.6 output tok/s on torch's bf16 GEMM, 56.5 here (fp32 weights on the tiles: 57.9). For fp32
// x, an fp32 weight whose values are all bf16 (a 16-bit checkpoint served in fp32): the same
// products in fp32 from half the bytes.
at::Tensor dense_bf16_linear(const at::Tensor& x, const at::Tensor& weight, bool has_bias,
                             const c10::optional<at::Tensor>& bias, int64_t n) {
  const int64_t rows = x.size(0), k = x.size(1);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({rows, n}, x.options());
  dispatch(x, "dense_linear", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    tiles_product(ptr<T>(out), xf.data_ptr<float>(), rows, k, n, weight.size(0),
                  ptr<bf16>(weight), nullptr, nullptr, k, has_bias ? ptr<T>(*bias) : nullptr,
                  Epilogue{});
  });
  return out;
}

// out = block sums of x against a weight in tiles of `tile_elems` values each, through the
// epilogue plus the bias, for the kernels whose block takes two adjacent tiles at once (VNNI
// tiles, bf16 pair tiles): `block(rows, tiles, sums, x, w)` with both counts as integral
// constants. The threads split pairs of tiles; each pair is read once per block of kBlockRows
// rows, from L1 or L2 after the first.
template <typename T, typename B, typename X, typename W, typename Block>
void tile_pairs_product(T* o, int64_t n, const B* bias, const X* xs, int64_t rows, int64_t k,
                        const W* weights, int64_t tiles, int64_t tile_elems, const Epilogue& e,
                        Block&& block) {
  at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    float buffers[2][kBlockRows * kTile];
    float* sums[2] = {buffers[0], buffers[1]};
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t t0 = 2 * pair, count_tiles = std::min<int64_t>(2, tiles - t0);
      const W* const w[2] = {weights + t0 * tile_elems,
                             weights + (t0 + count_tiles - 1) * tile_elems};
      for (int64_t r = 0; r < rows; r += kBlockRows) {
        const int64_t count = std::min<int64_t>(kBlockRows, rows - r);
        with_block_rows<kBlockRows>(count, [&](auto c) {
          if (count_tiles == 2) {
            block(c, std::integral_constant<int, 2>{}, sums, xs + r * k, w);
          } else {
            block(c, std::integral_constant<int, 1>{}, sums, xs + r * k, w);
          }
        });
        for (int64_t t = 0; t < count_tiles; ++t) {
          const int64_t first = (t0 + t) * kTile;
          store_tile_rows(o, n, bias, first, std::min(kTile, n - first), sums[t], r, count, e);
        }
      }
    }
  });
}

// bf16 weights for AVX512-BF16's dot product (`vdpbf16ps`), laid out by
// cpu_kernels.tiled_bf16_pairs: [tiles, in_features / 2, 2 * kTile] bf16, each tile's two
// consecutive input features of its kTile output features side by side in one 64-byte vector,
// the order the instruction sums them in: 32 multiply-adds per instruction, where widening the
// weight to fp32 does 16. oneDNN's bf16 GEMM uses the same instruction here; these tiles read
// the weight faster at decode sizes (`linear.bf16_pair_tiles_serve`).
constexpr int64_t kPairGroup = 2;
bool bf16_pair_tiles(const at::Tensor& weight) {
  return tiles_of(weight, at::kBFloat16, kPairGroup * kTile);
}

#if defined(__AVX512BF16__)
constexpr bool kBf16Pairs = true;

// fp32 sums of ROWS bf16 input rows (row stride k) against TILES (1 or 2) adjacent tiles into
// sums[t] (kTile per row): each step broadcasts two inputs of a row and adds their products with
// one vector of each tile.
template <int ROWS, int TILES>
void bf16_pair_block(float* (&sums)[2], const bf16* x, int64_t k, const bf16* const (&w)[2]) {
  vfloat acc0[ROWS] = {}, acc1[ROWS] = {};
  const int64_t steps = k / kPairGroup;
  for (int64_t i = 0; i < steps; ++i) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w[0] + i * kPairGroup * kTile);
    const __m512bh w1 =
        TILES == 2 ? (__m512bh)_mm512_loadu_si512(w[1] + i * kPairGroup * kTile) : w0;
#pragma GCC unroll 12
    for (int r = 0; r < ROWS; ++r) {
      int32_t two;
      std::memcpy(&two, x + r * k + i * kPairGroup, sizeof two);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(two);
      acc0[r] = (vfloat)_mm512_dpbf16_ps((__m512)acc0[r], xv, w0);
      if constexpr (TILES == 2) acc1[r] = (vfloat)_mm512_dpbf16_ps((__m512)acc1[r], xv, w1);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < ROWS; ++r) {
    st(sums[0] + r * kTile, acc0[r]);
    if constexpr (TILES == 2) st(sums[1] + r * kTile, acc1[r]);
  }
}
#else
constexpr bool kBf16Pairs = false;
#endif

// x @ weight.T + bias for bf16 x and a bf16 weight in pair tiles (`bf16_pair_tiles`): fp32 sums,
// then the bias and one rounding to bf16.
at::Tensor bf16_pair_linear(const at::Tensor& x, const at::Tensor& weight, bool has_bias,
                            const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(kBf16Pairs, "a weight in bf16 pair tiles needs the kernels built for AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "a weight in bf16 pair tiles takes bf16 x");
  const int64_t rows = x.size(0), k = x.size(1), tiles = weight.size(0);
  TORCH_CHECK(weight.is_contiguous() && weight.size(1) * kPairGroup == k, "the tiles hold ",
              weight.size(1) * kPairGroup, " input features, x has ", k);
  check_fits_tiles(n, tiles);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({rows, n}, x.options());
#if defined(__AVX512BF16__)
  tile_pairs_product(ptr<bf16>(out), n, has_bias ? ptr<bf16>(*bias) : nullptr, ptr<bf16>(xc), rows,
                     k, ptr<bf16>(weight), tiles, k * kTile, Epilogue{},
                     [&](auto c, auto t, auto& sums, auto x, auto& w) {
                       bf16_pair_block<decltype(c)::value, decltype(t)::value>(sums, x, k, w);
                     });
#endif
  return out;
}

// x @ weight.T + bias for an fp32 weight laid out in tiles ([tiles, in_features, kTile]), which
// are the panels themselves. Measured on a Zen 3 against oneDNN's GEMM on its packed weight, the
// weights from DRAM as in serving: 1.3-2x at 1-16 rows (1 row: 23 against 14 GB/s), 1-1.5x at
// 32-64, even at 160, 0.8-0.9x at 512. bf16 tiles go to `dense_bf16_linear`.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias, int64_t out_features) {
  check_rows(x, "x");
  const bool bf16_input = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.scalar_type() == at::kFloat || bf16_input,
              "dense_linear takes float32 or bfloat16 inputs");
  if (bf16_pair_tiles(weight)) {
    return bf16_pair_linear(x, weight, has_bias_for(bias, x, out_features), bias, out_features);
  }
  const bool bf16_tiles = bf16_input || weight.scalar_type() == at::kBFloat16;
  check_tiles(weight, bf16_tiles ? at::kBFloat16 : at::kFloat,
              bf16_tiles ? "bfloat16" : "float32", out_features);
  const int64_t rows = x.size(0), k = x.size(1), n = out_features;
  TORCH_CHECK(weight.size(1) == k, "x and weight disagree on in_features");
  const bool has_bias = has_bias_for(bias, x, n);
  if (bf16_tiles) return dense_bf16_linear(x, weight, has_bias, bias, n);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* xs = xc.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* b = has_bias ? bias->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  const int64_t tiles = weight.size(0);
  if constexpr (kTileVecs == 1) {  // pairs of tiles, the last one alone if their count is odd
    at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t begin, int64_t end) {
      float sums[2][kBlockRows * kTile];
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t t = 2 * pair, first = t * kTile;
        if (t + 1 == tiles) {
          panel_rows(o, n, b, first, std::min(kTile, n - first), xs, rows, k,
                     w + t * k * kTile, Epilogue{});
          continue;
        }
        for (int64_t r = 0; r < rows; r += kBlockRows) {
          const int64_t count = std::min<int64_t>(kBlockRows, rows - r);
          with_block_rows<kBlockRows>(count, [&](auto c) {
            panel_pair_block<decltype(c)::value>(sums[0], sums[1], xs + r * k, k,
                                                 w + t * k * kTile, w + (t + 1) * k * kTile);
          });
          store_tile_rows(o, n, b, first, kTile, sums[0], r, count, Epilogue{});
          store_tile_rows(o, n, b, first + kTile, std::min(kTile, n - first - kTile), sums[1], r,
                          count, Epilogue{});
        }
      }
    });
    return out;
  }
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = t * kTile;
      panel_rows(o, n, b, first, std::min(kTile, n - first), xs, rows, k, w + t * k * kTile,
                 Epilogue{});
    }
  });
  return out;
}

// bf16 inputs of more than this many rows whose groups brgemm cannot take (odd lengths) go to
// weight_only_expand and one bf16 GEMM where that GEMM is native (kNativeBf16Gemm).
constexpr int64_t kWoFusedMaxRows = 32;

// x @ dequant(w).T + bias by whichever of the forms above suits x. bf16 inputs of more than
// kBrgemmMinRows rows go to brgemm where it is usable. SmolLM2 W4A16's 120 products per step, ms,
// through the direct blocks, panels or expansion -> brgemm: on a Sapphire Rapids VM (AMX), 16 /
// 32 / 64 / 512 rows 24.2 / 34.8 / 69.5 / 100.1 -> 14.8 / 15.8 / 18.1 / 66.4; on a Zen 4
// (AVX512-BF16), 16 / 32 / 64 / 128 / 512 rows 22.9 / 42.6 / 87.4 / 111.9 / 340.6 -> 20.0 / 29.4 /
// 46.0 / 79.4 / 287.1; level with bf16 weights on oneDNN on both. fp32 inputs stay on the panels
// at any row count: measured on a Zen 3 with the weights from DRAM, 1.1-2.6x faster than expand +
// fp32 GEMM from 33 to 2048 rows (2048 x 576 -> 3072: 54 against 58 ms), and a step that mixes
// prefill and decode rows no longer expands every weight.
at::Tensor weight_only_product(const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                               const c10::optional<at::Tensor>& bias, int64_t out_features) {
  if (x.scalar_type() == at::kFloat || !kNativeBf16Gemm || x.size(0) <= kWoFusedMaxRows ||
      brgemm_takes(x, scales)) {
    return weight_only_linear(x, weight, scales, zeros, bias, out_features);
  }
  const at::Tensor expanded =
      weight_only_expand(weight, scales, zeros, out_features).narrow(1, 0, out_features);
  const at::Tensor w = expanded.to(x.scalar_type());
  return bias.has_value() && bias->defined() ? at::addmm(*bias, x, w) : at::mm(x, w);
}

// Whether a packed W8A8 weight holds its int8 values in the weight-only kernels' tiles: on a CPU
// without VNNI, where oneDNN's int8 GEMM saturates (Int8Linear.pack_for_cpu). Its products are
// then taken in fp32 over the int8 values, read at one byte per weight with unit scales; exact,
// as the sums are integers below 2^24. Its input is the activations' int8 values as floats.
bool values_in_tiles(const at::Tensor& packed_weight) {
  return tiles_of(packed_weight, at::kChar, kTile);
}

// W8A8 weights for AVX512-VNNI's u8 x s8 dot products (`vpdpbusd`), laid out by
// cpu_kernels.tiled_vnni: [tiles, in_features / 4 + 1, 4 * kTile] int8, each tile's four
// consecutive input features of its kTile output features in one 64-byte vector (the order the
// instruction sums them in), then one vector of the tile's compensations, 128 * sum(w) per
// output feature as int32: the input goes in as q + 128 (uint8), and sum((q + 128) * w) -
// 128 * sum(w) is the exact int32 sum(q * w).
constexpr int64_t kVnniGroup = 4;
bool vnni_tiles(const at::Tensor& packed_weight) {
  return tiles_of(packed_weight, at::kChar, kVnniGroup * kTile);
}

#if defined(__AVX512VNNI__)
constexpr bool kVnni = true;

// int32 sums of ROWS uint8 input rows (row stride k) against TILES (1 or 2) adjacent VNNI tiles,
// less the tiles' compensations, as floats into sums[t] (kTile per row). Each step broadcasts
// four input bytes of a row and adds their products with one vector of each tile: 64
// multiply-adds per instruction where the fp32 panels do 16.
template <int ROWS, int TILES>
void vnni_block(float* (&sums)[2], const uint8_t* x, int64_t k, const int8_t* const (&w)[2]) {
  // GCC's own vector type: arrays of __m512i stay on the stack, spilled at every step
  vint acc0[ROWS] = {}, acc1[ROWS] = {};
  const int64_t steps = k / kVnniGroup;
  for (int64_t i = 0; i < steps; ++i) {
    const __m512i w0 = _mm512_loadu_si512(w[0] + i * kVnniGroup * kTile);
    const __m512i w1 = TILES == 2 ? _mm512_loadu_si512(w[1] + i * kVnniGroup * kTile) : w0;
#pragma GCC unroll 12
    for (int r = 0; r < ROWS; ++r) {
      int32_t four;
      std::memcpy(&four, x + r * k + i * kVnniGroup, sizeof four);
      const __m512i xv = _mm512_set1_epi32(four);
      acc0[r] = reinterpret_cast<vint>(
          _mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc0[r]), xv, w0));
      if constexpr (TILES == 2) {
        acc1[r] = reinterpret_cast<vint>(
            _mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc1[r]), xv, w1));
      }
    }
  }
  const int64_t end = steps * kVnniGroup * kTile;  // the compensations follow the values
  const vint comp0 = reinterpret_cast<vint>(_mm512_loadu_si512(w[0] + end));
  const vint comp1 = reinterpret_cast<vint>(_mm512_loadu_si512(w[1] + end));
#pragma GCC unroll 12
  for (int r = 0; r < ROWS; ++r) {
    st(sums[0] + r * kTile, __builtin_convertvector(acc0[r] - comp0, vfloat));
    if constexpr (TILES == 2) {
      st(sums[1] + r * kTile, __builtin_convertvector(acc1[r] - comp1, vfloat));
    }
  }
}
#else
constexpr bool kVnni = false;
#endif

// out = (q @ w.T) * weight_scale [* row_scales] [+ bias] for a W8A8 weight in VNNI tiles, q the
// activations' int8 values + 128 in uint8: the same epilogue, in the same order, as the fp32
// panels' (`tiles_int8_product`).
void vnni_int8_product(at::Tensor& out, const at::Tensor& q, const at::Tensor& packed_weight,
                       const at::Tensor& weight_scale, const float* row_scales,
                       const float* bias) {
  TORCH_CHECK(kVnni, "a W8A8 weight in VNNI tiles needs the kernels built for AVX512-VNNI");
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous(),
              "q must be contiguous uint8 (the int8 values + 128)");
  const int64_t rows = q.size(0), k = q.size(1), n = out.size(1), tiles = packed_weight.size(0);
  TORCH_CHECK(k % kVnniGroup == 0 && packed_weight.size(1) == k / kVnniGroup + 1,
              "the VNNI tiles hold ", (packed_weight.size(1) - 1) * kVnniGroup,
              " input features, q has ", k);
  check_fits_tiles(n, tiles);
#if defined(__AVX512VNNI__)
  const int64_t tile_bytes = packed_weight.size(1) * kVnniGroup * kTile;
  const Epilogue e{weight_scale.data_ptr<float>(), row_scales};
  dispatch(out, "int8_linear", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    tile_pairs_product(ptr<T>(out), n, bias, q.data_ptr<uint8_t>(), rows, k,
                       packed_weight.data_ptr<int8_t>(), tiles, tile_bytes, e,
                       [&](auto c, auto t, auto& sums, auto x, auto& w) {
                         vnni_block<decltype(c)::value, decltype(t)::value>(sums, x, k, w);
                       });
  });
#endif
}

// out = (q @ w.T) * weight_scale [* row_scales] [+ bias] for a weight whose int8 values are in
// tiles (`values_in_tiles`), q the activations' int8 values as floats: the scales and the bias go
// in the tiles' epilogue, rounded once to out's dtype.
void tiles_int8_product(at::Tensor& out, const at::Tensor& q, const at::Tensor& packed_weight,
                        const at::Tensor& weight_scale, const float* row_scales,
                        const float* bias) {
  const int64_t rows = q.size(0), k = q.size(1), n = out.size(1);
  dispatch(out, "int8_linear", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    tiles_product(ptr<T>(out), q.data_ptr<float>(), rows, k, n, packed_weight.size(0),
                  packed_weight.data_ptr<int8_t>(), nullptr, nullptr, k, bias,
                  Epilogue{weight_scale.data_ptr<float>(), row_scales});
  });
}

// x quantized per token: its int8 values (as floats for a weight in the fp32 panels' tiles, + 128
// in uint8 for oneDNN's GEMM and the VNNI tiles) and their scales.
std::pair<at::Tensor, at::Tensor> quantized(const at::Tensor& x, bool as_floats) {
  const int64_t rows = x.size(0);
  const at::ScalarType type = as_floats ? at::kFloat : at::kByte;
  at::Tensor q = at::empty({rows, x.size(1)}, x.options().dtype(type));
  at::Tensor scales = at::empty({rows}, x.options().dtype(at::kFloat));
  if (as_floats) {
    quantize_rows(q.data_ptr<float>(), scales.data_ptr<float>(), x);
  } else {
    quantize_rows(q.data_ptr<uint8_t>(), scales.data_ptr<float>(), x);
  }
  return {q, scales};
}

// (q @ w.T) * weight_scale in fp32: oneDNN's int8 GEMM on a packed int8 weight, q in uint8 with
// zero point 128 (oneDNN's VNNI kernels multiply u8 by s8; an s8 input left AMX-less CPUs on its
// reference GEMM, measured on a Zen 4 at 0.1 GOP/s against 300 for u8 at 32 rows); the tiles'
// product with the weight scales in its epilogue (`values_in_tiles`, or `vnni_tiles` with q in
// uint8 as for oneDNN); or, where the layer was packed without the kernels, products over an fp32
// copy of the values, oneDNN's GEMM on a packed one or torch's on a plain one.
at::Tensor int8_product(const at::Tensor& q, const at::Tensor& packed_weight,
                        const at::Tensor& weight_scale, const at::Tensor& zero_points) {
  if (values_in_tiles(packed_weight)) {
    at::Tensor out = at::empty({q.size(0), weight_scale.numel()}, q.options());
    tiles_int8_product(out, q, packed_weight, weight_scale, nullptr, nullptr);
    return out;
  }
  if (vnni_tiles(packed_weight)) {
    at::Tensor out = at::empty({q.size(0), weight_scale.numel()}, q.options().dtype(at::kFloat));
    vnni_int8_product(out, q, packed_weight, weight_scale, nullptr, nullptr);
    return out;
  }
  TORCH_CHECK(q.scalar_type() == at::kByte, "q must hold the int8 values + 128 in uint8");
  if (packed_weight.scalar_type() == at::kFloat) {
    static const c10::OperatorHandle linear =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    const at::Tensor values = q.to(at::kFloat).sub_(128);
    if (!packed_weight.is_mkldnn()) return at::mm(values, packed_weight.t()).mul_(weight_scale);
    torch::jit::Stack stack{values, packed_weight, c10::IValue(), "none",
                            c10::List<c10::optional<at::Scalar>>(), ""};
    linear.callBoxed(&stack);
    return stack.back().toTensor().mul_(weight_scale);
  }
  static const c10::OperatorHandle qlinear =
      c10::Dispatcher::singleton().findSchemaOrThrow("onednn::qlinear_pointwise", "");
  torch::jit::Stack stack{q,      1.0,     int64_t{128}, packed_weight,     weight_scale,
                          zero_points, c10::IValue(), 1.0, int64_t{0}, at::ScalarType::Float,
                          "none", c10::List<c10::optional<at::Scalar>>(), ""};
  qlinear.callBoxed(&stack);
  return stack.back().toTensor();
}

// out = int8_product(q) * row_scales + bias, rounded once to out's dtype (`scale_rows`); for a
// weight in tiles all inside the product's epilogue, with the same roundings in the same order.
void scaled_int8_product(at::Tensor& out, const at::Tensor& q, const at::Tensor& packed_weight,
                         const at::Tensor& weight_scale, const at::Tensor& zero_points,
                         const at::Tensor& row_scales, const c10::optional<at::Tensor>& bias) {
  if (!values_in_tiles(packed_weight) && !vnni_tiles(packed_weight)) {
    scale_rows(out, int8_product(q, packed_weight, weight_scale, zero_points), row_scales, bias);
    return;
  }
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || bias->scalar_type() == at::kFloat, "bias must be float32");
  const float* b = has_bias ? bias->data_ptr<float>() : nullptr;
  if (vnni_tiles(packed_weight)) {
    vnni_int8_product(out, q, packed_weight, weight_scale, row_scales.data_ptr<float>(), b);
  } else {
    tiles_int8_product(out, q, packed_weight, weight_scale, row_scales.data_ptr<float>(), b);
  }
}

// The whole W8A8 layer in one op: quantize per token, the int8 product with the per-channel
// weight scales applied in fp32, then the per-token scale and bias. At decode sizes the three
// steps take ~10 us each; as three Python-level calls the dispatch and allocation around them
// cost about as much again.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed_weight,
                       const at::Tensor& weight_scale, const at::Tensor& zero_points,
                       const c10::optional<at::Tensor>& bias) {
  check_rows(x, "x");
  const auto [q, scales] = quantized(x, values_in_tiles(packed_weight));
  at::Tensor out = at::empty({x.size(0), weight_scale.numel()}, x.options());
  scaled_int8_product(out, q, packed_weight, weight_scale, zero_points, scales, bias);
  return out;
}

// gate_up's epilogue, the activation and down's quantization in one pass per row: the fp32
// product [gate | up] times the row's scale, rounded to T as the unfused layer's output is,
// silu(gate) * up with the roundings of `silu_and_mul`, then quantized per token (into D: the
// int8 values + 128 in uint8, or as floats). Bit for bit the unfused sequence, without its two
// full-size intermediate tensors.
template <typename T, typename D>
void silu_and_mul_quantize(D* out, float* scale, const at::Tensor& product,
                           const at::Tensor& row_scales) {
  const int64_t rows = product.size(0), n = product.size(1) / 2;
  const float* in = product.data_ptr<float>();
  const float* rs = row_scales.data_ptr<float>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> act(n);
    float* __restrict__ a = act.data();
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict__ g = in + r * 2 * n;
      const float s = rs[r];
      for_lanes(n, [&](int64_t i, auto lane) {
        using V = decltype(lane);
        const V gate = rnd<T>(load<V>(g + i) * s), up = rnd<T>(load<V>(g + n + i) * s);
        st(a + i, rnd<T>(rnd<T>(silu(gate)) * up));
      });
      scale[r] = quantize_row(out + r * n, a, n);
    }
  });
}

// A gated MLP whose two projections are packed W8A8 layers without a gate_up bias (the Llama
// family): down(silu(gate) * up) with one quantization and one epilogue pass fewer than two
// `int8_linear` calls around `silu_and_mul`, and the same result.
at::Tensor int8_gated_mlp(const at::Tensor& x, const at::Tensor& gate_up_weight,
                          const at::Tensor& gate_up_scale, const at::Tensor& gate_up_zero_points,
                          const at::Tensor& down_weight, const at::Tensor& down_scale,
                          const at::Tensor& down_zero_points,
                          const c10::optional<at::Tensor>& down_bias) {
  check_rows(x, "x");
  const bool as_floats = values_in_tiles(gate_up_weight);
  TORCH_CHECK(values_in_tiles(down_weight) == as_floats, "gate_up and down are packed alike");
  const auto [q, scales] = quantized(x, as_floats);
  const at::Tensor gate_up = int8_product(q, gate_up_weight, gate_up_scale, gate_up_zero_points);
  const int64_t rows = x.size(0), n = gate_up.size(1) / 2;
  at::Tensor act_q = at::empty({rows, n}, x.options().dtype(as_floats ? at::kFloat : at::kByte));
  at::Tensor act_scales = at::empty({rows}, x.options().dtype(at::kFloat));
  dispatch(x, "int8_gated_mlp", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (as_floats) {
      silu_and_mul_quantize<T>(act_q.data_ptr<float>(), act_scales.data_ptr<float>(), gate_up,
                               scales);
    } else {
      silu_and_mul_quantize<T>(act_q.data_ptr<uint8_t>(), act_scales.data_ptr<float>(), gate_up,
                               scales);
    }
  });
  at::Tensor out = at::empty({rows, down_scale.numel()}, x.options());
  scaled_int8_product(out, act_q, down_weight, down_scale, down_zero_points, act_scales,
                      down_bias);
  return out;
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

// The bits of an e4m3 value r already on e4m3's grid (round_to_e4m3 of a clamped value).
inline e4m3 e4m3_of(float r) {
  const uint32_t u = bit_cast<uint32_t>(r), sign = (u >> 24) & 0x80u;
  const float a = std::fabs(r);
  if (a != a) return e4m3{static_cast<uint8_t>(sign | 0x7fu)};
  const uint32_t magnitude = a < 0.015625f ? static_cast<uint32_t>(a * 512.f)  // subnormal
                                           : (((u >> 23) & 0xffu) - 120u) << 3 | ((u >> 20) & 7u);
  return e4m3{static_cast<uint8_t>(sign | magnitude)};
}

// x as a cache of element type C stores it; x itself becomes the value the cache holds. fp8
// saturates at +-448 (torch's cast would make NaN of anything beyond).
template <typename C, typename T>
inline C cached(T& x) {
  if constexpr (std::is_same_v<C, T>) {
    return x;
  } else if constexpr (std::is_same_v<C, e4m3>) {
    const float r = saturated_e4m3(ld(&x));
    st(&x, r);
    return e4m3_of(r);
  } else {
    C c;
    st(&c, ld(&x));
    st(&x, ld(&c));
    return c;
  }
}

// Writes the new tokens' K and V into their cache slots: K into the token-minor K block layout
// ([blocks, kv_heads, head_dim, block_size], one strided store per element), V row by row. One
// call per layer instead of an index_put_ and an index_copy_. Where the cache is narrower than k
// and v (kv_cache_dtype), they are rounded to it, and k and v are overwritten with the values it
// now holds: this step's prefill attention then sees what later steps will read.
void write_kv(at::Tensor& k_cache, at::Tensor& v_cache, at::Tensor& k, at::Tensor& v,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3, "k and v must be [tokens, kv_heads, head_dim]");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == k.size(2) &&
                  v.stride(1) == v.size(2),
              "each token's k and v heads must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "k and v, and the two caches, must share a dtype");
  const int64_t tokens = k.size(0), row = k.size(1) * k.size(2), block_size = k_cache.size(3);
  const int64_t dim = k.size(2), kv_heads = k.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  dispatch(k, "write_kv", [&](auto* k_tag) {
    dispatch_cache(k_cache, "write_kv's cache", [&](auto* cache_tag) {
      using T = std::remove_pointer_t<decltype(k_tag)>;
      using C = std::remove_pointer_t<decltype(cache_tag)>;
      T* ks = ptr<T>(k);
      T* vs = ptr<T>(v);
      C* kc = ptr<C>(k_cache);
      C* vc = ptr<C>(v_cache);
      const int64_t k_stride = k.stride(0), v_stride = v.stride(0);
      at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
          T* v_src = vs + t * v_stride;
          C* v_dst = vc + slots[t] * row;
          for (int64_t i = 0; i < row; ++i) v_dst[i] = cached<C>(v_src[i]);
          T* src = ks + t * k_stride;
          C* dst = kc + block * row * block_size + offset;
          for (int64_t h = 0; h < kv_heads; ++h) {
            for (int64_t d = 0; d < dim; ++d) {
              dst[(h * dim + d) * block_size] = cached<C>(src[h * dim + d]);
            }
          }
        }
      });
    });
  });
}

// out = x widened from a cache's element type (bf16 or e4m3) to out's (float or bf16): the context
// that a prefill chunk or a prefix-cache hit gathers for SDPA. torch casts fp8 one element at a
// time (2-2.5 ns each here): 1.5 s of a 1024-token-prompt run against 0.09 s here.
void widen_kv(at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(out.is_contiguous() && x.is_contiguous() && out.numel() == x.numel(),
              "out and x must be contiguous and hold as many values");
  const int64_t n = x.numel();
  constexpr int64_t kChunk = 4096;
  dispatch(out, "widen_kv", [&](auto* out_tag) {
    dispatch_cache(x, "widen_kv's input", [&](auto* in_tag) {
      using T = std::remove_pointer_t<decltype(out_tag)>;
      using C = std::remove_pointer_t<decltype(in_tag)>;
      const C* in = ptr<C>(x);
      T* o = ptr<T>(out);
      at::parallel_for(0, (n + kChunk - 1) / kChunk, 1, [&](int64_t begin, int64_t end) {
        for (int64_t c = begin; c < end; ++c) {
          const int64_t first = c * kChunk;
          for_lanes(std::min(kChunk, n - first), [&](int64_t i, auto lane) {
            using V = decltype(lane);
            st(o + first + i, load<V>(in + first + i) * kUnscale<C>);
          });
        }
      });
    });
  });
}

// Causal attention of a step's queries over the paged cache, reading K and V where they lie: K
// blocks are [kv_heads, head_dim, block_size] (token-minor, so q.K for 16 tokens of a block is a
// broadcast multiply-add into one vector with no horizontal sums), V blocks are [block_size,
// kv_heads, head_dim]. Sequence s's queries are the rows query_starts[s] .. query_starts[s+1]-1
// of q, the last of them at position seq_lens[s]-1: a decode is one row, a prefill chunk many,
// each seeing the keys up to its own position. torch's CPU flash attention ran SmolLM2's prefills
// at 30-70 GFLOP/s here (causal half counted), and a chunk after cached context needed that
// context gathered out of the cache and a mask. head_dim and block_size are multiples of 16
// (the Python side checks). The multiply-adds are fused (`fmadd`): attention's summation order
// differs from SDPA's anyway, and the fused form is both faster and closer to the exact result.

constexpr int64_t kMaxHeadsPerPass = 4;  // query heads sharing one pass over K and V
// Query rows (positions x heads) sharing one pass: their score accumulators stay in registers
// next to the K vectors (AVX-512: 12 + 1 + 1 of 32; AVX2: 2 x 6 + 2 + 1 of 16).
constexpr int kRowsPerPass = kLanes == 16 ? 12 : 6;
constexpr int positions_per_pass(int heads) { return std::max(1, kRowsPerPass / heads); }
// Vectors of keys (q.K) and of output lanes (p.V) that each broadcast of a query or weight feeds.
// AVX2 takes two, 2 x 6 accumulators of its 16 registers: with one, a multiply-add cost a
// broadcast load besides its own vector load, and the loads bound a 512-token chunk at ~45
// GFLOP/s, slower than torch's SDPA there (Zen 3). Head sizes and block sizes are multiples of
// 16, two AVX2 vectors. AVX-512 keeps one, the form measured on a Zen 4; two are not measured.
constexpr int kVectorsPerPass = kLanes == 16 ? 1 : 2;

// T: the dtype of q and out; C: the cache's (float, bf16 or e4m3).
template <typename T, typename C>
struct AttentionArgs {
  const T* q;
  const C* k;
  const C* v;
  T* out;
  const int32_t* tables;
  const int32_t* seq_lens;
  const int32_t* query_starts;  // null: one query per sequence, row s
  int64_t q_row, q_head, out_row, out_head, table_width;
  int64_t kv_heads, block_size, dim, padded;
  float scale;

  int64_t first_row(int64_t s) const { return query_starts ? query_starts[s] : s; }
  int64_t last_row(int64_t s) const { return query_starts ? query_starts[s + 1] - 1 : s; }
};

// NP consecutive query rows of sequence s from `first_row` (rows past the sequence's last repeat
// it and are not stored) times NG query heads from first_head, all of KV head kvh: each K and V
// vector is loaded once for all NP * NG rows, whose independent sums hide the multiply-add
// latency. A row's arithmetic is the same in any pass (rows past its length see zero weights),
// so a token's attention does not depend on how its step was chunked.
template <typename T, typename C, int NG, int NP>
void attend(const AttentionArgs<T, C>& a, int64_t s, int64_t kvh, int64_t first_head,
            int64_t first_row, float* qf, float* scores) {
  constexpr int R = NG * NP;
  const int64_t dim = a.dim, bs = a.block_size, v_row = a.kv_heads * dim;
  const int64_t last = a.last_row(s);
  int64_t row[NP], len[NP];
  for (int p = 0; p < NP; ++p) {
    row[p] = std::min(first_row + p, last);
    len[p] = a.seq_lens[s] - (last - row[p]);
  }
  const int64_t span = len[NP - 1], blocks = (span + bs - 1) / bs;
  const int32_t* table = a.tables + s * a.table_width;
  vfloat lane;
  for (int64_t l = 0; l < kLanes; ++l) lane[l] = static_cast<float>(l);
  const vfloat minus_inf = vfloat{} - INFINITY;
  for (int p = 0; p < NP; ++p) {
    for (int g = 0; g < NG; ++g) {
      const T* src = a.q + row[p] * a.q_row + (first_head + g) * a.q_head;
      float* dst = qf + (p * NG + g) * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] = ld(src + d) * (a.scale * kUnscale<C>);
    }
  }
  vfloat top[R];
  for (int r = 0; r < R; ++r) top[r] = minus_inf;
  for (int64_t j = 0; j < blocks; ++j) {
    const C* kt = a.k + (table[j] * a.kv_heads + kvh) * dim * bs;
    if (j + 1 < blocks) {  // blocks are scattered: fetch the next one's K and V while this one runs
      prefetch_bytes(a.k + (table[j + 1] * a.kv_heads + kvh) * dim * bs, dim * bs * sizeof(C));
      const C* vn = a.v + table[j + 1] * bs * v_row + kvh * dim;
      for (int64_t t = 0; t < bs; ++t) prefetch_bytes(vn + t * v_row, dim * sizeof(C));
    }
    for (int64_t c = 0; c < bs; c += kVectorsPerPass * kLanes) {
      vfloat sc[kVectorsPerPass][R] = {};
      for (int64_t d = 0; d < dim; ++d) {
        vfloat k[kVectorsPerPass];
        for (int u = 0; u < kVectorsPerPass; ++u) k[u] = loadv(kt + d * bs + c + u * kLanes);
        for (int r = 0; r < R; ++r) {
          const vfloat qv = vfloat{} + qf[r * dim + d];
          for (int u = 0; u < kVectorsPerPass; ++u) sc[u][r] = fmadd(qv, k[u], sc[u][r]);
        }
      }
      for (int u = 0; u < kVectorsPerPass; ++u) {
        const int64_t first = j * bs + c + u * kLanes;
        for (int p = 0; p < NP; ++p) {
          for (int g = 0; g < NG; ++g) {
            const int r = p * NG + g;
            const vfloat masked =
                lane < static_cast<float>(len[p] - first) ? sc[u][r] : minus_inf;
            std::memcpy(scores + r * a.padded + first, &masked, sizeof masked);
            top[r] = top[r] > masked ? top[r] : masked;
          }
        }
      }
    }
  }
  float inv[R];
  for (int r = 0; r < R; ++r) {
    float m = top[r][0];
    for (int64_t l = 1; l < kLanes; ++l) m = std::max(m, top[r][l]);
    float* sr = scores + r * a.padded;
    const int64_t n = len[r / NG];
    // whole vectors (the rows are padded to blocks), so that no compiler choice of peeling or
    // unrolling orders the sum: a row's weights are the same bits in every pass
    vfloat sums{};
    for (int64_t t = 0; t < n; t += kLanes) {
      const vfloat e = fast_exp(loadv(sr + t) - m);
      const vfloat kept = lane < static_cast<float>(n - t) ? e : vfloat{};
      st(sr + t, kept);
      sums += kept;
    }
    std::fill(sr + n, sr + span, 0.f);
    float total = 0.f;
    for (int64_t l = 0; l < kLanes; ++l) total += sums[l];
    inv[r] = kUnscale<C> / total;
  }
  // kVectorsPerPass vectors of output lanes at a time over the whole context, and every V cache
  // line still read once
  for (int64_t c = 0; c < dim; c += kVectorsPerPass * kLanes) {
    vfloat acc[kVectorsPerPass][R] = {};
    for (int64_t j = 0; j < blocks; ++j) {
      const C* vb = a.v + table[j] * bs * v_row + kvh * dim + c;
      const int64_t first = j * bs, valid = std::min(bs, span - first);
      for (int64_t t = 0; t < valid; ++t) {
        vfloat v[kVectorsPerPass];
        for (int u = 0; u < kVectorsPerPass; ++u) v[u] = loadv(vb + t * v_row + u * kLanes);
        for (int r = 0; r < R; ++r) {
          const vfloat w = vfloat{} + scores[r * a.padded + first + t];
          for (int u = 0; u < kVectorsPerPass; ++u) acc[u][r] = fmadd(w, v[u], acc[u][r]);
        }
      }
    }
    for (int p = 0; p < NP && first_row + p <= last; ++p) {
      for (int g = 0; g < NG; ++g) {
        for (int u = 0; u < kVectorsPerPass; ++u) {
          st(a.out + row[p] * a.out_row + (first_head + g) * a.out_head + c + u * kLanes,
             acc[u][p * NG + g] * inv[p * NG + g]);
        }
      }
    }
  }
}

// kRowsPerPass positions of sequence s from first_row (one for a decode), every query head of KV
// group kvh: heads in passes of at most 4, positions in passes as many as fit beside them.
template <typename T, typename C, int NG>
void attend_heads(const AttentionArgs<T, C>& a, int64_t s, int64_t kvh, int64_t first_head,
                  int64_t first_row, float* qf, float* scores) {
  constexpr int NP = positions_per_pass(NG);
  const int64_t end = std::min(first_row + kRowsPerPass, a.last_row(s) + 1);
  if (end - first_row == 1) {
    return attend<T, C, NG, 1>(a, s, kvh, first_head, first_row, qf, scores);
  }
  for (int64_t r = first_row; r < end; r += NP) {
    attend<T, C, NG, NP>(a, s, kvh, first_head, r, qf, scores);
  }
}

template <typename T, typename C>
void attend_group(const AttentionArgs<T, C>& a, int64_t s, int64_t kvh, int64_t group,
                  int64_t first_row, float* qf, float* scores) {
  for (int64_t h = 0; h < group; h += kMaxHeadsPerPass) {
    const int64_t first = kvh * group + h;
    switch (std::min<int64_t>(kMaxHeadsPerPass, group - h)) {
      case 1: attend_heads<T, C, 1>(a, s, kvh, first, first_row, qf, scores); break;
      case 2: attend_heads<T, C, 2>(a, s, kvh, first, first_row, qf, scores); break;
      case 3: attend_heads<T, C, 3>(a, s, kvh, first, first_row, qf, scores); break;
      default: attend_heads<T, C, 4>(a, s, kvh, first, first_row, qf, scores);
    }
  }
}

// One unit of work: kRowsPerPass query positions of a sequence (or its one decode row) against
// one KV head. A prefill chunk's last units read the most keys.
struct AttentionItem {
  int64_t seq, kv_head, first_row, cost;
};

// The step's items in order (sequence, positions, KV head), cut into one contiguous range per
// thread of about equal cost: parallel_for's equal counts would hand one thread a chunk's early,
// short units and the other its long ones. Ranges keep a sequence's heads together, which read
// neighbouring lines of the same V rows (dealing items out one by one cost 20-60 % of a decode
// step here).
template <typename T, typename C>
void paged_attention_impl(const AttentionArgs<T, C>& a, int64_t seqs, int64_t group) {
  std::vector<AttentionItem> items;
  int64_t total = 0;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t last = a.last_row(s);
    for (int64_t r = a.first_row(s); r <= last; r += kRowsPerPass) {
      const int64_t rows = std::min<int64_t>(kRowsPerPass, last + 1 - r);
      const int64_t cost = rows * group * (a.seq_lens[s] - (last - (r + rows - 1)));
      for (int64_t h = 0; h < a.kv_heads; ++h) items.push_back({s, h, r, cost});
      total += cost * a.kv_heads;
    }
  }
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items.size());
  std::vector<size_t> bounds(threads + 1, items.size());
  bounds[0] = 0;
  int64_t done = 0;
  for (size_t i = 0, t = 1; i < items.size() && t < static_cast<size_t>(threads); ++i) {
    done += items[i].cost;
    if (done * threads >= total * static_cast<int64_t>(t)) bounds[t++] = i + 1;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(kRowsPerPass * a.dim), scores(kRowsPerPass * a.padded);
    for (int64_t t = begin; t < end; ++t) {
      for (size_t i = bounds[t]; i < bounds[t + 1]; ++i) {
        const AttentionItem& it = items[i];
        attend_group(a, it.seq, it.kv_head, group, it.first_row, qf.data(), scores.data());
      }
    }
  });
}

// k_cache: [blocks, kv_heads, head_dim, block_size]; v_cache: [blocks, block_size, kv_heads,
// head_dim], in q's dtype, bf16 or fp8 e4m3; block_tables: [seqs, width] int32; seq_lens: [seqs]
// int32; query_starts: [seqs + 1] int32, or None for one query per sequence.
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const std::optional<at::Tensor>& query_starts,
                     double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [tokens, heads, head_dim]");
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1, "out must be [tokens, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "caches must be 4-D");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out and q dtypes differ");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "K and V caches' dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables must be contiguous int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "seq_lens must be contiguous int32");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.size(3) % 16 == 0 && q.size(2) % 16 == 0 && q.size(2) <= 256,
              "block size and head size must be multiples of 16, head size at most 256");
  const int64_t seqs = seq_lens.size(0), dim = q.size(2), block_size = k_cache.size(3);
  const int32_t* lengths = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = nullptr;
  if (query_starts.has_value()) {
    TORCH_CHECK(query_starts->scalar_type() == at::kInt && query_starts->is_contiguous() &&
                    query_starts->numel() == seqs + 1,
                "query_starts must be contiguous int32 with one more entry than seq_lens");
    starts = query_starts->data_ptr<int32_t>();
  }
  int64_t longest = 0;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t rows = starts ? starts[s + 1] - starts[s] : 1;
    TORCH_CHECK(rows >= 1 && lengths[s] >= rows, "sequence ", s, " has ", rows,
                " queries but ", lengths[s], " tokens");
    longest = std::max<int64_t>(longest, lengths[s]);
  }
  TORCH_CHECK((starts ? starts[seqs] : seqs) <= q.size(0), "more query rows than q holds");
  TORCH_CHECK((longest + block_size - 1) / block_size <= block_tables.size(1),
              "block_tables are narrower than the longest sequence");
  const int64_t group = q.size(1) / k_cache.size(1);
  const auto attend_cached = [&](auto* q_tag, auto* cache_tag) {
    using T = std::remove_pointer_t<decltype(q_tag)>;
    using C = std::remove_pointer_t<decltype(cache_tag)>;
    const AttentionArgs<T, C> a{ptr<T>(q), ptr<C>(k_cache), ptr<C>(v_cache), ptr<T>(out),
                                block_tables.data_ptr<int32_t>(), lengths, starts,
                                q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                                block_tables.size(1), k_cache.size(1), block_size, dim,
                                (longest + block_size - 1) / block_size * block_size,
                                static_cast<float>(scale)};
    paged_attention_impl(a, seqs, group);
  };
  dispatch(q, "paged_attention", [&](auto* q_tag) {
    dispatch_cache(k_cache, "paged_attention's cache",
                   [&](auto* cache_tag) { attend_cached(q_tag, cache_tag); });
  });
}

}  // namespace

TORCH_LIBRARY(qpipe_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, int heads, "
        "int head_dim) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("quantize_per_token_int8(Tensor(a!) q, Tensor(b!) scales, Tensor x) -> ()");
  m.def("fake_quantize_fp8(Tensor(a!) out, Tensor x, Tensor? scale) -> ()");
  // every backend: the packed weight is an MkldnnCPU tensor, which outranks CPU in dispatch
  m.def("int8_linear(Tensor x, Tensor packed_weight, Tensor weight_scale, Tensor zero_points, "
        "Tensor? bias) -> Tensor",
        int8_linear);
  m.def("int8_gated_mlp(Tensor x, Tensor gate_up_weight, Tensor gate_up_scale, "
        "Tensor gate_up_zero_points, Tensor down_weight, Tensor down_scale, "
        "Tensor down_zero_points, Tensor? down_bias) -> Tensor",
        int8_gated_mlp);
  m.def("weight_only_linear(Tensor x, Tensor weight, Tensor scales, Tensor? zeros, "
        "Tensor? bias, int out_features) -> Tensor");
  m.def("dense_linear(Tensor x, Tensor weight, Tensor? bias, int out_features) -> Tensor");
  m.def("weight_only_expand(Tensor weight, Tensor scales, Tensor? zeros, int out_features) "
        "-> Tensor");
  m.def("weight_only_product(Tensor x, Tensor weight, Tensor scales, Tensor? zeros, "
        "Tensor? bias, int out_features) -> Tensor");
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k, Tensor(d!) v, "
        "Tensor slot_mapping) -> ()");
  m.def("widen_kv(Tensor(a!) out, Tensor x) -> ()");
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor? query_starts, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(qpipe_cpu, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("fused_add_rms_norm", fused_add_rms_norm);
  m.impl("rotary", rotary);
  m.impl("silu_and_mul", silu_and_mul);
  m.impl("quantize_per_token_int8", quantize_per_token_int8);
  m.impl("fake_quantize_fp8", fake_quantize_fp8);
  m.impl("weight_only_linear", weight_only_linear);
  m.impl("dense_linear", dense_linear);
  m.impl("weight_only_expand", weight_only_expand);
  m.impl("weight_only_product", weight_only_product);
  m.impl("write_kv", write_kv);
  m.impl("widen_kv", widen_kv);
  m.impl("paged_attention", paged_attention);
}
