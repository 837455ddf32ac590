// Runs kernels of kernels.cu on the CPU under HIP-CPU (fibers for threads, shared memory, barriers
// and shuffles emulated; the tensor-core MMA from PTX's fragment table) and compares each with a
// plain C++ reference of the same arithmetic, in f32 and bf16, over shapes with several batch rows,
// GQA, biases, partial RoPE, per-head norms, padding, sliding windows and packed documents. Exits
// non-zero on any mismatch.
#include <hip/hip_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include <algorithm>
using std::max;
using std::min;
#define __shfl_xor_sync(mask, v, o) __shfl_xor(v, o)
#define FT_DYNAMIC_SHARED(type, name) HIP_DYNAMIC_SHARED(type, name)

// The tensor-core MMA (mma.sync.m16n8k16, bf16 in, f32 accumulate) from PTX's fragment table, with
// shuffles: lane 4g + j holds A[g][2j..2j+1], A[g+8][2j..], A[g][2j+8..], A[g+8][2j+8..] and
// B[2j..2j+1][g], B[2j+8..2j+9][g]; lane 4g + q accumulates C[g][2q..2q+1] and C[g+8][2q..2q+1].
#include <cuda_bf16.h>
#define FT_MMA_EMULATED
static float bf_lo(uint32_t w) { return __bfloat162float(__ushort_as_bfloat16(w & 0xffffu)); }
static float bf_hi(uint32_t w) { return __bfloat162float(__ushort_as_bfloat16(w >> 16)); }
static float dot2(uint32_t x, uint32_t y) { return bf_lo(x) * bf_lo(y) + bf_hi(x) * bf_hi(y); }
__device__ void mma_16816(float *c, const uint32_t *a, const uint32_t *b) {
  // HIP-CPU's warps are 64 fibers: a CUDA warp is one half, and __shfl takes a lane of the 64.
  int lane = threadIdx.x & 31, base = (threadIdx.x % 64) & ~31, g = lane >> 2, q = lane & 3;
  float add[4] = {0.f, 0.f, 0.f, 0.f};
  for (int j = 0; j < 4; ++j) {
    uint32_t A[4], B0[2], B1[2];
    for (int r = 0; r < 4; ++r) A[r] = __shfl(a[r], base + 4 * g + j);
    for (int r = 0; r < 2; ++r) {
      B0[r] = __shfl(b[r], base + 4 * (2 * q) + j);
      B1[r] = __shfl(b[r], base + 4 * (2 * q + 1) + j);
    }
    add[0] += dot2(A[0], B0[0]) + dot2(A[2], B0[1]);
    add[1] += dot2(A[0], B1[0]) + dot2(A[2], B1[1]);
    add[2] += dot2(A[1], B0[0]) + dot2(A[3], B0[1]);
    add[3] += dot2(A[1], B1[0]) + dot2(A[3], B1[1]);
  }
  for (int i = 0; i < 4; ++i) c[i] += add[i];
}
#include "../../crates/ferrotune-core/src/cuda/kernels.cu"

// The kernels take the row count as a template argument (one kernel per count).
#define DISPATCH_ROWS(B, LAUNCH) \
  switch (B) {                   \
    case 1: LAUNCH(1); break;    \
    case 2: LAUNCH(2); break;    \
    case 3: LAUNCH(3); break;    \
    case 4: LAUNCH(4); break;    \
    case 5: LAUNCH(5); break;    \
    case 6: LAUNCH(6); break;    \
    case 7: LAUNCH(7); break;    \
    default: LAUNCH(8); break;   \
  }

static std::mt19937 rng(1234);
static int failures = 0;

template <typename T> T to_t(float v);
template <> float to_t<float>(float v) { return v; }
template <> bf16 to_t<bf16>(float v) { return __float2bfloat16(v); }
float from_t(float v) { return v; }
float from_t(bf16 v) { return __bfloat162float(v); }
template <typename T> float rt(float v) { return from_t(to_t<T>(v)); }

template <typename T> std::vector<T> random_vec(size_t n, float scale = 1.f) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<T> v(n);
  for (auto &x : v) x = to_t<T>(d(rng));
  return v;
}

template <typename T> T *dev(const std::vector<T> &h) {
  T *p;
  hipMalloc((void **)&p, h.size() * sizeof(T) + 16);
  hipMemcpy(p, h.data(), h.size() * sizeof(T), hipMemcpyHostToDevice);
  return p;
}

template <typename T> std::vector<float> host(const T *p, size_t n) {
  std::vector<T> h(n);
  hipMemcpy(h.data(), p, n * sizeof(T), hipMemcpyDeviceToHost);
  hipDeviceSynchronize();
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = from_t(h[i]);
  return out;
}

