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
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "fp8.h"
#include "ops.h"
#include "tensor_args.h"
#include "vec.h"

namespace qpipe_cpu {
namespace {

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
constexpr int64_t kPrefetchBlocks = 2;  // see attend

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
  const vfloat minus_inf = splat(-INFINITY);
  for (int p = 0; p < NP; ++p) {
    for (int g = 0; g < NG; ++g) {
      const T* src = a.q + row[p] * a.q_row + (first_head + g) * a.q_head;
      float* dst = qf + (p * NG + g) * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] = ld(src + d) * (a.scale * kUnscale<C>);
    }
  }
  vfloat top[R];
  for (int r = 0; r < R; ++r) top[r] = minus_inf;
  // Line i of a block's K (i < k_lines) from its start `k`, of its V (i < v_lines) from `v`.
  constexpr int64_t kLine = 64;
  const int64_t k_lines = dim * bs * static_cast<int64_t>(sizeof(C)) / kLine;
  const int64_t token_lines = (dim * static_cast<int64_t>(sizeof(C)) + kLine - 1) / kLine;
  const int64_t v_lines = bs * token_lines, v_row_bytes = v_row * static_cast<int64_t>(sizeof(C));
  // block j's K (dim x bs) and its first V row, for this KV head
  const auto k_block = [&](int64_t j) { return a.k + (table[j] * a.kv_heads + kvh) * dim * bs; };
  const auto v_block = [&](int64_t j) { return a.v + table[j] * bs * v_row + kvh * dim; };
  const auto bytes = [](const C* p) { return reinterpret_cast<const char*>(p); };
  const auto v_line = [&](const char* v, int64_t i) {
    return v + i / token_lines * v_row_bytes + i % token_lines * kLine;
  };
  // The blocks are scattered and come from DRAM (a step's caches outgrow L3), so K and V are
  // fetched kPrefetchBlocks blocks ahead, the first ones before the loop, into L2 (hint 1):
  // fetches into L1 wait on its few miss buffers. SmolLM2's decode step at c=32 (30 layers, 160
  // tokens; Zen 4) over fp32 / bf16 / fp8 caches: the next block into L1 14.2 / 8.4 / 5.3 ms,
  // this 8.9 / 4.7 / 4.3; at 1,000 tokens 91 / 51 / 36 against 57 / 32 / 26. The hint is most of
  // it (one block ahead into L2: 10.0 / 5.2 / 4.4); the next item's first blocks were slower.
  for (int64_t j = 0; j < std::min(kPrefetchBlocks, blocks); ++j) {
    const char *k = bytes(k_block(j)), *v = bytes(v_block(j));
    for (int64_t i = 0; i < k_lines; ++i) __builtin_prefetch(k + i * kLine, 0, 1);
    for (int64_t i = 0; i < v_lines; ++i) __builtin_prefetch(v_line(v, i), 0, 1);
  }
  for (int64_t j = 0; j < blocks; ++j) {
    const C* kt = k_block(j);
    // block j + kPrefetchBlocks, its lines spread over this block's scores
    const bool ahead = j + kPrefetchBlocks < blocks;
    const char* k_ahead = bytes(k_block(ahead ? j + kPrefetchBlocks : j));
    const char* v_ahead = bytes(v_block(ahead ? j + kPrefetchBlocks : j));
    for (int64_t c = 0; c < bs; c += kVectorsPerPass * kLanes) {
      vfloat sc[kVectorsPerPass][R] = {};
      for (int64_t d = 0; d < dim; ++d) {
        // line i of each: the block's steps (dim per pass over its keys) outnumber its lines
        const int64_t i = c / (kVectorsPerPass * kLanes) * dim + d;
        if (ahead && i < k_lines) __builtin_prefetch(k_ahead + i * kLine, 0, 1);
        if (ahead && i < v_lines) __builtin_prefetch(v_line(v_ahead, i), 0, 1);
        vfloat k[kVectorsPerPass];
        for (int u = 0; u < kVectorsPerPass; ++u) k[u] = loadv(kt + d * bs + c + u * kLanes);
        for (int r = 0; r < R; ++r) {
          const vfloat qv = splat(qf[r * dim + d]);
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
      const C* vb = v_block(j) + c;
      const int64_t first = j * bs, valid = std::min(bs, span - first);
      for (int64_t t = 0; t < valid; ++t) {
        vfloat v[kVectorsPerPass];
        for (int u = 0; u < kVectorsPerPass; ++u) v[u] = loadv(vb + t * v_row + u * kLanes);
        for (int r = 0; r < R; ++r) {
          const vfloat w = splat(scores[r * a.padded + first + t]);
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

}  // namespace

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

}  // namespace qpipe_cpu
