// The paged KV cache's writes and widening reads, in its element type (the model's, bf16 or fp8
// e4m3).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "fp8.h"
#include "ops.h"
#include "tensor_args.h"
#include "vec.h"

namespace qpipe_cpu {
namespace {

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

}  // namespace

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

}  // namespace qpipe_cpu