// Relative L2 error ≤ tol.
void check(const char *what, const std::vector<float> &got, const std::vector<float> &want, float tol) {
  double num = 0, den = 0;
  bool finite = true;
  for (size_t i = 0; i < want.size(); ++i) {
    finite &= std::isfinite(got[i]);
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  double rel = std::sqrt(num / (den + 1e-30));
  bool ok = finite && rel <= tol;
  std::printf("%-48s rel %.2e %s\n", what, rel, ok ? "ok" : "FAIL");
  if (!ok) ++failures;
}

// Bit-for-bit equality (−∞ included).
void same(const char *what, const std::vector<float> &got, const std::vector<float> &want) {
  size_t diff = 0;
  for (size_t i = 0; i < want.size(); ++i) diff += std::memcmp(&got[i], &want[i], sizeof(float)) != 0;
  std::printf("%-48s %zu of %zu differ %s\n", what, diff, want.size(), diff ? "FAIL" : "ok");
  if (diff) ++failures;
}

template <typename T> float tol() { return sizeof(T) == 4 ? 1e-5f : 1e-2f; }

template <typename T> void test_gemv(int B, int K, int n0, int n1, int n2, bool bias, bool residual) {
  auto x = random_vec<T>((size_t)B * K);
  std::vector<std::vector<T>> w, bs;
  int ns[3] = {n0, n1, n2};
  int N = n0 + n1 + n2;
  for (int s = 0; s < 3; ++s) {
    w.push_back(random_vec<T>((size_t)ns[s] * K, 0.05f));
    bs.push_back(random_vec<T>(ns[s] ? ns[s] : 1));
  }
  auto res = random_vec<T>((size_t)B * N);
  std::vector<float> want((size_t)B * N);
  for (int b = 0; b < B; ++b) {
    int r = 0;
    for (int s = 0; s < 3; ++s)
      for (int i = 0; i < ns[s]; ++i, ++r) {
        float acc = 0;
        for (int k = 0; k < K; ++k) acc += from_t(w[s][(size_t)i * K + k]) * from_t(x[(size_t)b * K + k]);
        float v = rt<T>(acc);
        if (bias) v = rt<T>(v + from_t(bs[s][i]));
        if (residual) v = rt<T>(v + from_t(res[(size_t)b * N + r]));
        want[(size_t)b * N + r] = v;
      }
  }
  T *dx = dev(x), *dres = dev(res), *dout = dev(std::vector<T>((size_t)B * N));
  T *dw[3], *db[3];
  for (int s = 0; s < 3; ++s) {
    dw[s] = dev(w[s]);
    db[s] = bias ? dev(bs[s]) : nullptr;
  }
#define LAUNCH(NB)                                                                                  \
  hipLaunchKernelGGL((dec_gemv<T, NB>), dim3((N + 7) / 8), dim3(256), 0, 0, dx, K, dw[0], db[0], n0, \
                     dw[1], db[1], n1, dw[2], db[2], n2, residual ? dres : nullptr, dout)
  DISPATCH_ROWS(B, LAUNCH);
#undef LAUNCH
  char name[128];
  std::snprintf(name, sizeof name, "gemv %s B%d K%d N%d+%d+%d%s%s", sizeof(T) == 4 ? "f32" : "bf16", B,
                K, n0, n1, n2, bias ? " bias" : "", residual ? " residual" : "");
  check(name, host(dout, (size_t)B * N), want, tol<T>());
}

template <typename T> void test_gated(int B, int K, int N, int act, bool bias) {
  auto x = random_vec<T>((size_t)B * K);
  auto wg = random_vec<T>((size_t)N * K, 0.05f), wu = random_vec<T>((size_t)N * K, 0.05f);
  auto bg = random_vec<T>(N, 0.5f), bu = random_vec<T>(N, 0.5f);
  std::vector<float> want((size_t)B * N);
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < N; ++r) {
      float g = 0, u = 0;
      for (int k = 0; k < K; ++k) {
        g += from_t(wg[(size_t)r * K + k]) * from_t(x[(size_t)b * K + k]);
        u += from_t(wu[(size_t)r * K + k]) * from_t(x[(size_t)b * K + k]);
      }
      g = rt<T>(g);
      u = rt<T>(u);
      if (bias) {
        g = rt<T>(g + from_t(bg[r]));
        u = rt<T>(u + from_t(bu[r]));
      }
      float a = act == 0 ? g / (1 + std::exp(-g))
                : act == 1 ? 0.5f * g * (1 + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)))
                           : 0.5f * g * (1 + std::erf(g * 0.7071067811865476f));
      want[(size_t)b * N + r] = rt<T>(rt<T>(a) * u);
    }
  T *dx = dev(x), *dg = dev(wg), *du = dev(wu), *dout = dev(std::vector<T>((size_t)B * N));
  T *dbg = bias ? dev(bg) : nullptr, *dbu = bias ? dev(bu) : nullptr;
#define LAUNCH(NB)                                                                                  \
  hipLaunchKernelGGL((dec_gated_gemv<T, NB>), dim3((N + 7) / 8), dim3(256), 0, 0, dx, K, dg, dbg, du, \
                     dbu, N, dout, act)
  DISPATCH_ROWS(B, LAUNCH);
#undef LAUNCH
  char name[128];
  std::snprintf(name, sizeof name, "gated gemv %s B%d K%d N%d act%d%s", sizeof(T) == 4 ? "f32" : "bf16", B, K,
                N, act, bias ? " bias" : "");
  check(name, host(dout, (size_t)B * N), want, tol<T>());
}

template <typename T>
void test_qkv_rope(int B, int nh, int nkv, int hd, int rot, bool norms, int offset_one, int cap, int pos,
                   bool counters = false) {
  int width = (nh + 2 * nkv) * hd;
  auto qkv = random_vec<T>((size_t)B * width);
  auto cs = random_vec<T>((size_t)B * rot), sn = random_vec<T>((size_t)B * rot);
  auto qn = random_vec<T>(hd), kn = random_vec<T>(hd);
  auto kc = random_vec<T>((size_t)B * nkv * cap * hd), vc = random_vec<T>((size_t)B * nkv * cap * hd);
  float eps = 1e-6f;
  std::vector<float> want_q((size_t)B * nh * hd), want_k(kc.size()), want_v(vc.size());
  for (size_t i = 0; i < kc.size(); ++i) {
    want_k[i] = from_t(kc[i]);
    want_v[i] = from_t(vc[i]);
  }
  for (int b = 0; b < B; ++b)
    for (int head = 0; head < nh + 2 * nkv; ++head) {
      std::vector<float> v(hd);
      for (int d = 0; d < hd; ++d) v[d] = from_t(qkv[(size_t)b * width + (size_t)head * hd + d]);
      if (head >= nh + nkv) {
        for (int d = 0; d < hd; ++d)
          want_v[(((size_t)b * nkv + head - nh - nkv) * cap + pos) * hd + d] = v[d];
        continue;
      }
      if (norms) {
        const auto &w = head < nh ? qn : kn;
        float ss = 0;
        for (float e : v) ss += e * e;
        float r = 1.f / std::sqrt(ss / hd + eps);
        for (int d = 0; d < hd; ++d) {
          float xn = v[d] * r, wj = from_t(w[d]);
          v[d] = rt<T>(offset_one ? xn * (1 + wj) : rt<T>(xn) * wj);
        }
      }
      for (int d = 0; d < hd; ++d) {
        float y = v[d];
        int half = rot / 2;
        if (d < rot) {
          float c = from_t(cs[(size_t)b * rot + d]), s = from_t(sn[(size_t)b * rot + d]);
          y = d < half ? v[d] * c - v[d + half] * s : v[d] * c + v[d - half] * s;
        }
        y = rt<T>(y);
        if (head < nh)
          want_q[((size_t)b * nh + head) * hd + d] = y;
        else
          want_k[(((size_t)b * nkv + head - nh) * cap + pos) * hd + d] = y;
      }
    }
  T *dqkv = dev(qkv), *dcs = dev(cs), *dsn = dev(sn), *dqn = dev(qn), *dkn = dev(kn);
  T *dq = dev(std::vector<T>((size_t)B * nh * hd)), *dkc = dev(kc), *dvc = dev(vc);
  int threads = (hd + 31) / 32 * 32;
  // With counters (a replayed graph's [slot, len]) the kernel must take the slot from them: the
  // scalar argument is then deliberately wrong.
  uint32_t *dcounters = counters ? dev(std::vector<uint32_t>{(uint32_t)pos, (uint32_t)pos + 1}) : nullptr;
  hipLaunchKernelGGL(dec_qkv_rope<T>, dim3(nh + 2 * nkv, B), dim3(threads), hd * sizeof(float), 0, dqkv,
                     dcs, dsn, norms ? dqn : nullptr, norms ? dkn : nullptr, eps, offset_one, dq, dkc, dvc,
                     nh, nkv, hd, rot, cap, counters ? (pos + 1) % cap : pos, dcounters);
  char name[128];
  std::snprintf(name, sizeof name, "qkv rope %s B%d h%d/%d d%d rot%d%s%s%s", sizeof(T) == 4 ? "f32" : "bf16",
                B, nh, nkv, hd, rot, norms ? " norms" : "", offset_one ? "+1" : "", counters ? " counters" : "");
  check((std::string(name) + " q").c_str(), host(dq, (size_t)B * nh * hd), want_q, tol<T>());
  check((std::string(name) + " k cache").c_str(), host(dkc, kc.size()), want_k, tol<T>());
  check((std::string(name) + " v cache").c_str(), host(dvc, vc.size()), want_v, 0.f);
}

