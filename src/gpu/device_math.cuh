// Device helpers shared by the GPU runtime's kernels: element conversions, activations (src/math/activation.hpp in
// fp32), the concatenated-GLU row map, and dtype dispatch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "machmoe/error.hpp"
#include "math/activation.hpp"
#include "machmoe/problem.hpp"
#include "machmoe/tensor.hpp"

namespace machmoe::gpu {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

/// f and f' of the elementwise part of an activation (the gate function for GLU activations), fp32, exact
/// transcendentals: the one definition of src/math/activation.hpp.
using ActValue = math::ActValue<float>;
__device__ __forceinline__ ActValue act_eval(Activation act, float x) { return math::act_value_and_derivative(act, x); }

__host__ __device__ __forceinline__ bool act_is_glu(Activation a) { return math::is_glu_activation(a); }

/// Concatenated GLU layout: interleaved column c lives in row (c % 2) * n + c / 2.
__device__ __forceinline__ std::int64_t glu_concat_row(std::int64_t c, std::int64_t n) {
  return (c & 1) * n + (c >> 1);
}

/// The same in elements, where the up half may lie apart from the gate half: interleaved column c is row c / 2 of
/// half c % 2, at (c % 2) * half_stride + (c / 2) * row_stride (half_stride = n * row_stride for joined halves).
__device__ __forceinline__ std::int64_t glu_concat_offset(std::int64_t c, std::int64_t half_stride,
                                                          std::int64_t row_stride) {
  return (c & 1) * half_stride + (c >> 1) * row_stride;
}

/// Total order of top-K candidates (value, index): larger value first, NaN last, lower index first on ties.
__device__ __forceinline__ bool ranks_before(float av, int ai, float bv, int bi) {
  const bool an = isnan(av), bn = isnan(bv);
  if (an != bn) return bn;
  if (!an && av != bv) return av > bv;
  return ai < bi;
}

/// The rank of a top-K candidate as one 64-bit key whose unsigned order is ranks_before's: the value's bits made
/// monotone (NaN lowest, -0 as +0) above the complemented index (lower index first on equal values). Every kernel
/// that selects from keys (top-K, token rounding forward and backward) uses this one definition.
__device__ __forceinline__ std::uint64_t rank_key(float v, int i) {
  std::uint32_t u = __float_as_uint(v == 0.0f ? 0.0f : v);
  u = isnan(v) ? 0u : (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<std::uint64_t>(u) << 32) | (0xffffffffu - static_cast<std::uint32_t>(i));
}
__device__ __forceinline__ float key_value(std::uint64_t key) {  // NaN for the NaN key (all ones)
  const std::uint32_t u = static_cast<std::uint32_t>(key >> 32);
  return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}

/// rank_key's order in the narrowest key a selection over elements of T can use, for rows of at most kMaxRow
/// elements. Generic: rank_key itself (64 bits; a warp maximum is two redux instructions, value word then index word).
/// key 0 ranks below every element (padding lanes).
template <class T>
struct RankKey {
  using Type = std::uint64_t;
  static constexpr int kMaxRow = 0x7fffffff;
  __device__ __forceinline__ static Type make(float v, int i) { return rank_key(v, i); }
  __device__ __forceinline__ static float value(Type k) { return key_value(k); }
  __device__ __forceinline__ static int index(Type k) {
    return static_cast<int>(0xffffffffu - static_cast<std::uint32_t>(k));
  }
  __device__ __forceinline__ static Type warp_max(Type k) {
    const std::uint32_t hi = __reduce_max_sync(0xffffffffu, static_cast<std::uint32_t>(k >> 32));
    const std::uint32_t lo =
        __reduce_max_sync(0xffffffffu, static_cast<std::uint32_t>(k >> 32) == hi ? static_cast<std::uint32_t>(k) : 0u);
    return (static_cast<std::uint64_t>(hi) << 32) | lo;
  }
};
/// bf16: an element's float is its 16 high bits, so rank_key's monotone value word keeps its order in its high half
/// (the low half is constant for a sign: 0 above zero, all ones below), and the complemented index fits the low 16
/// bits for rows of up to 65535 elements (65535 - i >= 1 keeps even a NaN's key above the padding's 0). One 32-bit key:
/// the same selections in the same order, half the compare work, and a warp maximum in one redux instruction.
template <>
struct RankKey<__nv_bfloat16> {
  using Type = std::uint32_t;
  static constexpr int kMaxRow = 0xffff;
  __device__ __forceinline__ static Type make(float v, int i) {
    return (static_cast<std::uint32_t>(rank_key(v, i) >> 32) & 0xffff0000u) | (0xffffu - static_cast<std::uint32_t>(i));
  }
  /// make(to_float(x), i) from x's 16 bits by integer operations alone (no conversion, no float compares): the same
  /// cases as rank_key's value word, each of them: -0 as +0, NaN lowest (0), a negative value's bits complemented, a
  /// positive value's with the sign bit set.
  __device__ __forceinline__ static Type make_bits(std::uint32_t bits, int i) {
    const std::uint32_t b = bits == 0x8000u ? 0u : bits;                   // -0 ranks as +0
    const std::uint32_t flip = (b & 0x8000u) ? 0xffffu : 0x8000u;          // negative: complement; else set the sign
    const std::uint32_t hi = (b & 0x7fffu) > 0x7f80u ? 0u : b ^ flip;      // NaN: below every other value
    return (hi << 16) | (0xffffu - static_cast<std::uint32_t>(i));
  }
  __device__ __forceinline__ static float value(Type k) {  // NaN for the NaN key (value half 0)
    const std::uint32_t u = k >> 16;
    return __uint_as_float(((u & 0x8000u) ? (u & 0x7fffu) : (~u & 0xffffu)) << 16);
  }
  __device__ __forceinline__ static int index(Type k) { return static_cast<int>(0xffffu - (k & 0xffffu)); }
  __device__ __forceinline__ static Type warp_max(Type k) { return __reduce_max_sync(0xffffffffu, k); }
};

/// A warp's row of E elements in registers, for the kernels that select over it (top-K, token rounding): slot j of lane
/// l holds element 32 j + l, its float in v (`pad` past the row) and its rank key in key (0 past the row: below every
/// element). Every load is issued before any is used, and unconditionally (a slot past the row reads element E - 1,
/// E >= 1, and sets it aside): a load under its slot's condition was compiled into that slot's branch with the key's
/// computation, each load issued after the previous slot's key was made from its own (token rounding's router backward
/// 0.055 -> 0.043 ms on 1.4B (256,128,8) without that, H200, docs/BENCHMARKS.md session 86). bf16 elements as their
/// bits: the float is the bits shifted up, the key made from them by integer operations (the same key as from the
/// float); where the row fills every slot (warp-uniform), no slot conditions at all.
template <class T, int PerLane>
__device__ __forceinline__ void load_row_slots(const T* row, int E, int lane, float pad, float (&v)[PerLane],
                                               typename RankKey<T>::Type (&key)[PerLane]) {
  using Key = RankKey<T>;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const auto* bits = reinterpret_cast<const unsigned short*>(row);
    std::uint32_t b[PerLane];
#pragma unroll
    for (int j = 0; j < PerLane; ++j) b[j] = bits[min(j * 32 + lane, E - 1)];
    if (E >= 32 * PerLane) {
#pragma unroll
      for (int j = 0; j < PerLane; ++j) {
        v[j] = __uint_as_float(b[j] << 16);
        key[j] = Key::make_bits(b[j], j * 32 + lane);
      }
    } else {
#pragma unroll
      for (int j = 0; j < PerLane; ++j) {
        const int i = j * 32 + lane;
        v[j] = i < E ? __uint_as_float(b[j] << 16) : pad;
        key[j] = i < E ? Key::make_bits(b[j], i) : 0u;
      }
    }
  } else {  // fp32 and fp16: loaded under their conditions (unconditional loads made the fp32 wide backward spill)
#pragma unroll
    for (int j = 0; j < PerLane; ++j) {
      const int i = j * 32 + lane;
      v[j] = i < E ? to_float(row[i]) : pad;
      key[j] = i < E ? Key::make(v[j], i) : 0u;
    }
  }
}

