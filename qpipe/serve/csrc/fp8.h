// fp8 e4m3 values as qpipe's CPU kernels read and write them: loads, rounding, saturation and
// the stored bits (an fp8 KV cache, fp8 weights' fake quantization).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace qpipe_cpu {

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

// The bits of an e4m3 value r already on e4m3's grid (round_to_e4m3 of a clamped value).
inline e4m3 e4m3_of(float r) {
  const uint32_t u = bit_cast<uint32_t>(r), sign = (u >> 24) & 0x80u;
  const float a = std::fabs(r);
  if (a != a) return e4m3{static_cast<uint8_t>(sign | 0x7fu)};
  const uint32_t magnitude = a < 0.015625f ? static_cast<uint32_t>(a * 512.f)  // subnormal
                                           : (((u >> 23) & 0xffu) - 120u) << 3 | ((u >> 20) & 7u);
  return e4m3{static_cast<uint8_t>(sign | magnitude)};
}

}  // namespace qpipe_cpu