// The decode attention's reference scores of query head h, row b over keys l0 .. len−1 (zeros
// before l0), rounded to T before scaling and softcapped as the kernels do; l0 is the row's first
// key, raised to len − window for a sliding window.
template <typename T>
std::vector<float> ref_scores(const std::vector<T> &q, const std::vector<T> &kc, int b, int h, int nh, int nkv,
                              int hd, int cap, int l0, int len, float scale, float softcap) {
  int kvh = h / (nh / nkv);
  std::vector<float> s(len);
  for (int j = l0; j < len; ++j) {
    float acc = 0;
    for (int d = 0; d < hd; ++d)
      acc += from_t(q[((size_t)b * nh + h) * hd + d]) * from_t(kc[(((size_t)b * nkv + kvh) * cap + j) * hd + d]);
    s[j] = rt<T>(acc) * scale;
    if (softcap > 0.f) s[j] = softcap * std::tanh(s[j] / softcap);
  }
  return s;
}

int first_key(const std::vector<uint32_t> &lo, int b, int len, int window) {
  return window > 0 ? std::max((int)lo[b], len - window) : (int)lo[b];
}

template <typename T>
void test_attention(int B, int nh, int nkv, int hd, int cap, int len, std::vector<uint32_t> lo, int window,
                    float softcap = 0.f, bool counters = false) {
  auto q = random_vec<T>((size_t)B * nh * hd);
  auto kc = random_vec<T>((size_t)B * nkv * cap * hd), vc = random_vec<T>((size_t)B * nkv * cap * hd);
  float scale = 1.f / std::sqrt((float)hd);
  std::vector<float> want((size_t)B * nh * hd);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < nh; ++h) {
      int kvh = h / (nh / nkv);
      int l0 = first_key(lo, b, len, window);
      std::vector<float> s = ref_scores(q, kc, b, h, nh, nkv, hd, cap, l0, len, scale, softcap);
      float m = -INFINITY;
      for (int j = l0; j < len; ++j) m = std::max(m, s[j]);
      float sum = 0;
      for (int j = l0; j < len; ++j) sum += std::exp(s[j] - m);
      for (int j = l0; j < len; ++j) s[j] = rt<T>(std::exp(s[j] - m) * (1.f / sum));
      for (int d = 0; d < hd; ++d) {
        float acc = 0;
        for (int j = l0; j < len; ++j) acc += s[j] * from_t(vc[(((size_t)b * nkv + kvh) * cap + j) * hd + d]);
        want[((size_t)b * nh + h) * hd + d] = rt<T>(acc);
      }
    }
  T *dq = dev(q), *dkc = dev(kc), *dvc = dev(vc);
  uint32_t *dlo = dev(lo);
  // With counters the kernel must read len from them; the scalar argument is then wrong.
  uint32_t *dcounters = counters ? dev(std::vector<uint32_t>{(uint32_t)len - 1, (uint32_t)len}) : nullptr;
  // Both score passes (per thread, shared lanes), each into fresh buffers.
  for (int lanes = 0; lanes < 2; ++lanes) {
    T *dout = dev(std::vector<T>(want.size()));
    float *dsc = dev(std::vector<float>((size_t)B * nh * cap));
    if (lanes)
      hipLaunchKernelGGL((dec_attention<T, true>), dim3(nh, B), dim3(256), (hd + 8 * 256) * sizeof(float), 0, dq,
                         dkc, dvc, dout, dsc, dlo, counters ? cap : len, window, nh, nkv, hd, cap, scale, softcap,
                         dcounters);
    else
      hipLaunchKernelGGL((dec_attention<T, false>), dim3(nh, B), dim3(256), (hd + 8 * 256) * sizeof(float), 0, dq,
                         dkc, dvc, dout, dsc, dlo, counters ? cap : len, window, nh, nkv, hd, cap, scale, softcap,
                         dcounters);
    char name[128];
    std::snprintf(name, sizeof name, "attention%s %s B%d h%d/%d d%d len%d/%d win%d cap%g%s", lanes ? " lanes" : "",
                  sizeof(T) == 4 ? "f32" : "bf16", B, nh, nkv, hd, len, cap, window, softcap,
                  counters ? " counters" : "");
    check(name, host(dout, want.size()), want, tol<T>());
  }
}