/// The lane's keys in descending order: a bubble network over registers (PerLane (PerLane - 1) / 2 compare-exchanges,
/// fully unrolled, so the keys never leave registers). The top-K kernel and token rounding's row selection sort each
/// lane's rank keys once with it, so a selection round only compares the lanes' first keys.
template <int PerLane, class Key>
__device__ __forceinline__ void sort_keys_descending(Key (&key)[PerLane]) {
#pragma unroll
  for (int i = 0; i < PerLane; ++i)
#pragma unroll
    for (int j = PerLane - 1; j > i; --j) {
      const Key hi = key[j - 1] > key[j] ? key[j - 1] : key[j];
      const Key lo = key[j - 1] > key[j] ? key[j] : key[j - 1];
      key[j - 1] = hi, key[j] = lo;
    }
}

// The two-lanes-a-token selections (top-K in router_kernels.cu, token rounding's keys in token_rounding_kernels.cu)
// keep a lane's best KMax 32-bit rank keys sorted in registers and merge each 16-byte group of 8 keys into them.

/// Descending compare-exchange of two keys.
__device__ __forceinline__ void exchange_descending(std::uint32_t& a, std::uint32_t& b) {
  const std::uint32_t hi = max(a, b), lo = min(a, b);
  a = hi, b = lo;
}

