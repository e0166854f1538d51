// Attention of a decoding step's few new queries over a batch's KV cache, each row reading only its own columns.
//
// SDPA on a CPU reads every cached column of every row: the left padding of a batch's shorter prompts too,
// which at batch 256 of ShareGPT prompts is about half of what a step reads. Its kernel also takes each query
// head apart, with a fixed cost that at one query a head outweighs reading the keys. Here one task is one row
// and one KV head: its keys and values are read once, from the row's first column on, for all the query
// heads that share them and all the new queries, in float32.
//
// query [B, H, n, D], keys and values [B, Hkv, C, D] (any strides, D contiguous), mask [B, 1, n, C] additive,
// first [B] (int64, row b reads columns first[b] .. C-1) -> [B, n, H, D] in the query's dtype.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

// Rows of keys or values asked for this many rows ahead of their use: the hardware's own prefetching starts
// over at each 4 KB page, and a row's columns span a few (2-core Xeon, batch 256: 3.0 -> 2.4 ms a layer)
constexpr int64_t AHEAD = 8;

template <typename T>
inline void prefetch(const T* row, int64_t dim) {
  const char* bytes = reinterpret_cast<const char*>(row);
  const int64_t size = dim * static_cast<int64_t>(sizeof(T));
  for (int64_t line = 0; line < size; line += 64) __builtin_prefetch(bytes + line);
}

inline void load(const float* source, float* into, int64_t count) {
  std::memcpy(into, source, count * sizeof(float));
}

inline void load(const at::BFloat16* source, float* into, int64_t count) {
  // a bfloat16 is the upper half of a float32
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(source);
  uint32_t* out = reinterpret_cast<uint32_t*>(into);
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

// scores[r * count + c] = queries[r] . keys[c] for `rows` queries of `dim` floats and `count` key rows
template <typename T>
void score(const float* queries, int64_t rows, const T* keys, int64_t stride, int64_t count, int64_t dim,
           float* scores, float* row) {
  for (int64_t c = 0; c < count; ++c) {
    load(keys + c * stride, row, dim);
    for (int64_t r = 0; r < rows; ++r) {
      float sum = 0.f;
      for (int64_t d = 0; d < dim; ++d) sum += queries[r * dim + d] * row[d];
      scores[r * count + c] = sum;
    }
  }
}

// out[r] += sum over c of weights[r * count + c] * values[c]
template <typename T>
void weigh(const float* weights, int64_t rows, const T* values, int64_t stride, int64_t count, int64_t dim,
           float* out, float* row) {
  for (int64_t c = 0; c < count; ++c) {
    load(values + c * stride, row, dim);
    for (int64_t r = 0; r < rows; ++r) {
      const float weight = weights[r * count + c];
      for (int64_t d = 0; d < dim; ++d) out[r * dim + d] += weight * row[d];
    }
  }
}

// s[c] += bias[c]; then s = exp(s - max s) in place; gives the sum (0 where every column is masked out)
template <typename T>
float softmax(float* s, const T* bias, int64_t bias_stride, int64_t count) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < count; ++c) {
    s[c] += static_cast<float>(bias[c * bias_stride]);
    top = std::max(top, s[c]);
  }
  if (top == -std::numeric_limits<float>::infinity()) {
    std::fill(s, s + count, 0.f);
    return 0.f;
  }
  float sum = 0.f;
  for (int64_t c = 0; c < count; ++c) {
    s[c] = std::exp(s[c] - top);
    sum += s[c];
  }
  return sum;
}

#ifdef __AVX512F__
// The same two loops for a head dimension of 64 (a row of keys or values in four registers), the weighted
// values of four queries at a time kept in registers. The compiler's own vectors of the loops above left a
// step's attention slower than SDPA's.
constexpr int64_t BLOCK = 4;  // queries `weigh64` takes at a time: the caller rounds `rows` up to a multiple

// e^x to about one unit in the last place: 2^n e^r with n = round(x / ln 2), |r| <= ln(2) / 2, e^r by its
// Taylor polynomial of degree 7; exactly 0 below e^-87 (a masked column's weight), NaN for NaN
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (const float coefficient : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(coefficient));
  }
  const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_NLE_UQ);
  return _mm512_maskz_mov_ps(kept, _mm512_scalef_ps(p, n));
}

// 16 values (those of `lanes`, the others 0) as float32
inline __m512 load16(const float* source, __mmask16 lanes = 0xFFFF) {
  return _mm512_maskz_loadu_ps(lanes, source);
}

