// The GGUF (ggml) block formats: reading 8 consecutive elements of a quantized row.
//
// A weight [N, K] is stored as N rows of K / QK consecutive blocks (llama.cpp's layouts, exactly as
// a GGUF file holds them). Every format is read in groups of 8 elements (k % 8 == 0), the unit the
// kernels dequantize: a group never straddles a block or a scale, so it needs one scale (and one
// min) and 8 quants. Reading is split in two steps so that a kernel can issue the loads of the
// next chunk before it computes on the current one:
//   Fmt::Group g = Fmt::load(row, k);  // global loads only (as wide as the address allows: blocks
//                                     // of 18, 22, 34 or 210 bytes leave rows at any even address)
//   Fmt::dequant(g, w);               // registers only: w[0..7] in float32
// The float arithmetic is that of gguf.quants.dequantize (numpy float32, no fused multiply-add:
// the explicit _rn intrinsics keep nvcc from contracting), so a float32 dequantization is bit for
// bit the reference's. __host__ __device__ so that host code (the microbenchmark's reference) can
// decode the same bytes.
#pragma once
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#include <cuda_fp16.h>
#define ORCA_QUANT_HD __host__ __device__ __forceinline__
#else
#define ORCA_QUANT_HD inline
#endif

namespace orca::kernels::quant {

// ---- float helpers that behave the same on host and device ------------------------------------
ORCA_QUANT_HD float half_bits_to_float(uint16_t h) {
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    uint32_t e = 113u, m = mant;
    while ((m & 0x400u) == 0) m <<= 1, --e;
    bits = sign | (e << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

ORCA_QUANT_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
ORCA_QUANT_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

ORCA_QUANT_HD uint16_t load_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
// 8 consecutive bytes, little-endian, as two words, with the widest loads the address allows:
// one 8-byte load (Q4_K, Q5_K and Q5_1 quants in rows whose start is 16-byte aligned), 4- or 2-byte
// loads (the blocks of 18, 22, 34 and 210 bytes keep only 2-byte alignment), bytes otherwise.
ORCA_QUANT_HD void load8(const uint8_t* p, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) || defined(ORCA_QUANT_HOST_WIDE_LOADS)
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if ((a & 7) == 0) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    lo = v.x, hi = v.y;
    return;
  }
  if ((a & 3) == 0) {
    lo = reinterpret_cast<const uint32_t*>(p)[0], hi = reinterpret_cast<const uint32_t*>(p)[1];
    return;
  }
  if ((a & 1) == 0) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
    lo = uint32_t(h[0]) | uint32_t(h[1]) << 16, hi = uint32_t(h[2]) | uint32_t(h[3]) << 16;
    return;
  }
#endif
  lo = uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
  hi = uint32_t(p[4]) | uint32_t(p[5]) << 8 | uint32_t(p[6]) << 16 | uint32_t(p[7]) << 24;
}
ORCA_QUANT_HD uint32_t byte_of(uint32_t lo, uint32_t hi, int e) { return ((e < 4 ? lo : hi) >> (8 * (e & 3))) & 0xffu; }

// ---- Q8_0 (ggml type 8): 34 bytes = fp16 d, int8 q[32]; w = q * d ---------------------------------
struct Q8_0 {
  static constexpr int kType = 8, kBlockElems = 32, kBlockBytes = 34;
  struct Group {
    uint16_t d;
    uint32_t lo, hi;  // q[j..j+7]
  };
  ORCA_QUANT_HD static Group load(const uint8_t* row, int64_t k) {
    const uint8_t* b = row + (k / kBlockElems) * kBlockBytes;
    Group g;
    g.d = load_u16(b);
    load8(b + 2 + (k % kBlockElems), g.lo, g.hi);
    return g;
  }
  ORCA_QUANT_HD static void dequant(const Group& g, float (&w)[8]) {
    const float d = half_bits_to_float(g.d);
#pragma unroll
    for (int e = 0; e < 8; ++e) w[e] = mul_rn(static_cast<float>(static_cast<int8_t>(byte_of(g.lo, g.hi, e))), d);
  }
};