/// best (KMax keys, descending) and `other` (KMax keys, ascending) become the top KMax of both, descending (all keys
/// distinct: each holds its index): max(best[i], other[i]) is that top KMax as a bitonic sequence, which log2(KMax)
/// half-cleaner stages sort.
template <int KMax>
__device__ __forceinline__ void merge_ascending_into_best(std::uint32_t (&best)[KMax], const std::uint32_t* other) {
#pragma unroll
  for (int i = 0; i < KMax; ++i) best[i] = max(best[i], other[i]);
#pragma unroll
  for (int span = KMax / 2; span >= 1; span /= 2)
#pragma unroll
    for (int i = 0; i < KMax; ++i)
      if ((i & span) == 0) exchange_descending(best[i], best[i + span]);
}

/// best becomes the top KMax of best and the 8 keys of group: group sorted by Batcher's odd-even merge network (19
/// exchanges), its first KMax reversed merged in. About 70 min/max instructions for 8 elements at KMax = 8, against
/// 128 for inserting them one by one down the list.
template <int KMax>
__device__ __forceinline__ void merge_group_into_best(std::uint32_t (&best)[KMax], std::uint32_t (&group)[8]) {
  static_assert(KMax == 2 || KMax == 4 || KMax == 8, "a power of two no larger than the group");
  constexpr int kNetwork[19][2] = {{0, 1}, {2, 3}, {4, 5}, {6, 7}, {0, 2}, {1, 3}, {4, 6}, {5, 7}, {1, 2}, {5, 6},
                                   {0, 4}, {1, 5}, {2, 6}, {3, 7}, {2, 4}, {3, 5}, {1, 2}, {3, 4}, {5, 6}};
#pragma unroll
  for (int x = 0; x < 19; ++x) exchange_descending(group[kNetwork[x][0]], group[kNetwork[x][1]]);
  std::uint32_t ascending[KMax];
#pragma unroll
  for (int i = 0; i < KMax; ++i) ascending[i] = group[KMax - 1 - i];
  merge_ascending_into_best<KMax>(best, ascending);
}

