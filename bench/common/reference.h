// Scalar double-precision references of the kernels (a plain byte copy for slab_move), shared by the
// CPU microbenchmarks (bench/cpu/*.cpp) and the CUDA microbenchmarks' host code (bench/cuda/*.cu). Header-only C++17,
// no torch, no OpenMP. They compute what orca_ext/reference.py computes for the tests, written
// as plain loops so a benchmark can check its kernel with no framework at all.
//
// Elements are read through a conversion functor `cvt(T) -> double`, so the same code reads
// float, orca::bf16 (CPU) and __half / __nv_bfloat16 (CUDA) in place, without copying a large
// KV cache to double first.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace bench::ref {

// The first column holding row r's maximum (a NaN outranks everything: the first NaN's column).
inline std::vector<int64_t> row_argmax(const float* x,  // [R, V]
                                       int64_t n_rows, int64_t n_cols) {  // -> [R]
  std::vector<int64_t> index(static_cast<size_t>(n_rows), 0);
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* row = x + r * n_cols;
    int64_t best = 0;
    for (int64_t c = 1; c < n_cols && !std::isnan(row[best]); ++c)
      if (std::isnan(row[c]) || row[c] > row[best]) best = c;
    index[static_cast<size_t>(r)] = best;
  }
  return index;
}

// 1 / sqrt(mean(x^2) + eps) of one row.
template <typename T, typename Cvt>
double rms_inv(const T* x,  // [H]
               int64_t hidden, double eps, Cvt cvt) {
  double ss = 0.0;
  for (int64_t k = 0; k < hidden; ++k) ss += cvt(x[k]) * cvt(x[k]);
  return 1.0 / std::sqrt(ss / static_cast<double>(hidden) + eps);
}

// out[t] = x[t] * rms_inv(x[t]) * weight.
template <typename T, typename Cvt>
std::vector<double> rms_norm(const T* x,       // [T, H]
                             const T* weight,  // [H]
                             int64_t n_tokens, int64_t hidden, double eps, Cvt cvt) {  // -> [T, H]
  std::vector<double> out(static_cast<size_t>(n_tokens * hidden));
  for (int64_t t = 0; t < n_tokens; ++t) {
    const double inv = rms_inv(x + t * hidden, hidden, eps, cvt);
    for (int64_t k = 0; k < hidden; ++k) out[t * hidden + k] = cvt(x[t * hidden + k]) * inv * cvt(weight[k]);
  }
  return out;
}

// out = linear(rms_norm(x) * norm_weight, qkv_weight, qkv_bias). `mass` is, per output,
// |bias| + sum_k |xn_k * w_nk|: the scale of the rounding error a float32 accumulation may make;
// `max_term` is max_k |xn_k * w_nk|.
struct QkvReference {
  std::vector<double> out;       // [T, N]
  std::vector<double> mass;      // [T, N]
  std::vector<double> max_term;  // [T, N]
};

// round_normed(double) -> double is applied to every normalised element before the product: the
// identity, or the rounding of a kernel that stores the normalised row in its element type (the
// CPU kernels do for bf16).
struct NoRounding {
  double operator()(double v) const { return v; }
};

template <typename T, typename Cvt, typename Round = NoRounding>
QkvReference rmsnorm_qkv(const T* x,            // [T, H]
                         const T* norm_weight,  // [H]
                         const T* qkv_weight,   // [N, H]
                         const T* qkv_bias,     // [N] or nullptr
                         int64_t n_tokens, int64_t hidden, int64_t n_out, double eps, Cvt cvt,
                         Round round_normed = {}) {
  QkvReference r;
  r.out.assign(static_cast<size_t>(n_tokens * n_out), 0.0);
  r.mass.assign(static_cast<size_t>(n_tokens * n_out), 0.0);
  r.max_term.assign(static_cast<size_t>(n_tokens * n_out), 0.0);
  std::vector<double> xn = rms_norm(x, norm_weight, n_tokens, hidden, eps, cvt);
  for (double& v : xn) v = round_normed(v);
  for (int64_t t = 0; t < n_tokens; ++t)
    for (int64_t n = 0; n < n_out; ++n) {
      double acc = qkv_bias ? cvt(qkv_bias[n]) : 0.0;
      double mass = std::fabs(acc), max_term = 0.0;
      for (int64_t k = 0; k < hidden; ++k) {
        const double p = xn[t * hidden + k] * cvt(qkv_weight[n * hidden + k]);
        acc += p;
        mass += std::fabs(p);
        max_term = std::max(max_term, std::fabs(p));
      }
      r.out[t * n_out + n] = acc;
      r.mass[t * n_out + n] = mass;
      r.max_term[t * n_out + n] = max_term;
    }
  return r;
}

// out = x * W^T + bias + residual (linear); `mass` as above, including |bias| and |residual|.
struct LinearReference {
  std::vector<double> out;   // [T, N]
  std::vector<double> mass;  // [T, N]
};

template <typename T, typename Cvt>
LinearReference linear(const T* x,         // [T, K]
                       const T* weight,    // [N, K]
                       const T* bias,      // [N] or nullptr
                       const T* residual,  // [T, N] or nullptr
                       int64_t n_tokens, int64_t k, int64_t n_out, Cvt cvt) {
  LinearReference r;
  r.out.assign(static_cast<size_t>(n_tokens * n_out), 0.0);
  r.mass.assign(static_cast<size_t>(n_tokens * n_out), 0.0);
  for (int64_t t = 0; t < n_tokens; ++t)
    for (int64_t n = 0; n < n_out; ++n) {
      double acc = 0.0, mass = 0.0;
      for (int64_t i = 0; i < k; ++i) {
        const double p = cvt(x[t * k + i]) * cvt(weight[n * k + i]);
        acc += p;
        mass += std::fabs(p);
      }
      const double extra[2] = {bias ? cvt(bias[n]) : 0.0, residual ? cvt(residual[t * n_out + n]) : 0.0};
      for (double e : extra) acc += e, mass += std::fabs(e);
      r.out[t * n_out + n] = acc;
      r.mass[t * n_out + n] = mass;
    }
  return r;
}

