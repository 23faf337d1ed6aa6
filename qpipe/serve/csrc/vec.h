// Values and vectors of them, shared by every kernel of qpipe's CPU engine: bf16 bits and their
// rounding, kLanes-float vectors of the CPU's own width, fused multiply-adds, exp and SiLU.
//
// The kernels are built at first use by qpipe/serve/layers/cpu_kernels.py with -O3
// -march=native: loops are written so that GCC vectorizes them (contiguous inner loops, `omp simd`
// reductions, no calls). -ffp-contract=off keeps fp32 results equal to torch's unfused
// multiply-then-add; where a kernel wants one rounding it says so with `fmadd`.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace qpipe_cpu {

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

// x in every lane. `vfloat{} + x` says the same but is an addition to zero that GCC must keep
// (-0 + 0 is +0): a scalar add and a register broadcast per use, where the micro-kernels want one
// broadcast from memory (measured on a Zen 3, fp32 tiles at 192 rows: 3.5-4.1 ms that way,
// 2.3-2.5 ms with this; attention's prefills 15-30 % faster).
inline vfloat splat(float x) {
#if defined(__AVX512F__)
  return reinterpret_cast<vfloat>(_mm512_set1_ps(x));
#elif defined(__AVX__)
  return reinterpret_cast<vfloat>(_mm256_set1_ps(x));
#else
  vfloat v;
  for (int64_t l = 0; l < kLanes; ++l) v[l] = x;
  return v;
#endif
}

// a * b + c rounded once, written out rather than left to the compiler's contraction: GCC 12's
// `#pragma GCC optimize("fp-contract=fast")` does not reach lambdas, so a function of such a region
// inlined into one lost its fused multiply-adds and gave other bits than its out-of-line copies.
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
  x = x < lo ? splat(lo) : x;
  return x > hi ? splat(hi) : x;
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

// Asks for the cache lines of [p, p + bytes) ahead of their use: a thread's next weight tile,
// which lies elsewhere in memory.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

// For a loop that reads a weight stream 64 bytes a step: asks for the line 2 KiB past p into L2
// (hint 1), so each line is asked for once, 32 steps before its load. The pair tiles' products
// stream their weights from DRAM at decode sizes, two streams a thread, which the hardware's
// prefetchers do not follow across 4 KiB pages. SmolLM2's 120 products, weights from DRAM (Zen
// 4; four alternations at 1 and 8 rows, two at 32): W8A8 1 / 8 / 32 rows 5.0-5.8 / 6.6-7.1 /
// 13.2 ms -> 4.6-4.7 / 5.6-5.8 / 12.1-12.2, bf16 7.5-8.0 / 8.9-10.0 / 20.8-21.0 -> 6.4-7.1 /
// 8.0-8.1 / 19.2-19.6, fp32 at 32 rows 37.9-39.8 -> 36.4-36.7; 512 rows level. 4 KiB ahead was
// level with 2; 1 or 8 KiB, or hint 3 (into L1), gained less.
inline void fetch_stream_ahead(const void* p) {
  __builtin_prefetch(static_cast<const char*>(p) + 2048, 0, 1);
}

}  // namespace qpipe_cpu
