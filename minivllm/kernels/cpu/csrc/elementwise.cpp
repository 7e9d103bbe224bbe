// RMSNorm (plain and with the residual add), RoPE, SiLU-mul and the KV-cache store for CPU (cpu_ops.h says why),
// and the library's operator schemas.

#include "cpu_ops.h"

namespace {

// --- RMSNorm (layers/layernorm.py: rms_norm, RMSNorm.add_rms_forward) ----------------------------------------

// One row of H values x (already fp32, the residual added): out = round(round(x / rms(x)) * w), as rms_norm does
// in torch (the variance in fp32, the normalized value cast to the dtype before the weight multiplies).
template <typename T>
inline void norm_row(const float* x, const T* w, int64_t H, float eps, T* out) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) st(out + i, round_to<T>(x[i] * inv) * ld(w + i));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm", "x");
  TORCH_CHECK_VALUE(x.is_contiguous() && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
                    "rms_norm: x and weight must be contiguous, of one dtype");
  const int64_t H = x.size(-1), N = x.numel() / std::max<int64_t>(H, 1);
  TORCH_CHECK_VALUE(weight.numel() == H, "rms_norm: weight has ", weight.numel(), " values for rows of ", H);
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(H);
      for (int64_t r = begin; r < end; ++r) {
        to_float(xp + r * H, row.data(), H);
        norm_row(row.data(), wp, H, static_cast<float>(eps), op + r * H);
      }
    });
  });
  return out;
}

// (norm(x + residual), x + residual): the add in fp32, the new residual its rounding to the dtype, the norm
// over the unrounded sum.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm", "x");
  TORCH_CHECK_VALUE(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous() &&
                        residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                        weight.scalar_type() == x.scalar_type(),
                    "add_rms_norm: x, residual (same shape) and weight must be contiguous, of one dtype");
  const int64_t H = x.size(-1), N = x.numel() / std::max<int64_t>(H, 1);
  TORCH_CHECK_VALUE(weight.numel() == H, "add_rms_norm: weight has ", weight.numel(), " values for rows of ", H);
  at::Tensor out = at::empty(x.sizes(), x.options()), res_out = at::empty(x.sizes(), x.options());
  dispatch(x, "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T *xp = x.data_ptr<T>(), *rp = residual.data_ptr<T>(), *wp = weight.data_ptr<T>();
    T *op = out.data_ptr<T>(), *ro = res_out.data_ptr<T>();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(H), res(H);
      for (int64_t r = begin; r < end; ++r) {
        to_float(xp + r * H, row.data(), H);
        to_float(rp + r * H, res.data(), H);
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) {
          row[i] += res[i];
          st(ro + r * H + i, row[i]);
        }
        norm_row(row.data(), wp, H, static_cast<float>(eps), op + r * H);
      }
    });
  });
  return {out, res_out};
}

// --- RoPE, neox half-split style (layers/rotary_embedding.py: apply_rotary_emb) ------------------------------