// The split attention (dec_attention_part + dec_attention_combine) against the same reference
// as dec_attention's, except that the probabilities are not rounded to T (the split form knows
// them only after the combine). Splits follow the capacity: some may be empty (len << cap) or
// masked out entirely (first keys, window).
template <typename T>
void test_attention_split(int B, int nh, int nkv, int hd, int cap, int len, std::vector<uint32_t> lo, int window,
                          float softcap, int chunk, bool counters) {
  auto q = random_vec<T>((size_t)B * nh * hd);
  auto kc = random_vec<T>((size_t)B * nkv * cap * hd), vc = random_vec<T>((size_t)B * nkv * cap * hd);
  float scale = 1.f / std::sqrt((float)hd);
  std::vector<float> want((size_t)B * nh * hd);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < nh; ++h) {
      int kvh = h / (nh / nkv);
      int l0 = first_key(lo, b, len, window);
      std::vector<float> sf = ref_scores(q, kc, b, h, nh, nkv, hd, cap, l0, len, scale, softcap);
      std::vector<double> s(sf.begin(), sf.end());
      double m = -INFINITY;
      for (int j = l0; j < len; ++j) m = std::max(m, s[j]);
      double sum = 0;
      for (int j = l0; j < len; ++j) sum += std::exp(s[j] - m);
      for (int d = 0; d < hd; ++d) {
        double acc = 0;
        for (int j = l0; j < len; ++j)
          acc += std::exp(s[j] - m) / sum * from_t(vc[(((size_t)b * nkv + kvh) * cap + j) * hd + d]);
        want[((size_t)b * nh + h) * hd + d] = rt<T>((float)acc);
      }
    }
  int splits = (cap + chunk - 1) / chunk;
  T *dq = dev(q), *dkc = dev(kc), *dvc = dev(vc);
  uint32_t *dlo = dev(lo);
  uint32_t *dcounters = counters ? dev(std::vector<uint32_t>{(uint32_t)len - 1, (uint32_t)len}) : nullptr;
  // Both score passes (per thread, shared lanes), each into fresh buffers.
  for (int lanes = 0; lanes < 2; ++lanes) {
    T *dout = dev(std::vector<T>(want.size()));
    float *dsc = dev(std::vector<float>((size_t)B * nh * cap));
    float *dpart = dev(std::vector<float>((size_t)B * nh * splits * (hd + 2)));
    if (lanes)
      hipLaunchKernelGGL((dec_attention_part<T, true>), dim3(nh, B, splits), dim3(256),
                         (hd + 8 * 256) * sizeof(float), 0, dq, dkc, dvc, dpart, dsc, dlo, counters ? cap : len,
                         window, nh, nkv, hd, cap, chunk, scale, softcap, dcounters);
    else
      hipLaunchKernelGGL((dec_attention_part<T, false>), dim3(nh, B, splits), dim3(256),
                         (hd + 8 * 256) * sizeof(float), 0, dq, dkc, dvc, dpart, dsc, dlo, counters ? cap : len,
                         window, nh, nkv, hd, cap, chunk, scale, softcap, dcounters);
    hipLaunchKernelGGL(dec_attention_combine<T>, dim3(nh, B), dim3(128), splits * sizeof(float), 0, dpart, dout, nh,
                       hd, splits);
    char name[160];
    std::snprintf(name, sizeof name, "split attention%s %s B%d h%d/%d d%d len%d/%d chunk%d win%d cap%g%s",
                  lanes ? " lanes" : "", sizeof(T) == 4 ? "f32" : "bf16", B, nh, nkv, hd, len, cap, chunk, window,
                  softcap, counters ? " counters" : "");
    check(name, host(dout, want.size()), want, sizeof(T) == 4 ? 2e-6f : 1e-2f);
  }
}

// The training attention's softmax over one chunk of scores (attn_softmax: forward and
// recompute) and the softcapped backward (attn_softcap_bwd), against a float reference: b · nkv
// blocks of g · C rows (query rows r0 .. r0 + C of g heads), L keys from key ks of s, an additive
// mask [b, t, s] with masked (−inf) entries, Gemma 2's softcap when cap > 0.
template <typename T> void test_attn_softmax(int L, float cap) {
  int b = 2, nkv = 2, g = 2, C = 5, r0 = 3, t = 9, ks = 2, s = L + 4;
  int rows = g * C;
  long n = (long)b * nkv * rows * L;
  float scale = 0.3f;
  auto S = random_vec<T>(n);
  std::vector<float> mask((size_t)b * t * s);
  for (size_t i = 0; i < mask.size(); ++i) mask[i] = (i * 7919) % 5 == 0 ? -INFINITY : 0.25f * ((i * 31) % 7);
  auto score = [&](float raw) {
    float x = raw * scale;
    return cap > 0.f ? cap * std::tanh(x / cap) : x;
  };
  std::vector<float> want_p(n), stats(2 * (size_t)b * nkv * rows), want_ds(n);
  auto dP = random_vec<T>(n);
  std::vector<float> D((size_t)b * nkv * rows);
  for (size_t i = 0; i < D.size(); ++i) D[i] = 0.1f * (float)((i * 13) % 9) - 0.4f;
  for (long bh = 0; bh < b * nkv; ++bh)
    for (int rr = 0; rr < rows; ++rr) {
      long bi = bh / nkv;
      int tq = r0 + rr % C;
      const float *mrow = &mask[(size_t)bi * t * s + (size_t)tq * s + ks];
      long off = (bh * rows + rr) * (long)L;
      float m = -INFINITY;
      for (int j = 0; j < L; ++j) m = std::max(m, score(from_t(S[off + j])) + mrow[j]);
      double sum = 0;
      for (int j = 0; j < L; ++j) sum += std::exp(score(from_t(S[off + j])) + mrow[j] - m);
      float inv = 1.f / (float)sum;
      stats[2 * (bh * rows + rr)] = m;
      stats[2 * (bh * rows + rr) + 1] = inv;
      for (int j = 0; j < L; ++j) {
        float raw = from_t(S[off + j]);
        float p = std::exp(score(raw) + mrow[j] - m) * inv;
        want_p[off + j] = rt<T>(p);
        float th = cap > 0.f ? std::tanh(raw * scale / cap) : 0.f;
        want_ds[off + j] = rt<T>(p * (from_t(dP[off + j]) - D[bh * rows + rr]) * (1 - th * th) * scale);
      }
    }
  float *dmask = dev(mask), *dstats = dev(std::vector<float>(stats.size())), *dD = dev(D);
  char name[128];
  for (int recompute = 0; recompute < 2; ++recompute) {
    T *dS = dev(S);
    if (recompute) dstats = dev(stats);
    hipLaunchKernelGGL(attn_softmax<T>, dim3(rows, b * nkv), dim3(256), 0, 0, dS, dstats, dmask, rows, L, C, r0,
                       ks, nkv, s, (long)t * s, scale, recompute, cap);
    std::snprintf(name, sizeof name, "attn softmax %s L%d cap%g%s", sizeof(T) == 4 ? "f32" : "bf16", L, cap,
                  recompute ? " recompute" : "");
    check(name, host(dS, n), want_p, tol<T>());
    if (!recompute) {
      std::vector<float> got(stats.size());
      hipMemcpy(got.data(), dstats, got.size() * sizeof(float), hipMemcpyDeviceToHost);
      check((std::string(name) + " stats").c_str(), got, stats, 1e-5f);
    }
  }
  if (cap > 0.f) {
    T *dS = dev(S), *ddP = dev(dP);
    float *dst = dev(stats);
    hipLaunchKernelGGL(attn_softcap_bwd<T>, dim3(rows, b * nkv), dim3(256), 0, 0, dS, ddP, dst, dD, dmask, rows,
                       L, C, r0, ks, nkv, s, (long)t * s, scale, cap);
    std::snprintf(name, sizeof name, "attn softcap bwd %s L%d cap%g", sizeof(T) == 4 ? "f32" : "bf16", L, cap);
    check((std::string(name) + " P").c_str(), host(dS, n), want_p, tol<T>());
    check((std::string(name) + " dS").c_str(), host(ddP, n), want_ds, tol<T>());
  }
}