inline __m512 load16(const at::BFloat16* source, __mmask16 lanes = 0xFFFF) {
  const __m256i bits = _mm256_maskz_loadu_epi16(lanes, source);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// the lanes of columns c .. c + 15 that are below `count`
inline __mmask16 below(int64_t count, int64_t c) {
  return count - c >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (count - c)) - 1);
}

// `softmax` 16 columns at a time, for a mask contiguous along the columns
template <typename T>
float softmax16(float* s, const T* bias, int64_t count) {
  __m512 tops = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c < count; c += 16) {
    const __mmask16 lanes = below(count, c);
    const __m512 sum = _mm512_add_ps(load16(s + c, lanes), load16(bias + c, lanes));
    _mm512_mask_storeu_ps(s + c, lanes, sum);
    tops = _mm512_mask_max_ps(tops, lanes, tops, sum);
  }
  const float top = _mm512_reduce_max_ps(tops);
  if (top == -std::numeric_limits<float>::infinity()) {
    std::fill(s, s + count, 0.f);
    return 0.f;
  }
  __m512 sums = _mm512_setzero_ps();
  for (int64_t c = 0; c < count; c += 16) {
    const __mmask16 lanes = below(count, c);
    const __m512 e = exp16(_mm512_sub_ps(load16(s + c, lanes), _mm512_set1_ps(top)));
    _mm512_mask_storeu_ps(s + c, lanes, e);
    sums = _mm512_mask_add_ps(sums, lanes, sums, e);
  }
  return _mm512_reduce_add_ps(sums);
}

template <typename T>
void score64(const float* queries, int64_t rows, const T* keys, int64_t stride, int64_t count, float* scores) {
  for (int64_t c = 0; c < count; ++c) {
    const T* key = keys + c * stride;
    prefetch(key + AHEAD * stride, 64);
    const __m512 k0 = load16(key), k1 = load16(key + 16), k2 = load16(key + 32), k3 = load16(key + 48);
    for (int64_t r = 0; r < rows; ++r) {
      const float* q = queries + r * 64;
      __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(q), k0);
      sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16), k1, sum);
      sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + 32), k2, sum);
      sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + 48), k3, sum);
      scores[r * count + c] = _mm512_reduce_add_ps(sum);
    }
  }
}

template <typename T>
void weigh64(const float* weights, int64_t rows, const T* values, int64_t stride, int64_t count, float* out) {
  for (int64_t r = 0; r < rows; r += BLOCK) {
    __m512 o0[BLOCK], o1[BLOCK], o2[BLOCK], o3[BLOCK];
    for (int64_t j = 0; j < BLOCK; ++j) o0[j] = o1[j] = o2[j] = o3[j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < count; ++c) {
      const T* value = values + c * stride;
      prefetch(value + AHEAD * stride, 64);
      const __m512 v0 = load16(value), v1 = load16(value + 16), v2 = load16(value + 32), v3 = load16(value + 48);
      for (int64_t j = 0; j < BLOCK; ++j) {
        const __m512 weight = _mm512_set1_ps(weights[(r + j) * count + c]);
        o0[j] = _mm512_fmadd_ps(weight, v0, o0[j]), o1[j] = _mm512_fmadd_ps(weight, v1, o1[j]);
        o2[j] = _mm512_fmadd_ps(weight, v2, o2[j]), o3[j] = _mm512_fmadd_ps(weight, v3, o3[j]);
      }
    }
    for (int64_t j = 0; j < BLOCK; ++j) {
      float* into = out + (r + j) * 64;
      _mm512_storeu_ps(into, o0[j]), _mm512_storeu_ps(into + 16, o1[j]);
      _mm512_storeu_ps(into + 32, o2[j]), _mm512_storeu_ps(into + 48, o3[j]);
    }
  }
}
#endif