/// A bf16 row's 16-byte group g (elements 8g .. 8g + 7, two a word, low half first): their rank keys, from the raw
/// bits, and their values as floats (a bf16 is the high half of its float).
__device__ __forceinline__ void bf16_group_keys(const uint4& v, int g, std::uint32_t (&key)[8]) {
  const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 8; ++k)
    key[k] = RankKey<__nv_bfloat16>::make_bits((words[k / 2] >> (16 * (k % 2))) & 0xffffu, g * 8 + k);
}
__device__ __forceinline__ void bf16_group_values(const uint4& v, float (&x)[8]) {
  const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    x[2 * k] = __uint_as_float(words[k] << 16);
    x[2 * k + 1] = __uint_as_float(words[k] & 0xffff0000u);
  }
}

/// The next top-K selection of a row by one warp: the best candidate ranking after (prev_v, prev_i) (prev_i < 0: the
/// first). Repeating it K times selects the top K in order with no marking, for any E and K. Every kernel that
/// selects experts uses this one function, so the forward and the backward always agree on the selection.
template <class T>
__device__ __forceinline__ void warp_next_selection(const T* row, int E, int lane, float& prev_v, int& prev_i) {
  float best_v = NAN;
  int best_i = -1;
  for (int i = lane; i < E; i += 32) {
    const float v = to_float(row[i]);
    const bool after_prev = prev_i < 0 || ranks_before(prev_v, prev_i, v, i);
    if (after_prev && (best_i < 0 || ranks_before(v, i, best_v, best_i))) best_v = v, best_i = i;
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best_v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
    if (oi >= 0 && (best_i < 0 || ranks_before(ov, oi, best_v, best_i))) best_v = ov, best_i = oi;
  }
  prev_v = best_v, prev_i = best_i;
}

/// Row maximum and sum of exp(z - max) by one warp (every lane gets both); per-lane loops then a fixed butterfly.
template <class T>
__device__ __forceinline__ float warp_row_max(const T* z, int E, int lane) {
  float m = -INFINITY;
  for (int i = lane; i < E; i += 32) m = fmaxf(m, to_float(z[i]));
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

template <class T>
__device__ __forceinline__ float warp_row_sumexp(const T* z, int E, float m, int lane) {
  float s = 0.0f;
  for (int i = lane; i < E; i += 32) s += expf(to_float(z[i]) - m);
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

/// Expert owning grouped row g: the last e with offsets[e] <= g.
__device__ __forceinline__ int expert_of_row(const std::int32_t* offsets, int E, std::int64_t g) {
  int lo = 0, hi = E;  // invariant: offsets[lo] <= g < offsets[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (offsets[mid] <= g) lo = mid;
    else hi = mid;
  }
  return lo;
}

/// Calls f(T{}) with the element type of a data dtype (bf16, fp16, fp32).
template <class F>
void dispatch_data_type(DType dt, F&& f) {
  switch (dt) {
    case DType::kBF16: f(__nv_bfloat16{}); return;
    case DType::kFP16: f(__half{}); return;
    case DType::kFP32: f(float{}); return;
    default: throw Error(std::string("machmoe: GPU kernels take bf16, fp16 or fp32 data, got ") + dtype_name(dt));
  }
}

/// Calls f(T{}, O{}) with the element type T of a data dtype and O of a weight gradient's dtype, which is the data
/// dtype or fp32 (the public entry points validate it).
template <class F>
void dispatch_data_and_grad_type(DType dt, DType grad_dt, F&& f) {
  dispatch_data_type(dt, [&](auto tag) {
    if (grad_dt == DType::kFP32) f(tag, float{});
    else if (grad_dt == dt) f(tag, tag);
    else
      throw Error(std::string("machmoe: a weight gradient of ") + dtype_name(dt) + " data is " + dtype_name(dt) +
                  " or fp32, got " + dtype_name(grad_dt));
  });
}

inline unsigned int ceil_div(std::int64_t a, std::int64_t b) { return static_cast<unsigned int>((a + b - 1) / b); }

}  // namespace machmoe::gpu