// The training kernels' RMSNorm forward (block_sum, shared by every row-wise kernel).
template <typename T> void test_rmsnorm(int rows, int h, int offset_one, int threads = 256) {
  auto x = random_vec<T>((size_t)rows * h), w = random_vec<T>(h);
  float eps = 1e-5f;
  std::vector<float> want((size_t)rows * h);
  for (int r = 0; r < rows; ++r) {
    float ss = 0;
    for (int j = 0; j < h; ++j) ss += from_t(x[(size_t)r * h + j]) * from_t(x[(size_t)r * h + j]);
    float inv = 1.f / std::sqrt(ss / h + eps);
    for (int j = 0; j < h; ++j) {
      float xn = from_t(x[(size_t)r * h + j]) * inv, wj = from_t(w[j]);
      want[(size_t)r * h + j] = rt<T>(offset_one ? xn * (1 + wj) : rt<T>(xn) * wj);
    }
  }
  T *dx = dev(x), *dw = dev(w), *dy = dev(std::vector<T>(want.size()));
  hipLaunchKernelGGL(rmsnorm_fwd<T>, dim3(rows), dim3(threads), 0, 0, dx, dw, dy, h, eps, offset_one);
  char name[128];
  std::snprintf(name, sizeof name, "rmsnorm %s rows%d h%d%s threads%d", sizeof(T) == 4 ? "f32" : "bf16", rows,
                h, offset_one ? " +1" : "", threads);
  check(name, host(dy, want.size()), want, tol<T>());
}

// NF4 expansion: nibble order (first value in the high nibble), block (64) and group (256 blocks)
// indexing, an odd element count; exact.
template <typename T> void test_nf4(long n) {
  long blocks = (n + 63) / 64, groups = (blocks + 255) / 256;
  std::uniform_int_distribution<int> byte(0, 255), q8(-128, 127);
  std::vector<uint8_t> codes((n + 1) / 2);
  for (auto &c : codes) c = (uint8_t)byte(rng);
  std::vector<int8_t> scalers(blocks);
  for (auto &q : scalers) q = (int8_t)q8(rng);
  std::vector<float> factors(groups), levels(16);
  for (auto &f : factors) f = rt<T>(200.f + 50.f * (float)(byte(rng)));
  for (int i = 0; i < 16; ++i) levels[i] = rt<T>(-1.f + i * 0.1333f);
  float mean = rt<T>(0.0371f);
  std::vector<float> want(n);
  for (long e = 0; e < n; ++e) {
    long b = e / 64;
    float scaler = rt<T>(rt<T>((float)scalers[b] / factors[b / 256]) + mean);
    int c = e % 2 == 0 ? codes[e / 2] >> 4 : codes[e / 2] & 15;
    want[e] = rt<T>(levels[c] * scaler);
  }
  uint8_t *dc = dev(codes);
  int8_t *ds = dev(scalers);
  float *df = dev(factors), *dl = dev(levels);
  T *dout = dev(std::vector<T>(n));
  hipLaunchKernelGGL(nf4_dequant<T>, dim3(7), dim3(64), 0, 0, dc, ds, df, dl, mean, dout, n);
  char name[128];
  std::snprintf(name, sizeof name, "nf4 %s n%ld", sizeof(T) == 4 ? "f32" : "bf16", n);
  check(name, host(dout, n), want, 0.f);
}