// The caches after slab_write: row slots[t] of each cache becomes k[t] / v[t], bit for bit; a
// token whose slot is outside [0, n_slots) is skipped (the CUDA kernel's contract; the CPU glue
// rejects such slots before the kernel runs).
template <typename T, typename I>
void slab_write(T* k_cache,      // [S, row_elems]
                T* v_cache,      // [S, row_elems]
                const T* k,      // [T, row_elems]
                const T* v,      // [T, row_elems]
                const I* slots,  // [T]
                int64_t n_tokens, int64_t n_slots, int64_t row_elems) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    const int64_t s = static_cast<int64_t>(slots[t]);
    if (s < 0 || s >= n_slots) continue;
    std::copy(k + t * row_elems, k + (t + 1) * row_elems, k_cache + s * row_elems);
    std::copy(v + t * row_elems, v + (t + 1) * row_elems, v_cache + s * row_elems);
  }
}

// The pools after slab_move: for each (src, dst, n) in order, rows [src, src+n) of every pool go
// to [dst, dst+n) through a temporary, so overlapping ranges are copied as memmove does.
inline void slab_move(unsigned char* pools,  // [P, S, row_bytes]
                      int64_t n_pools, int64_t n_slots, int64_t row_bytes,
                      const int64_t* moves,  // [M, 3]
                      int64_t n_moves) {
  for (int64_t m = 0; m < n_moves; ++m) {
    const int64_t src = moves[3 * m], dst = moves[3 * m + 1], n = moves[3 * m + 2];
    for (int64_t p = 0; p < n_pools; ++p) {
      unsigned char* pool = pools + p * n_slots * row_bytes;
      const std::vector<unsigned char> tmp(pool + src * row_bytes, pool + (src + n) * row_bytes);
      std::copy(tmp.begin(), tmp.end(), pool + dst * row_bytes);
    }
  }
}

// Causal attention of one query row over the first n_keys positions of a context stored from
// slot kv_start on (query row i of a request with q_len rows and kv_len context tokens sees
// n_keys = kv_len - q_len + i + 1 positions). Head h reads KV head h / (Hq / Hkv).
template <typename T, typename Cvt>
void attention_row(const T* q_row,    // [Hq, D]
                   const T* k_cache,  // [S, Hkv, D]
                   const T* v_cache,  // [S, Hkv, D]
                   int64_t kv_start, int64_t n_keys, int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim,
                   double scale, Cvt cvt,
                   double* out) {     // [Hq, D]
  const int64_t group = n_q_heads / n_kv_heads;
  std::vector<double> p(static_cast<size_t>(n_keys));
  for (int64_t h = 0; h < n_q_heads; ++h) {
    const int64_t g = h / group;
    const T* qh = q_row + h * head_dim;
    double mx = -INFINITY;
    for (int64_t j = 0; j < n_keys; ++j) {
      const T* kr = k_cache + ((kv_start + j) * n_kv_heads + g) * head_dim;
      double dot = 0.0;
      for (int64_t d = 0; d < head_dim; ++d) dot += cvt(qh[d]) * cvt(kr[d]);
      p[j] = dot * scale;
      mx = std::max(mx, p[j]);
    }
    double sum = 0.0;
    for (double& e : p) sum += (e = std::exp(e - mx));
    double* oh = out + h * head_dim;
    std::fill(oh, oh + head_dim, 0.0);
    for (int64_t j = 0; j < n_keys; ++j) {
      const T* vr = v_cache + ((kv_start + j) * n_kv_heads + g) * head_dim;
      const double w = p[j] / sum;
      for (int64_t d = 0; d < head_dim; ++d) oh[d] += w * cvt(vr[d]);
    }
  }
}

// The whole ragged batch: request b owns query rows [q_start[b], q_start[b] + q_len[b]); rows
// owned by no request are zero.
template <typename T, typename I, typename Cvt>
std::vector<double> ragged_attention(const T* q,         // [T, Hq, D]
                                     const T* k_cache,   // [S, Hkv, D]
                                     const T* v_cache,   // [S, Hkv, D]
                                     const I* q_start,   // [B]
                                     const I* q_len,     // [B]
                                     const I* kv_start,  // [B]
                                     const I* kv_len,    // [B]
                                     int64_t n_requests, int64_t n_tokens, int64_t n_q_heads, int64_t n_kv_heads,
                                     int64_t head_dim, double scale, Cvt cvt) {  // -> [T, Hq, D]
  const int64_t row = n_q_heads * head_dim;
  std::vector<double> out(static_cast<size_t>(n_tokens * row), 0.0);
  for (int64_t b = 0; b < n_requests; ++b) {
    const int64_t qs = q_start[b], ql = q_len[b], ks = kv_start[b], kl = kv_len[b];
    for (int64_t i = 0; i < ql; ++i)
      attention_row(q + (qs + i) * row, k_cache, v_cache, ks, kl - ql + i + 1, n_q_heads, n_kv_heads, head_dim,
                    scale, cvt, out.data() + (qs + i) * row);
  }
  return out;
}

}  // namespace bench::ref