// ---- Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7): 32 elements = fp16 d [, fp16 m] [, uint32 qh
// (little-endian)], qs[16]. Element i < 16 has the low nibble of qs[i], i >= 16 the high nibble of
// qs[i - 16]; the 5-bit formats add bit i of qh as bit 4. w = d * (q - 8) (Q4_0), d * (q - 16)
// (Q5_0), or d * q + m (Q4_1, Q5_1) --------------------------------------------------------------------
// (Blocks of 18 and 22 bytes leave qh at 2-byte alignment: a group reads the one qh byte it needs.)
template <int kTypeId, bool kMin, bool kFive>
struct NibbleBlock {
  static constexpr int kType = kTypeId, kBlockElems = 32;
  static constexpr int kHead = kMin ? 4 : 2;             // fp16 d [, m]
  static constexpr int kQs = kHead + (kFive ? 4 : 0);    // the 16 quant bytes
  static constexpr int kBlockBytes = kQs + 16;
  struct Group {
    uint16_t d, m;    // m: kMin only
    uint8_t qh;       // kFive only: bit e is bit 4 of element e of the group
    uint32_t lo, hi;  // qs bytes of the group
    int shift;        // 0: low nibbles, 4: high nibbles
  };
  ORCA_QUANT_HD static Group load(const uint8_t* row, int64_t k) {
    const uint8_t* b = row + (k / kBlockElems) * kBlockBytes;
    const int j = static_cast<int>(k % kBlockElems);
    Group g;
    g.d = load_u16(b);
    g.m = kMin ? load_u16(b + 2) : uint16_t{0};
    g.qh = kFive ? b[kHead + j / 8] : uint8_t{0};  // bits j .. j + 7 of qh
    load8(b + kQs + (j & 15), g.lo, g.hi);
    g.shift = j >= 16 ? 4 : 0;
    return g;
  }
  ORCA_QUANT_HD static void dequant(const Group& g, float (&w)[8]) {
    const float d = half_bits_to_float(g.d), m = half_bits_to_float(g.m);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      uint32_t q = (byte_of(g.lo, g.hi, e) >> g.shift) & 15u;
      if (kFive) q |= ((g.qh >> e) & 1u) << 4;
      if (kMin)
        w[e] = add_rn(mul_rn(d, static_cast<float>(q)), m);
      else
        w[e] = mul_rn(d, static_cast<float>(static_cast<int>(q) - (kFive ? 16 : 8)));
    }
  }
};
using Q4_0 = NibbleBlock<2, false, false>;
using Q4_1 = NibbleBlock<3, true, false>;
using Q5_0 = NibbleBlock<6, false, true>;
using Q5_1 = NibbleBlock<7, true, true>;

// The 6-bit scale and min of sub-block s (0..7) from the 12 packed bytes of Q4_K and Q5_K
// (ggml's get_scale_min_k4): s < 4 in the low 6 bits of scales[s] and scales[s + 4]; s >= 4 low 4
// bits in scales[s + 4] (scale: low nibble, min: high nibble), top 2 bits in the top bits of
// scales[s - 4] (scale) and scales[s] (min).
ORCA_QUANT_HD void scale_min_k4(const uint8_t* scales, int s, uint8_t& sc, uint8_t& mn) {
  if (s < 4) {
    sc = scales[s] & 63;
    mn = scales[s + 4] & 63;
  } else {
    sc = static_cast<uint8_t>((scales[s + 4] & 0xf) | ((scales[s - 4] >> 6) << 4));
    mn = static_cast<uint8_t>((scales[s + 4] >> 4) | ((scales[s] >> 6) << 4));
  }
}

