// The engine's small per-layer operators for CPU, as one C++ library of torch operators (namespace `minivllm`;
// this header's helpers, elementwise.cpp, paged_decode.cpp): RMSNorm (plain and with the residual add), RoPE,
// SiLU-mul, the KV-cache store and paged decode attention. Each is the CPU twin of a Triton kernel of the GPU path
// and computes what the torch definition it replaces computes, in the same order of roundings (notebooks 01-03,
// 06-08 build those definitions; tests/test_cpu_ops.py checks every operator against them). Why: on CPU a decode
// step of a small model is ~40 torch ops per layer at 5-10 us each, most of them casts and elementwise passes over
// a few KB; here each operator is one call, reading its inputs once, in fp32 registers.
//
// Built by minivllm/kernels/cpu/build.py (`python3 -m minivllm.kernels.cpu.build`, which scripts/setup.sh runs),
// loaded with torch.ops.load_library. Work is split over torch's own OpenMP threads (at::parallel_for); compile
// with -ffp-contract=off so that a*b - c*d rounds as torch's separate ops do, and -fno-trapping-math so that loops
// with std::floor and selects vectorize.

#pragma once

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

namespace {  // each file that includes it gets its own copy of these helpers

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

}  // namespace
