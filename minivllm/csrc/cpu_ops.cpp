// The engine's small per-layer operators for CPU, as one C++ library of torch operators (namespace `minivllm`):
// RMSNorm (plain and with the residual add), RoPE, SiLU-mul, the KV-cache store and paged decode attention.
// Each is the CPU twin of a Triton kernel of the GPU path and computes what the torch definition it replaces
// computes, in the same order of roundings (notebooks 01-03, 06-08 build those definitions; tests/test_cpu_ops.py
// checks every operator against them). Why: on CPU a decode step of a small model is ~40 torch ops per layer at
// 5-10 us each, most of them casts and elementwise passes over a few KB; here each operator is one call, reading
// its inputs once, in fp32 registers (benchmarks/NOTES.md, change 29).
//
// Built by minivllm/layers/cpu_ops.py (`python3 -m minivllm.layers.cpu_ops`, which scripts/setup.sh runs), loaded
// with torch.ops.load_library. Work is split over torch's own OpenMP threads (at::parallel_for); compile with
// -ffp-contract=off so that a*b - c*d rounds as torch's separate ops do, and -fno-trapping-math so that loops with
// std::floor and selects vectorize.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

// --- loads, roundings and stores through fp32 (written so that loops over them vectorize) ----------------------

inline uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}
inline float float_of(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}
// fp32 -> bf16 bits, rounded to nearest even (a NaN stays a NaN): what c10::BFloat16(float) does
inline uint16_t bf16_bits(float f) {
  const uint32_t b = bits_of(f);
  return f != f ? 0x7FC0 : static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

// *p as an fp32 (bf16 through its bits as a uint16_t: fp32's top half; a struct member would stop vectorizing)
inline float ld(const float* p) { return *p; }
inline float ld(const c10::BFloat16* p) {
  return float_of(static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16);
}
inline float ld(const c10::Half* p) { return static_cast<float>(*p); }

template <typename T>
inline float round_to(float x);  // x rounded to T's precision, as an fp32: a cast to T and back
template <>
inline float round_to<float>(float x) { return x; }
template <>
inline float round_to<c10::BFloat16>(float x) { return float_of(static_cast<uint32_t>(bf16_bits(x)) << 16); }
template <>
inline float round_to<c10::Half>(float x) { return static_cast<float>(c10::Half(x)); }

template <typename T>
inline void st(T* p, float x) { *p = T(x); }
template <>
inline void st<c10::BFloat16>(c10::BFloat16* p, float x) { *reinterpret_cast<uint16_t*>(p) = bf16_bits(x); }

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = ld(src + i);
}

// e^x: x = k ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, Cody and Waite), e^r by Cephes' expf polynomial
// (within ~1 ulp), times 2^k built in the exponent's bits. Unlike std::exp, a loop of it vectorizes. Past fp32's
// range: 0 below -87.3 (where e^x would be denormal), infinity above 88.7, as std::exp rounds them.
inline float exp_fast(float x) {
  const float c = std::min(std::max(x, -87.f), 88.f);
  const float k = std::floor(c * 1.44269504088896341f + 0.5f);
  const float r = (c - k * 0.693359375f) - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const float y = p * float_of(static_cast<uint32_t>(static_cast<int32_t>(k) + 127) << 23);
  return x < -87.3f ? 0.f : (x > 88.7f ? INFINITY : y);
}

// Run fn<T>() for the tensor's dtype: fp32, bf16 or fp16.
template <typename Fn>
void dispatch(const at::Tensor& t, const char* op, Fn&& fn) {
  switch (t.scalar_type()) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    default: TORCH_CHECK_VALUE(false, op, ": dtype ", t.scalar_type(), " is not fp32, bf16 or fp16");
  }
}

// rows x width: the rows of a tensor whose last dim is contiguous, as (pointer, row stride)
void check_rows(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " must be on the CPU");
  TORCH_CHECK_VALUE(t.dim() >= 1 && t.stride(-1) == 1, op, ": ", name, "'s last dim must be contiguous");
}

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

// --- the KV-cache store (layers/torch_attention.py: store_kvcache_torch) -------------------------------------

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

// --- paged decode attention (layers/torch_attention.py: paged_decode_attention; Triton: layers/paged_decode.py) --

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
  m.impl("paged_decode", &paged_decode);
}