// Host forms of the kernels' activations (act codes as in kernels.cu: 0 SiLU, 1 GELU tanh, 2 GELU).
float host_act(float x, int act) {
  if (act == 0) return x / (1.f + std::exp(-x));
  if (act == 1) return 0.5f * x * (1.f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
  return 0.5f * x * (1.f + std::erf(x * 0.7071067811865476f));
}
float host_act_grad(float x, int act) {
  if (act == 0) {
    float s = 1.f / (1.f + std::exp(-x));
    return s * (1.f + x * (1.f - s));
  }
  if (act == 1) {
    float k = 0.7978845608028654f * (x + 0.044715f * x * x * x), t = std::tanh(k);
    return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * 0.7978845608028654f * (1.f + 3.f * 0.044715f * x * x);
  }
  return 0.5f * (1.f + std::erf(x * 0.7071067811865476f)) + x * 0.3989422804014327f * std::exp(-0.5f * x * x);
}

// Gated activation forward and backward over n elements, `skew` elements into the buffers (an
// odd skew leaves them unaligned: the scalar path), on the grid the launcher sends.
template <typename T> void test_glu(long n, int act, int skew) {
  auto g = random_vec<T>(n + skew), u = random_vec<T>(n + skew), dy = random_vec<T>(n + skew);
  std::vector<float> y(n), dg(n), du(n);
  for (long i = 0; i < n; ++i) {
    float gv = from_t(g[i + skew]), uv = from_t(u[i + skew]), d = from_t(dy[i + skew]);
    y[i] = rt<T>(rt<T>(host_act(gv, act)) * uv);
    du[i] = rt<T>(d * rt<T>(host_act(gv, act)));
    dg[i] = rt<T>(d * uv * host_act_grad(gv, act));
  }
  T *dgp = dev(g), *dup = dev(u), *ddy = dev(dy);
  T *dy_out = dev(std::vector<T>(n + skew)), *ddg = dev(std::vector<T>(n + skew)), *ddu = dev(std::vector<T>(n + skew));
  long threads = skew % 8 ? n : (n + 7) / 8;
  dim3 grid((unsigned)((threads + 255) / 256));
  hipLaunchKernelGGL(glu_fwd<T>, grid, dim3(256), 0, 0, dgp + skew, dup + skew, dy_out + skew, n, act);
  hipLaunchKernelGGL(glu_bwd<T>, grid, dim3(256), 0, 0, dgp + skew, dup + skew, ddy + skew, ddg + skew, ddu + skew, n,
                     act);
  char name[128];
  const char *ty = sizeof(T) == 4 ? "f32" : "bf16";
  std::snprintf(name, sizeof name, "glu fwd %s n%ld act%d skew%d", ty, n, act, skew);
  check(name, host(dy_out + skew, n), y, tol<T>());
  std::snprintf(name, sizeof name, "glu bwd dg %s n%ld act%d skew%d", ty, n, act, skew);
  check(name, host(ddg + skew, n), dg, tol<T>());
  std::snprintf(name, sizeof name, "glu bwd du %s n%ld act%d skew%d", ty, n, act, skew);
  check(name, host(ddu + skew, n), du, tol<T>());
}

// RoPE forward or backward over x [b, heads, t, d], stored contiguously or as the transposed
// projection [b, t, heads, d]; cos/sin [cb, t, rot]; on the grid the launcher sends.
template <typename T>
void test_rope(int b, int heads, int t, int d, int rot, int cb, int backward, bool transposed) {
  long n = (long)b * heads * t * d;
  auto x = random_vec<T>(n), cs = random_vec<T>((size_t)cb * t * rot), sn = random_vec<T>((size_t)cb * t * rot);
  long sb = (long)heads * t * d, sh = transposed ? d : (long)t * d, st_ = transposed ? (long)heads * d : d;
  int half = rot / 2;
  std::vector<float> want(n);
  for (int bi = 0; bi < b; ++bi)
    for (int hi = 0; hi < heads; ++hi)
      for (int tq = 0; tq < t; ++tq)
        for (int col = 0; col < d; ++col) {
          const T *xr = x.data() + bi * sb + hi * sh + tq * st_;
          long e = (((long)bi * heads + hi) * t + tq) * d + col;
          if (col >= rot) {
            want[e] = from_t(xr[col]);
            continue;
          }
          long base = (cb > 1 ? bi : 0) * (long)t * rot + (long)tq * rot;
          float xv = from_t(xr[col]), c = from_t(cs[base + col]);
          int pcol = col < half ? col + half : col - half;
          float p = from_t(xr[pcol]), s = from_t(sn[base + (backward ? pcol : col)]);
          bool minus = (col < half) != (bool)backward;
          want[e] = rt<T>(minus ? xv * c - p * s : xv * c + p * s);
        }
  T *dx = dev(x), *dcs = dev(cs), *dsn = dev(sn), *dout = dev(std::vector<T>(n));
  bool vector = d % 8 == 0 && rot % 16 == 0 && sb % 8 == 0 && sh % 8 == 0 && st_ % 8 == 0;
  long threads = vector ? n / 8 : n;
  hipLaunchKernelGGL(rope<T>, dim3((unsigned)((threads + 255) / 256)), dim3(256), 0, 0, dx, dcs, dsn, dout, n, heads,
                     t, d, rot, cb > 1 ? 1 : 0, backward, sb, sh, st_);
  char name[128];
  std::snprintf(name, sizeof name, "rope %s b%d h%d t%d d%d rot%d cb%d %s%s", sizeof(T) == 4 ? "f32" : "bf16", b,
                heads, t, d, rot, cb, backward ? "bwd" : "fwd", transposed ? " transposed" : "");
  check(name, host(dout, n), want, tol<T>());
}

// The training flash-attention forward (bf16) against attention in f32 over the same keys: q
// [b, nh, t, D], k/v [b, nkv, s, D], an additive mask [b, t, s] (causal with the queries at the
// end of the keys, `pad` leading keys of batch row 1 masked, packed documents of length `doc`;
// masked entries `masked`), each 64-row block's key range found as the host finds it (or every
// key, `full_range`).
template <int D>
void test_flash(int b, int nh, int nkv, int t, int s, bool use_mask, int pad, int doc, float masked, float softcap,
                bool full_range) {
  auto q = random_vec<bf16>((size_t)b * nh * t * D), k = random_vec<bf16>((size_t)b * nkv * s * D),
       v = random_vec<bf16>((size_t)b * nkv * s * D);
  std::vector<float> mask((size_t)b * t * s, 0.f);
  for (int bi = 0; bi < b; ++bi)
    for (int r = 0; r < t; ++r)
      for (int j = 0; j < s; ++j) {
        int qpos = s - t + r;
        bool m = j > qpos || (bi == 1 && j < pad) || (doc > 0 && j / doc != qpos / doc);
        if (m) mask[((size_t)bi * t + r) * s + j] = masked;
      }
  int blocks = (t + 63) / 64;
  std::vector<int> range(2 * blocks);
  for (int qb = 0; qb < blocks; ++qb) {
    int first = s, last = 0;
    for (int bi = 0; bi < b; ++bi)
      for (int r = qb * 64; r < std::min(t, qb * 64 + 64); ++r) {
        int f = -1, l = -1;
        for (int j = 0; j < s; ++j)
          if (!use_mask || mask[((size_t)bi * t + r) * s + j] > -1e30f) {
            if (f < 0) f = j;
            l = j + 1;
          }
        if (f < 0) f = 0, l = s;  // a row that sees no key keeps them all
        first = std::min(first, f);
        last = std::max(last, l);
      }
    range[2 * qb] = full_range ? 0 : first;
    range[2 * qb + 1] = full_range ? s : last;
  }
  float scale = 1.f / std::sqrt((float)D);
  int g = nh / nkv;
  std::vector<float> want_o((size_t)b * nh * t * D), want_st((size_t)b * nh * t * 2);
  std::vector<float> logits((size_t)b * nh * t * s), tanhs((size_t)b * nh * t * s);
  for (int bi = 0; bi < b; ++bi)
    for (int h = 0; h < nh; ++h)
      for (int r = 0; r < t; ++r) {
        int qb = r / 64;
        std::vector<float> x(s, -INFINITY);
        float m = -INFINITY;
        for (int j = range[2 * qb]; j < range[2 * qb + 1]; ++j) {
          float acc = 0;
          for (int d = 0; d < D; ++d)
            acc += from_t(q[(((size_t)bi * nh + h) * t + r) * D + d]) *
                   from_t(k[(((size_t)bi * nkv + h / g) * s + j) * D + d]);
          float y = acc * scale;
          if (softcap > 0) {
            tanhs[(((size_t)bi * nh + h) * t + r) * s + j] = std::tanh(y / softcap);
            y = softcap * std::tanh(y / softcap);
          }
          x[j] = y + (use_mask ? mask[((size_t)bi * t + r) * s + j] : 0.f);
          m = std::max(m, x[j]);
        }
        double sum = 0;
        for (int j = 0; j < s; ++j) sum += m == -INFINITY ? 0.0 : std::exp((double)x[j] - m);
        float inv = m == -INFINITY ? 0.f : (float)(1.0 / sum);
        size_t row = ((size_t)bi * nh + h) * t + r;
        for (int j = 0; j < s; ++j) logits[row * s + j] = x[j];
        want_st[2 * row] = m;
        want_st[2 * row + 1] = inv;
        for (int d = 0; d < D; ++d) {
          double acc = 0;
          for (int j = 0; j < s; ++j)
            if (m != -INFINITY) acc += std::exp((double)x[j] - m) * inv * from_t(v[(((size_t)bi * nkv + h / g) * s + j) * D + d]);
          want_o[row * D + d] = (float)acc;
        }
      }
  bf16 *dq = dev(q), *dk = dev(k), *dv = dev(v), *dout = dev(std::vector<bf16>((size_t)b * nh * t * D));
  float *dmask = use_mask ? dev(mask) : nullptr, *dst = dev(std::vector<float>((size_t)b * nh * t * 2));
  int *drange = dev(range);
  const FlashMask fmask = {dmask, (long)t * s, nullptr, 0.f};
  hipLaunchKernelGGL(flash_fwd<D>, dim3(blocks, b * nh), dim3(FA_THREADS), 0, 0, dq, dk, dv, fmask, drange, t, s,
                     nh, nkv, scale, softcap, dout, dst);
  // The maxima where a key has a finite score, and every 1 / Σexp.
  auto st = host(dst, (size_t)b * nh * t * 2);
  std::vector<float> got_m, want_m, got_inv, want_inv;
  for (size_t r = 0; r < st.size() / 2; ++r) {
    if (want_st[2 * r] > -1e30f) {
      got_m.push_back(st[2 * r]);
      want_m.push_back(want_st[2 * r]);
    } else if (st[2 * r] > -1e30f) {
      got_m.push_back(1.f);  // a finite max where the reference has −∞ (or −3e38): a failure
      want_m.push_back(0.f);
    }
    got_inv.push_back(st[2 * r + 1]);
    want_inv.push_back(want_st[2 * r + 1]);
  }
  char name[160];
  std::snprintf(name, sizeof name, "flash D%d b%d h%d/%d t%d s%d%s pad%d doc%d cap%.1f%s", D, b, nh, nkv, t, s,
                use_mask ? (masked == -INFINITY ? " mask(-inf)" : " mask") : "", pad, doc, softcap,
                full_range ? " all keys" : "");
  check(name, host(dout, (size_t)b * nh * t * D), want_o, 1e-2f);
  size_t len = std::strlen(name);
  std::snprintf(name + len, sizeof name - len, " max");
  check(name, got_m, want_m, 1e-5f);
  std::snprintf(name + len, sizeof name - len, " 1/sum");
  check(name, got_inv, want_inv, 1e-5f);
  auto o_got = host(dout, (size_t)b * nh * t * D);
  auto dO = random_vec<bf16>((size_t)b * nh * t * D);
  std::vector<float> drow((size_t)b * nh * t);
  for (size_t r = 0; r < drow.size(); ++r) {
    float acc = 0;
    for (int d = 0; d < D; ++d) acc += from_t(dO[r * D + d]) * o_got[r * D + d];
    drow[r] = acc;
  }
  std::vector<double> want_dq((size_t)b * nh * t * D), want_dk((size_t)b * nkv * s * D), want_dv((size_t)b * nkv * s * D);
  for (int bi = 0; bi < b; ++bi)
    for (int h = 0; h < nh; ++h)
      for (int r = 0; r < t; ++r) {
        size_t row = ((size_t)bi * nh + h) * t + r;
        float m = want_st[2 * row], inv = want_st[2 * row + 1];
        if (m == -INFINITY) continue;
        int qb = r / 64;
        for (int j = range[2 * qb]; j < range[2 * qb + 1]; ++j) {
          size_t kv = ((size_t)bi * nkv + h / g) * s + j;
          double p = std::exp((double)logits[row * s + j] - m) * inv, dp = 0;
          for (int d = 0; d < D; ++d) dp += from_t(dO[row * D + d]) * from_t(v[kv * D + d]);
          double ds = p * (dp - drow[row]) * scale;
          if (softcap > 0) ds *= 1.0 - (double)tanhs[row * s + j] * tanhs[row * s + j];
          for (int d = 0; d < D; ++d) {
            want_dq[row * D + d] += ds * from_t(k[kv * D + d]);
            want_dk[kv * D + d] += ds * from_t(q[row * D + d]);
            want_dv[kv * D + d] += p * from_t(dO[row * D + d]);
          }
        }
      }
  bf16 *ddo = dev(dO), *ddq = dev(std::vector<bf16>((size_t)b * nh * t * D));
  float *ddrow = dev(drow), *ddk = dev(std::vector<float>((size_t)b * nkv * s * D)),
        *ddv = dev(std::vector<float>((size_t)b * nkv * s * D));
  int smem = (4 * 64 * (D / 2 + 4) + 5 * 64) * 4;
  hipLaunchKernelGGL(flash_bwd_dkdv<D>, dim3((s + 63) / 64, b * nh), dim3(FA_THREADS), smem, 0, dq, dk, dv, ddo, dst,
                     ddrow, fmask, drange, t, s, nh, nkv, scale, softcap, ddk, ddv);
  hipLaunchKernelGGL(flash_bwd_dq<D>, dim3(blocks, b * nh), dim3(FA_THREADS), 0, 0, dq, dk, dv, ddo, dst, ddrow,
                     fmask, drange, t, s, nh, nkv, scale, softcap, ddq);
  auto to_f = [](const std::vector<double> &x) { return std::vector<float>(x.begin(), x.end()); };
  name[len] = 0;
  std::snprintf(name + len, sizeof name - len, " dq");
  check(name, host(ddq, (size_t)b * nh * t * D), to_f(want_dq), 1e-2f);
  std::snprintf(name + len, sizeof name - len, " dk");
  check(name, host(ddk, (size_t)b * nkv * s * D), to_f(want_dk), 1e-2f);
  std::snprintf(name + len, sizeof name - len, " dv");
  check(name, host(ddv, (size_t)b * nkv * s * D), to_f(want_dv), 1e-2f);
  if (!use_mask) return;
  // The same mask as each row's interval of visible keys (every row here sees one interval, or
  // none: an empty one), as the host passes it when it finds the mask so: the same results,
  // bit for bit (dK and dV up to the order of their atomic adds).
  std::vector<int> row_keys(2 * (size_t)b * t, 0);
  for (int bi = 0; bi < b; ++bi)
    for (int r = 0; r < t; ++r) {
      int f = -1, l = 0;
      for (int j = 0; j < s; ++j)
        if (mask[((size_t)bi * t + r) * s + j] > -1e30f) {
          if (f < 0) f = j;
          l = j + 1;
        }
      row_keys[2 * ((size_t)bi * t + r)] = f < 0 ? 0 : f;
      row_keys[2 * ((size_t)bi * t + r) + 1] = l;
    }
  const FlashMask fkeys = {nullptr, (long)t * s, dev(row_keys), masked};
  bf16 *iout = dev(std::vector<bf16>((size_t)b * nh * t * D)), *idq = dev(std::vector<bf16>((size_t)b * nh * t * D));
  float *ist = dev(std::vector<float>((size_t)b * nh * t * 2)), *idk = dev(std::vector<float>((size_t)b * nkv * s * D)),
        *idv = dev(std::vector<float>((size_t)b * nkv * s * D));
  hipLaunchKernelGGL(flash_fwd<D>, dim3(blocks, b * nh), dim3(FA_THREADS), 0, 0, dq, dk, dv, fkeys, drange, t, s,
                     nh, nkv, scale, softcap, iout, ist);
  hipLaunchKernelGGL(flash_bwd_dkdv<D>, dim3((s + 63) / 64, b * nh), dim3(FA_THREADS), smem, 0, dq, dk, dv, ddo, ist,
                     ddrow, fkeys, drange, t, s, nh, nkv, scale, softcap, idk, idv);
  hipLaunchKernelGGL(flash_bwd_dq<D>, dim3(blocks, b * nh), dim3(FA_THREADS), 0, 0, dq, dk, dv, ddo, ist, ddrow,
                     fkeys, drange, t, s, nh, nkv, scale, softcap, idq);
  name[len] = 0;
  std::snprintf(name + len, sizeof name - len, " intervals");
  same(name, host(iout, (size_t)b * nh * t * D), host(dout, (size_t)b * nh * t * D));
  std::snprintf(name + len, sizeof name - len, " intervals stats");
  same(name, host(ist, (size_t)b * nh * t * 2), st);
  std::snprintf(name + len, sizeof name - len, " intervals dq");
  same(name, host(idq, (size_t)b * nh * t * D), host(ddq, (size_t)b * nh * t * D));
  std::snprintf(name + len, sizeof name - len, " intervals dk");
  check(name, host(idk, (size_t)b * nkv * s * D), host(ddk, (size_t)b * nkv * s * D), 1e-6f);
  std::snprintf(name + len, sizeof name - len, " intervals dv");
  check(name, host(idv, (size_t)b * nkv * s * D), host(ddv, (size_t)b * nkv * s * D), 1e-6f);
}

template <typename T> void all() {
  test_nf4<T>(64 * 256 * 2 + 64 * 3 + 17);
  test_nf4<T>(4096);
  test_glu<T>(4096 + 5, 0, 0);
  test_glu<T>(1000, 1, 0);
  test_glu<T>(999, 2, 1);
  test_rope<T>(2, 3, 5, 64, 64, 1, 0, false);
  test_rope<T>(2, 3, 5, 64, 64, 2, 1, true);
  test_rope<T>(1, 2, 7, 128, 32, 1, 0, true);   // partial rotary (Phi): copied tail
  test_rope<T>(1, 2, 7, 128, 32, 1, 1, false);
  test_rope<T>(2, 2, 3, 40, 24, 2, 0, false);   // rot/2 not a multiple of 8: the scalar path
  test_rope<T>(1, 2, 3, 36, 36, 1, 1, true);    // d not a multiple of 8: the scalar path
  test_rmsnorm<T>(3, 1000, 0);
  test_rmsnorm<T>(2, 96, 1);
  test_rmsnorm<T>(1, 4096, 0);   // a decode row: the vector path
  test_rmsnorm<T>(2, 1004, 1);   // h not a multiple of 8: the scalar loop
  test_rmsnorm<T>(2, 16392, 0);  // wider than the vector path holds: the scalar loop
  test_rmsnorm<T>(1, 12288, 1, 768);  // the widest row the launcher sends, with its block
  test_gemv<T>(1, 256, 40, 0, 0, false, false);
  test_gemv<T>(3, 1048, 24, 8, 8, true, false);
  test_gemv<T>(2, 776, 13, 0, 0, false, true);
  test_gemv<T>(8, 520, 9, 0, 0, true, true);
  test_gated<T>(1, 512, 20, 0, false);
  test_gated<T>(3, 264, 11, 1, true);
  test_gated<T>(2, 1032, 5, 2, false);
  test_gated<T>(5, 1024, 9, 0, true);
  test_qkv_rope<T>(1, 4, 2, 64, 64, false, 0, 8, 3);
  test_qkv_rope<T>(3, 6, 2, 48, 32, true, 0, 5, 4);
  test_qkv_rope<T>(2, 2, 1, 128, 128, true, 1, 3, 0);
  test_qkv_rope<T>(2, 4, 2, 64, 64, true, 0, 9, 5, true);
  test_attention<T>(1, 4, 2, 64, 16, 11, {0}, 0);
  test_attention<T>(3, 6, 2, 128, 40, 37, {0, 5, 36}, 0);
  test_attention<T>(2, 4, 4, 256, 24, 24, {2, 0}, 7);
  test_attention<T>(2, 8, 1, 32, 600, 555, {0, 100}, 0);
  test_attention<T>(2, 4, 2, 64, 300, 123, {0, 7}, 0, 0.f, true);
  test_attn_softmax<T>(37, 0.f);
  test_attn_softmax<T>(37, 0.9f);
  test_attn_softmax<T>(4200, 1.3f);
  test_attention_split<T>(1, 4, 2, 64, 1030, 1000, {0}, 0, 0.f, 256, false);
  test_attention_split<T>(2, 8, 2, 128, 1100, 900, {0, 450}, 0, 0.f, 512, true);
  test_attention_split<T>(2, 4, 4, 256, 700, 650, {3, 0}, 100, 0.f, 256, false);
  test_attention_split<T>(2, 4, 2, 32, 2048, 77, {0, 60}, 0, 0.5f, 512, false);
  test_attention_split<T>(1, 6, 3, 96, 1500, 1499, {0}, 700, 0.f, 512, true);
  test_attention_split<T>(1, 4, 2, 128, 4100, 3900, {0}, 0, 0.f, 256, true);  // 17 splits
  test_attention_split<T>(1, 2, 1, 512, 1100, 1050, {0}, 0, 0.f, 256, false);
  test_attention<T>(1, 4, 2, 96, 300, 300, {17}, 40);
  // Head dims past 32 lanes' chunks (Gemma 4's 512: two chunks a lane) and not a power of two
  // (80: 10 of 16 lanes a key).
  test_attention<T>(1, 2, 1, 512, 40, 33, {0}, 0);
  test_attention<T>(2, 4, 2, 80, 50, 47, {0, 3}, 0);
  test_attention<T>(2, 4, 2, 64, 48, 45, {0, 9}, 16, 0.5f);
}

int main(int argc, char **argv) {
  if (!(argc > 1 && std::strcmp(argv[1], "flash") == 0)) {
    all<float>();
    all<bf16>();
  }
  test_flash<64>(2, 4, 2, 70, 70, true, 5, 0, -3e38f, 0.f, false);     // causal, padding, 2 blocks
  test_flash<128>(1, 2, 1, 130, 130, true, 0, 40, -3e38f, 0.f, false); // packed documents, 3 blocks
  test_flash<96>(2, 4, 4, 1, 77, false, 0, 0, 0.f, 0.f, false);       // one row, no mask
  test_flash<64>(2, 2, 1, 20, 150, true, 0, 0, -3e38f, 1.5f, true);   // softcap, every key
  test_flash<64>(2, 2, 2, 9, 9, true, 9, 0, -INFINITY, 0.f, true);    // row 1 sees nothing (−∞)
  test_flash<64>(2, 2, 1, 70, 70, true, 69, 0, -3e38f, 0.f, false);   // rows that see nothing (uniform)
  std::printf("%s: %d failure(s)\n", failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}