template <typename T>
void attend(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask,
            const at::Tensor& first, double scale, at::Tensor& out) {
  const int64_t batch = query.size(0), heads = query.size(1), news = query.size(2), dim = query.size(3);
  const int64_t kv_heads = keys.size(1), columns = keys.size(2), group = heads / kv_heads;
  const int64_t rows = group * news;  // the queries that share one KV head of one row
  const T* q = query.data_ptr<T>();
  const T* k = keys.data_ptr<T>();
  const T* v = values.data_ptr<T>();
  const T* m = mask.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t* starts = first.data_ptr<int64_t>();
  const auto qs = query.strides(), ks = keys.strides(), vs = values.strides(), ms = mask.strides();
  const auto os = out.strides();
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
#ifdef __AVX512F__
    const bool wide = dim == 64;  // rows rounded up to whole blocks: the extra ones weighed, never written
    const int64_t held = (rows + BLOCK - 1) / BLOCK * BLOCK;
#else
    const bool wide = false;
    const int64_t held = rows;
#endif
    std::vector<float> queries(rows * dim), scores, sums(rows), weighed(held * dim), row(dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      const int64_t start = starts[b], count = columns - start;
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t i = 0; i < news; ++i) {
          float* into = &queries[(g * news + i) * dim];
          load(q + b * qs[0] + (h * group + g) * qs[1] + i * qs[2], into, dim);
          for (int64_t d = 0; d < dim; ++d) into[d] *= static_cast<float>(scale);
        }
      }
      scores.resize(held * count);
      const T* key = k + b * ks[0] + h * ks[1] + start * ks[2];
      const T* value = v + b * vs[0] + h * vs[1] + start * vs[2];
      for (int64_t c = 0; c < std::min(count, AHEAD); ++c) prefetch(value + c * vs[2], dim);  // for `weigh`
      if (wide) {
#ifdef __AVX512F__
        score64(queries.data(), rows, key, ks[2], count, scores.data());
#endif
      } else {
        score(queries.data(), rows, key, ks[2], count, dim, scores.data(), row.data());
      }
      for (int64_t r = 0; r < rows; ++r) {  // softmax over the row's columns, the mask added
        const T* bias = m + b * ms[0] + (r % news) * ms[2] + start * ms[3];
#ifdef __AVX512F__
        sums[r] = ms[3] == 1 ? softmax16(&scores[r * count], bias, count)
                             : softmax(&scores[r * count], bias, ms[3], count);
#else
        sums[r] = softmax(&scores[r * count], bias, ms[3], count);
#endif
      }
      std::fill(weighed.begin(), weighed.end(), 0.f);
      if (wide) {
#ifdef __AVX512F__
        weigh64(scores.data(), held, value, vs[2], count, weighed.data());
#endif
      } else {
        weigh(scores.data(), rows, value, vs[2], count, dim, weighed.data(), row.data());
      }
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t i = 0; i < news; ++i) {
          const int64_t r = g * news + i;
          const float share = sums[r] > 0.f ? 1.f / sums[r] : 0.f;
          T* into = o + b * os[0] + i * os[1] + (h * group + g) * os[2];
          for (int64_t d = 0; d < dim; ++d) into[d] = static_cast<T>(weighed[r * dim + d] * share);
        }
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& mask, const at::Tensor& first, double scale) {
  TORCH_CHECK(query.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && mask.dim() == 4,
              "decode_attention: query, keys, values and mask must be 4-D");
  TORCH_CHECK(query.device().is_cpu(), "decode_attention runs on the CPU");
  TORCH_CHECK(keys.scalar_type() == query.scalar_type() && values.scalar_type() == query.scalar_type() &&
                  mask.scalar_type() == query.scalar_type(),
              "decode_attention: query, keys, values and mask must share one dtype");
  TORCH_CHECK(query.size(1) % keys.size(1) == 0, "decode_attention: ", query.size(1),
              " query heads are not a multiple of ", keys.size(1), " KV heads");
  TORCH_CHECK(query.stride(3) == 1 && keys.stride(3) == 1 && values.stride(3) == 1,
              "decode_attention: the head dimension must be contiguous");
  TORCH_CHECK(mask.size(0) == query.size(0) && mask.size(2) == query.size(2) && mask.size(3) == keys.size(2),
              "decode_attention: mask ", mask.sizes(), " does not match query ", query.sizes(), " and keys ",
              keys.sizes());
  TORCH_CHECK(first.scalar_type() == at::kLong && first.numel() == query.size(0) && first.is_contiguous(),
              "decode_attention: first must hold one int64 column a row");
  const int64_t* starts = first.data_ptr<int64_t>();
  for (int64_t b = 0; b < query.size(0); ++b) {
    TORCH_CHECK(starts[b] >= 0 && starts[b] < keys.size(2), "decode_attention: row ", b, " starts at column ",
                starts[b], " of ", keys.size(2));
  }
  auto out = at::empty({query.size(0), query.size(2), query.size(1), query.size(3)}, query.options());
  if (query.scalar_type() == at::kFloat) {
    attend<float>(query, keys, values, mask, first, scale, out);
  } else if (query.scalar_type() == at::kBFloat16) {
    attend<at::BFloat16>(query, keys, values, mask, first, scale, out);
  } else {
    TORCH_CHECK(false, "decode_attention: float32 or bfloat16, not ", query.scalar_type());
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("decode_attention", &decode_attention);
}
