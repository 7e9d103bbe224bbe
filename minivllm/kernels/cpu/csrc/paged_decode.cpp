// Paged decode attention for CPU (cpu_ops.h says why).

#include "cpu_ops.h"

namespace {

// --- paged decode attention (layers/torch_attention.py: paged_decode_attention; Triton: kernels/triton/paged_decode.py)

// One work item per (sequence, KV head): the GROUP query heads sharing that KV head read each key and value row
// once, straight from the paged cache (no gather, no cast of the cache). Two passes over the context: the
// scores (q . k * scale, fp32), their softmax, then the weighted sum of the values.
template <typename T, int HEAD_DIM>  // HEAD_DIM: 64, 128 or 256 known at compile time (faster loops), else 0
void decode_heads(const T* qp, const T* kp, const T* vp, const int32_t* lens, const int32_t* tables, int64_t B,
                  int64_t H, int64_t Hkv, int64_t head_dim, int64_t BS, int64_t M, float scale, T* op) {
  const int64_t G = H / Hkv, D = HEAD_DIM ? HEAD_DIM : head_dim;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(G * D), acc(G * D), inv(G), any_row(HEAD_DIM ? 0 : D), scores;
    alignas(64) float fixed_row[HEAD_DIM ? HEAD_DIM : 1];
    float* row = HEAD_DIM ? fixed_row : any_row.data();  // one key or value row in fp32
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv, L = lens[b];
      to_float(qp + (b * H + h * G) * D, q.data(), G * D);
      for (auto& x : q) x *= scale;
      scores.resize(G * L);  // scores[g * L + j]
      for (int64_t start = 0; start < L; start += BS) {  // one block of the table at a time
        const int64_t base = static_cast<int64_t>(tables[b * M + start / BS]) * BS, n = std::min(BS, L - start);
        for (int64_t t = 0; t < n; ++t) {
          to_float(kp + ((base + t) * Hkv + h) * D, row, D);
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = q.data() + g * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * row[d];
            scores[g * L + start + t] = dot;
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {  // softmax over the context: scores -> unnormalized weights
        float* s = scores.data() + g * L;
        float mx = -INFINITY, sum = 0.f;
        for (int64_t j = 0; j < L; ++j) mx = std::max(mx, s[j]);
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < L; ++j) sum += (s[j] = exp_fast(s[j] - mx));
        inv[g] = L > 0 ? 1.f / sum : 0.f;  // an empty context: zeros
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < L; start += BS) {
        const int64_t base = static_cast<int64_t>(tables[b * M + start / BS]) * BS, n = std::min(BS, L - start);
        for (int64_t t = 0; t < n; ++t) {
          to_float(vp + ((base + t) * Hkv + h) * D, row, D);
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * L + start + t];
            float* a = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * row[d];
          }
        }
      }
      T* o = op + (b * H + h * G) * D;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) st(o + g * D + d, acc[g * D + d] * inv[g]);
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& context_lens, const at::Tensor& block_tables, double scale) {
  TORCH_CHECK_VALUE(q.dim() == 3 && q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                        k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && q.size(2) == k_cache.size(3) &&
                        q.size(1) % k_cache.size(2) == 0,
                    "paged_decode: q must be contiguous (batch, heads, head_dim), the caches contiguous (num_blocks, "
                    "block_size, kv_heads, head_dim) with that head_dim and a divisor of the heads");
  TORCH_CHECK_VALUE(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
                    "paged_decode: q and the caches must have one dtype");
  TORCH_CHECK_VALUE(context_lens.scalar_type() == at::kInt && block_tables.scalar_type() == at::kInt &&
                        block_tables.dim() == 2 && context_lens.numel() == q.size(0) &&
                        block_tables.size(0) == q.size(0),
                    "paged_decode: context_lens (batch,) and block_tables (batch, max_blocks) must be int32");
  const at::Tensor lens = context_lens.contiguous(), tables = block_tables.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), NB = k_cache.size(0), BS = k_cache.size(1);
  const int64_t Hkv = k_cache.size(2), M = tables.size(1);
  const int32_t *lp = lens.data_ptr<int32_t>(), *tp = tables.data_ptr<int32_t>();
  // every block a context uses is in the cache: the torch path's check_tables, with its messages
  int64_t lo = 0, hi = 0;
  bool any = false;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(lp[b] >= 0 && lp[b] <= M * BS, "paged_decode: a context of ", lp[b],
                      " tokens is longer than the block table covers (", M, " blocks x ", BS, ")");
    for (int64_t i = 0; i < (lp[b] + BS - 1) / BS; ++i) {
      const int64_t block = tp[b * M + i];
      lo = any ? std::min(lo, block) : block, hi = any ? std::max(hi, block) : block, any = true;
    }
  }
  TORCH_CHECK_VALUE(!any || (lo >= 0 && hi < NB), "paged_decode: block table points outside the cache: blocks ", lo,
                    "..", hi, ", cache has ", NB);
  at::Tensor out = at::empty(q.sizes(), q.options());
  dispatch(q, "paged_decode", [&](auto tag) {
    using T = decltype(tag);
    auto args = std::make_tuple(q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), lp, tp, B, H, Hkv, D,
                                BS, M, static_cast<float>(scale), out.data_ptr<T>());
    if (D == 64) std::apply(decode_heads<T, 64>, args);
    else if (D == 128) std::apply(decode_heads<T, 128>, args);
    else if (D == 256) std::apply(decode_heads<T, 256>, args);
    else std::apply(decode_heads<T, 0>, args);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(minivllm, CPU, m) { m.impl("paged_decode", &paged_decode); }