// ---- Q4_K (12), Q5_K (13): 144 (176) bytes = fp16 d, fp16 dmin, scales[12] [, qh[32]], qs[128].
// 8 sub-blocks of 32: sub-block s has a 6-bit scale sc and min mn packed in scales[]
// (get_scale_min_k4); its element l is nibble (s & 1 ? high : low) of qs[32 * (s / 2) + l], with
// (qh[l] >> s) & 1 as bit 4 in Q5_K; w = (d * sc) * q - (dmin * mn) ---------------------------------
template <int kTypeId, bool kFive>
struct KBlock {
  static constexpr int kType = kTypeId, kBlockElems = 256, kBlockBytes = kFive ? 176 : 144;
  static constexpr int kQs = kFive ? 48 : 16;  // the nibbles
  struct Group {
    uint16_t d, dmin;
    uint8_t sc, mn;         // the sub-block's 6-bit scale and min
    uint32_t lo, hi;        // qs bytes of the group
    uint32_t qh_lo, qh_hi;  // kFive only: qh[l .. l + 7], bit s of each the 5th bit of its element
    int s;                  // the sub-block: nibble shift 4 * (s & 1), qh bit s
  };
  ORCA_QUANT_HD static Group load(const uint8_t* row, int64_t k) {
    const uint8_t* b = row + (k / kBlockElems) * kBlockBytes;
    const int e = static_cast<int>(k % kBlockElems), s = e / 32, l = e % 32;
    Group g;
    g.d = load_u16(b);
    g.dmin = load_u16(b + 2);
    scale_min_k4(b + 4, s, g.sc, g.mn);
    g.qh_lo = g.qh_hi = 0;
    if (kFive) load8(b + 16 + l, g.qh_lo, g.qh_hi);
    load8(b + kQs + 32 * (s / 2) + l, g.lo, g.hi);
    g.s = s;
    return g;
  }
  ORCA_QUANT_HD static void dequant(const Group& g, float (&w)[8]) {
    const float dl = mul_rn(half_bits_to_float(g.d), static_cast<float>(g.sc));
    const float ml = mul_rn(half_bits_to_float(g.dmin), static_cast<float>(g.mn));
    const int shift = (g.s & 1) ? 4 : 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      uint32_t q = (byte_of(g.lo, g.hi, e) >> shift) & 15u;
      if (kFive) q |= ((byte_of(g.qh_lo, g.qh_hi, e) >> g.s) & 1u) << 4;
      w[e] = add_rn(mul_rn(dl, static_cast<float>(q)), -ml);
    }
  }
};
using Q4_K = KBlock<12, false>;
using Q5_K = KBlock<13, true>;

// ---- Q6_K (14): 210 bytes = ql[128], qh[64], int8 scales[16], fp16 d. Two halves of 128; in half h,
// quarter q (32 elements each) element l has low 4 bits from ql[64h + 32(q & 1) + l] (q < 2: low
// nibble, else high), high 2 bits (qh[32h + l] >> 2q) & 3, scale scales[8h + 2q + l / 16];
// w = (d * scale) * (q6 - 32) ------------------------------------------------------------------------
struct Q6_K {
  static constexpr int kType = 14, kBlockElems = 256, kBlockBytes = 210;
  struct Group {
    uint16_t d;
    int8_t sc;
    uint32_t ql_lo, ql_hi, qh_lo, qh_hi;
    int ql_shift, qh_shift;
  };
  ORCA_QUANT_HD static Group load(const uint8_t* row, int64_t k) {
    const uint8_t* b = row + (k / kBlockElems) * kBlockBytes;
    const int e = static_cast<int>(k % kBlockElems), h = e / 128, q = (e % 128) / 32, l = e % 32;
    Group g;
    g.d = load_u16(b + 208);
    g.sc = static_cast<int8_t>(b[192 + 8 * h + 2 * q + l / 16]);
    load8(b + 64 * h + 32 * (q & 1) + l, g.ql_lo, g.ql_hi);
    load8(b + 128 + 32 * h + l, g.qh_lo, g.qh_hi);
    g.ql_shift = q >= 2 ? 4 : 0;
    g.qh_shift = 2 * q;
    return g;
  }
  ORCA_QUANT_HD static void dequant(const Group& g, float (&w)[8]) {
    const float dl = mul_rn(half_bits_to_float(g.d), static_cast<float>(g.sc));
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const uint32_t lo4 = (byte_of(g.ql_lo, g.ql_hi, e) >> g.ql_shift) & 15u;
      const uint32_t hi2 = (byte_of(g.qh_lo, g.qh_hi, e) >> g.qh_shift) & 3u;
      w[e] = mul_rn(dl, static_cast<float>(static_cast<int>(lo4 | (hi2 << 4)) - 32));
    }
  }
};

// Calls f(Fmt{}) with the format of ggml type id `qtype`; false for a type not listed above.
template <typename F>
inline bool visit_format(int64_t qtype, F&& f) {
  switch (qtype) {
    case Q8_0::kType: f(Q8_0{}); return true;
    case Q4_0::kType: f(Q4_0{}); return true;
    case Q4_1::kType: f(Q4_1{}); return true;
    case Q5_0::kType: f(Q5_0{}); return true;
    case Q5_1::kType: f(Q5_1{}); return true;
    case Q4_K::kType: f(Q4_K{}); return true;
    case Q5_K::kType: f(Q5_K{}); return true;
    case Q6_K::kType: f(Q6_K{}); return true;
    default: return false;
  }
}

}  // namespace orca::kernels::quant