// x (N, heads, D) with any token and head stride -> a new contiguous (N, heads, D): dims i and i + D/2 of each
// head rotated by the angle of the token's position; cos_sin_cache (max_pos, 1, D) fp32, cos then sin.
template <typename T>
void rotate(const at::Tensor& x, const int64_t* pos, const float* cs, int64_t D, at::Tensor& out) {
  const int64_t N = x.size(0), heads = x.size(1), half = D / 2, sn = x.stride(0), sh = x.stride(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* c = cs + pos[n] * D;  // cos: c[0, half), sin: c[half, D)
      for (int64_t h = 0; h < heads; ++h) {
        const T* in = xp + n * sn + h * sh;
        T* o = op + (n * heads + h) * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = ld(in + i), x2 = ld(in + i + half), cos = c[i], sin = c[half + i];
          st(o + i, x1 * cos - x2 * sin);
          st(o + i + half, x2 * cos + x1 * sin);
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                                          const at::Tensor& cos_sin_cache) {
  TORCH_CHECK_VALUE(query.dim() == 3 && key.dim() == 3 && query.stride(2) == 1 && key.stride(2) == 1 &&
                        query.size(0) == key.size(0) && query.size(2) == key.size(2) &&
                        query.scalar_type() == key.scalar_type(),
                    "rotary: query and key must be (tokens, heads, head_dim) of one dtype, head_dim contiguous");
  const int64_t D = query.size(2), N = query.size(0);
  TORCH_CHECK_VALUE(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous() &&
                        cos_sin_cache.size(-1) == D && D % 2 == 0,
                    "rotary: cos_sin_cache must be contiguous fp32 (max_pos, 1, head_dim) for head_dim ", D);
  at::Tensor pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK_VALUE(pos.numel() == N, "rotary: ", pos.numel(), " positions for ", N, " tokens");
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t max_pos = cos_sin_cache.size(0);
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK_VALUE(pp[n] >= 0 && pp[n] < max_pos, "rotary: position ", pp[n], " outside the table's ", max_pos);
  at::Tensor q_out = at::empty({N, query.size(1), D}, query.options());
  at::Tensor k_out = at::empty({N, key.size(1), D}, key.options());
  dispatch(query, "rotary", [&](auto tag) {
    using T = decltype(tag);
    rotate<T>(query, pp, cos_sin_cache.data_ptr<float>(), D, q_out);
    rotate<T>(key, pp, cos_sin_cache.data_ptr<float>(), D, k_out);
  });
  return {q_out, k_out};
}

// --- SiLU-mul (layers/activation.py: SiluAndMul.silu_and_mul) ------------------------------------------------

// x (N, 2I) -> (N, I): round(round(silu(gate)) * up), silu in fp32 as F.silu computes it for low precisions
// (its e^-g from exp_fast: within an ulp or two of torch's in fp32, the same value after rounding to bf16 nearly
// always).
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul", "x");
  TORCH_CHECK_VALUE(x.is_contiguous() && x.size(-1) % 2 == 0, "silu_and_mul: x must be contiguous (..., 2I)");
  const int64_t I = x.size(-1) / 2, N = x.numel() / std::max<int64_t>(2 * I, 1);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, x.options());
  dispatch(x, "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, N, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T *gate = xp + r * 2 * I, *up = gate + I;
        T* o = op + r * I;
#pragma omp simd
        for (int64_t i = 0; i < I; ++i) {
          const float g = ld(gate + i);
          st(o + i, round_to<T>(g / (1.f + exp_fast(-g))) * ld(up + i));
        }
      }
    });
  });
  return out;
}

// --- the KV-cache store (layers/attention.py: store_kvcache_torch) -------------------------------------------

// key/value (N, Hkv, D), any token and head stride; the caches (num_blocks, block_size, Hkv, D) contiguous;
// token i goes to cache row slot_mapping[i] (-1: written nowhere).
void store_kvcache(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
                   const at::Tensor& slot_mapping) {
  TORCH_CHECK_VALUE(key.dim() == 3 && value.sizes() == key.sizes() && key.stride(2) == 1 && value.stride(2) == 1,
                    "store_kvcache: key and value must be (tokens, kv_heads, head_dim), head_dim contiguous");
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                        v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == key.size(1) &&
                        k_cache.size(3) == key.size(2),
                    "store_kvcache: the caches must be contiguous (num_blocks, block_size, kv_heads, head_dim) with "
                    "the key's heads and head_dim");
  TORCH_CHECK_VALUE(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == v_cache.scalar_type(),
                    "store_kvcache: key/value dtype must be the cache's");
  const int64_t N = key.size(0), Hkv = key.size(1), D = key.size(2), rows = k_cache.size(0) * k_cache.size(1);
  at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK_VALUE(slots.numel() == N, "store_kvcache: ", slots.numel(), " slots for ", N, " tokens");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK_VALUE(sp[i] < rows, "store_kvcache: slot ", sp[i], " outside the cache's ", rows, " rows");
  const int64_t es = key.element_size(), bytes = D * es;
  char *kc = static_cast<char*>(k_cache.data_ptr()), *vc = static_cast<char*>(v_cache.data_ptr());
  const char *kp = static_cast<const char*>(key.data_ptr()), *vp = static_cast<const char*>(value.data_ptr());
  for (int64_t i = 0; i < N; ++i) {
    if (sp[i] < 0) continue;
    for (int64_t h = 0; h < Hkv; ++h) {
      std::memcpy(kc + (sp[i] * Hkv + h) * bytes, kp + (i * key.stride(0) + h * key.stride(1)) * es, bytes);
      std::memcpy(vc + (sp[i] * Hkv + h) * bytes, vp + (i * value.stride(0) + h * value.stride(1)) * es, bytes);
    }
  }
}

}  // namespace

TORCH_LIBRARY(minivllm, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("store_kvcache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor context_lens, Tensor block_tables, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("store_kvcache", &store_kvcache);
}
