// ferrotune's CUDA kernels: the elementwise and row-wise parts of a decoder layer (RMSNorm, RoPE,
// gated activations, attention softmax, cross-entropy), each with its backward. The GEMMs around
// them stay in cuBLAS (through candle). Every kernel reads and writes T (float or bf16) and computes
// in f32; where transformers rounds an intermediate to the model dtype, the kernel rounds too
// (`round_to<T>`), so bf16 results follow HF's arithmetic.
//
// Compiled to PTX by build.rs (nvcc) when the `cuda` feature is on; launched from src/cuda/*.rs with
// raw device pointers.
#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

// Dynamic shared memory. A macro so that a CPU emulation of the kernels (HIP-CPU, see
// scripts/emulate-kernels.sh) can map it to its own form.
#ifndef FT_DYNAMIC_SHARED
#define FT_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

// Programmatic dependent launch (compute capability 9.0). A kernel the host launches with the
// programmatic-serialization attribute (`launch_dependent` in mod.rs) may start while the kernel
// before it still runs, once every block of that kernel has called pdl_trigger(): until
// pdl_wait() returns (the kernel before has completed and its writes are visible) it must read
// nothing a kernel writes (only weights) and write nothing. The decode step's kernels do both,
// so each one's launch and first weight loads overlap the previous one's tail. Both are no-ops
// on a launch without the attribute, below compute 9.0, and under the CPU emulation.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Asks for the 128-byte line holding p in L2 (no register waits on it).
__device__ __forceinline__ void prefetch_l2(const void *p) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
  (void)p;
#endif
}

__device__ __forceinline__ float ld(const float *p, long i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16 *p, long i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void st(float *p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void st(bf16 *p, long i, float v) { p[i] = __float2bfloat16(v); }

template <typename T> __device__ __forceinline__ float round_to(float v);
template <> __device__ __forceinline__ float round_to<float>(float v) { return v; }
template <> __device__ __forceinline__ float round_to<bf16>(float v) {
  return __bfloat162float(__float2bfloat16(v));
}

// Sum / max over the block (any blockDim.x that is a multiple of 32, at most 1024), returned to
// every thread. Safe to call repeatedly: the leading barrier keeps a later call from overwriting
// per-warp values still being read.
__device__ float block_sum(float v) {
  __shared__ float sh[32];
  int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  __syncthreads();
  if (lane == 0) sh[wid] = v;
  __syncthreads();
  // Every warp reduces the per-warp sums (the same result in each): no warp-divergent shuffle.
  int nw = blockDim.x >> 5;
  v = lane < nw ? sh[lane] : 0.f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}

__device__ float block_max(float v) {
  __shared__ float sh[32];
  int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
  __syncthreads();
  if (lane == 0) sh[wid] = v;
  __syncthreads();
  int nw = blockDim.x >> 5;
  v = lane < nw ? sh[lane] : -INFINITY;
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
  return v;
}

// 8 elements as loaded (read-only path), unpacked to floats only when used: bf16 chunks stay 4
// registers each while several are in flight. For data written by an earlier kernel or never
// written on the device (weights); not for data this kernel writes.
template <typename T> struct Pack8;
template <> struct Pack8<bf16> {
  uint4 v;
  __device__ __forceinline__ void load(const bf16 *p) { v = __ldg(reinterpret_cast<const uint4 *>(p)); }
  __device__ __forceinline__ void unpack(float *f) const {
    const bf16 *h = reinterpret_cast<const bf16 *>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = __bfloat162float(h[i]);
  }
};
template <> struct Pack8<float> {
  float4 a, b;
  __device__ __forceinline__ void load(const float *p) {
    a = __ldg(reinterpret_cast<const float4 *>(p));
    b = __ldg(reinterpret_cast<const float4 *>(p) + 1);
  }
  __device__ __forceinline__ void unpack(float *f) const {
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
  }
};

// Stores 8 floats as T with 16-byte writes (p 16-byte aligned).
__device__ __forceinline__ void store8(float *p, const float *f) {
  reinterpret_cast<float4 *>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
  reinterpret_cast<float4 *>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
}
__device__ __forceinline__ void store8(bf16 *p, const float *f) {
  uint4 u;
  bf16 *h = reinterpret_cast<bf16 *>(&u);
#pragma unroll
  for (int i = 0; i < 8; ++i) h[i] = __float2bfloat16(f[i]);
  *reinterpret_cast<uint4 *>(p) = u;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm. Forward: one block per row. y = w * round(x * r)   (LlamaRMSNorm: normed.to(dtype) * w)
//                                   y = x * r * (1 + w)        (Gemma, in f32, rounded once)
// with r = 1 / sqrt(mean(x²) + eps).
// One normalized feature scaled by its weight, xn = x · r: round(xn) · w (Llama) or xn · (1 + w)
// (Gemma, rounded once by the caller's store). Shared by rmsnorm_fwd's two paths and the decode
// step's q/k norms, so that all three round alike.
template <typename T> __device__ __forceinline__ float rms_apply(float xn, float w, int offset_one) {
  return offset_one ? xn * (1.f + w) : round_to<T>(xn) * w;
}

// Chunks of 8 elements a thread of rmsnorm_fwd holds in registers on its vector path (few, so
// that many-row launches keep their occupancy; the launcher widens the block for wide rows).
#define RMSNORM_CHUNKS 2

template <typename T>
__device__ void rmsnorm_fwd(const T *x, const T *w, T *y, int h, float eps, int offset_one) {
  pdl_trigger();
  pdl_wait();
  long row = blockIdx.x;
  const T *xr = x + row * h;
  T *yr = y + row * h;
  // Vector path (h a multiple of 8, 16-byte aligned rows, h ≤ 8 · RMSNORM_CHUNKS · blockDim.x):
  // every load of x and w is issued before the first is used, so a row costs one memory round
  // trip. A decode step normalizes one row per block, where the scalar loop below waits for
  // h / blockDim.x loads one after another.
  int chunks = h / 8;
  bool vec = h % 8 == 0 && chunks <= RMSNORM_CHUNKS * (int)blockDim.x &&
             (((uintptr_t)xr | (uintptr_t)w | (uintptr_t)yr) & 15) == 0;
  if (vec) {
    Pack8<T> xp[RMSNORM_CHUNKS], wp[RMSNORM_CHUNKS];
#pragma unroll
    for (int v = 0; v < RMSNORM_CHUNKS; ++v) {
      int c = threadIdx.x + v * blockDim.x;
      if (c < chunks) {
        xp[v].load(xr + c * 8);
        wp[v].load(w + c * 8);
      }
    }
    float ss = 0.f;
#pragma unroll
    for (int v = 0; v < RMSNORM_CHUNKS; ++v) {
      if (threadIdx.x + v * blockDim.x < chunks) {
        float f[8];
        xp[v].unpack(f);
#pragma unroll
        for (int i = 0; i < 8; ++i) ss += f[i] * f[i];
      }
    }
    ss = block_sum(ss);
    float r = 1.f / sqrtf(ss / (float)h + eps);
#pragma unroll
    for (int v = 0; v < RMSNORM_CHUNKS; ++v) {
      int c = threadIdx.x + v * blockDim.x;
      if (c < chunks) {
        float f[8], wf[8];
        xp[v].unpack(f);
        wp[v].unpack(wf);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          float xn = f[i] * r;
          f[i] = rms_apply<T>(xn, wf[i], offset_one);
        }
        store8(yr + c * 8, f);
      }
    }
    return;
  }
  float ss = 0.f;
  for (int j = threadIdx.x; j < h; j += blockDim.x) {
    float v = ld(xr, j);
    ss += v * v;
  }
  ss = block_sum(ss);
  float r = 1.f / sqrtf(ss / (float)h + eps);
  for (int j = threadIdx.x; j < h; j += blockDim.x) {
    float xn = ld(xr, j) * r;
    float wj = ld(w, j);
    st(yr, j, rms_apply<T>(xn, wj, offset_one));
  }
}

// Backward for `rows_per_block` consecutive rows per block. dx = r·g − x·r³·Σ(g·x)/h with
// g = dy·w (or dy·(1+w)); dw (when dw_acc is not null) = Σ_rows dy · round(x·r), accumulated in
// shared memory (h floats of dynamic shared memory) and added to dw_acc once per block.
template <typename T>
__device__ void rmsnorm_bwd(const T *x, const T *w, const T *dy, T *dx, float *dw_acc, int rows,
                            int h, float eps, int offset_one, int rows_per_block) {
  FT_DYNAMIC_SHARED(float, sdw);
  if (dw_acc)
    for (int j = threadIdx.x; j < h; j += blockDim.x) sdw[j] = 0.f;
  int first = blockIdx.x * rows_per_block;
  int last = min(rows, first + rows_per_block);
  for (long row = first; row < last; ++row) {
    const T *xr = x + row * h;
    const T *dyr = dy + row * h;
    float ss = 0.f, dot = 0.f;
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
      float xv = ld(xr, j);
      float wj = ld(w, j);
      float g = ld(dyr, j) * (offset_one ? 1.f + wj : wj);
      ss += xv * xv;
      dot += g * xv;
    }
    ss = block_sum(ss);
    dot = block_sum(dot);
    float r = 1.f / sqrtf(ss / (float)h + eps);
    float c = r * r * r * dot / (float)h;
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
      float xv = ld(xr, j);
      float wj = ld(w, j);
      float dyv = ld(dyr, j);
      float g = dyv * (offset_one ? 1.f + wj : wj);
      st(dx + row * h, j, r * g - xv * c);
      if (dw_acc) sdw[j] += dyv * (offset_one ? xv * r : round_to<T>(xv * r));
    }
  }
  if (dw_acc) {
    __syncthreads();
    for (int j = threadIdx.x; j < h; j += blockDim.x) atomicAdd(dw_acc + j, sdw[j]);
  }
}

// ---------------------------------------------------------------------------------------------
// Gated activations: y = round(act(g)) * u (HF: act_fn(gate) * up, each op rounded to the dtype).
// act: 0 = silu, 1 = gelu (tanh approximation), 2 = gelu (erf).
__device__ __forceinline__ float act_fwd(float x, int act) {
  if (act == 0) return x / (1.f + expf(-x));
  if (act == 1) {
    float k = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.f + tanhf(k));
  }
  return 0.5f * x * (1.f + erff(x * 0.7071067811865476f));
}

__device__ __forceinline__ float act_grad(float x, int act) {
  if (act == 0) {
    float s = 1.f / (1.f + expf(-x));
    return s * (1.f + x * (1.f - s));
  }
  if (act == 1) {
    float k = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    float t = tanhf(k);
    return 0.5f * (1.f + t) +
           0.5f * x * (1.f - t * t) * 0.7978845608028654f * (1.f + 3.f * 0.044715f * x * x);
  }
  return 0.5f * (1.f + erff(x * 0.7071067811865476f)) +
         x * 0.3989422804014327f * expf(-0.5f * x * x);
}

// Whether every pointer is 16-byte aligned (the vector paths' 8-element loads and stores).
__device__ __forceinline__ bool aligned16(const void *a, const void *b, const void *c,
                                          const void *d = nullptr, const void *e = nullptr) {
  return (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c | (uintptr_t)d | (uintptr_t)e) & 15) == 0;
}

// The elementwise kernels below take 8 elements a thread with 16-byte loads where the buffers
// allow (then the launcher sends n / 8 threads): one 2-byte load per thread keeps too few bytes in
// flight to use the memory bandwidth. Each element is computed exactly as on the scalar path,
// which takes any elements left over.
template <typename T>
__device__ void glu_fwd(const T *g, const T *u, T *y, long n, int act) {
  long tid = blockIdx.x * (long)blockDim.x + threadIdx.x, stride = (long)gridDim.x * blockDim.x;
  long chunks = aligned16(g, u, y) ? n / 8 : 0;
  for (long c = tid; c < chunks; c += stride) {
    Pack8<T> gp, up;
    gp.load(g + c * 8);
    up.load(u + c * 8);
    float gf[8], uf[8];
    gp.unpack(gf);
    up.unpack(uf);
#pragma unroll
    for (int i = 0; i < 8; ++i) gf[i] = round_to<T>(act_fwd(gf[i], act)) * uf[i];
    store8(y + c * 8, gf);
  }
  for (long i = chunks * 8 + tid; i < n; i += stride)
    st(y, i, round_to<T>(act_fwd(ld(g, i), act)) * ld(u, i));
}
template <typename T>
__device__ void glu_bwd(const T *g, const T *u, const T *dy, T *dg, T *du, long n, int act) {
  long tid = blockIdx.x * (long)blockDim.x + threadIdx.x, stride = (long)gridDim.x * blockDim.x;
  long chunks = aligned16(g, u, dy, dg, du) ? n / 8 : 0;
  for (long c = tid; c < chunks; c += stride) {
    Pack8<T> gp, up, dp;
    gp.load(g + c * 8);
    up.load(u + c * 8);
    dp.load(dy + c * 8);
    float gf[8], uf[8], df[8], dgf[8], duf[8];
    gp.unpack(gf);
    up.unpack(uf);
    dp.unpack(df);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      duf[i] = df[i] * round_to<T>(act_fwd(gf[i], act));
      dgf[i] = df[i] * uf[i] * act_grad(gf[i], act);
    }
    store8(du + c * 8, duf);
    store8(dg + c * 8, dgf);
  }
  for (long i = chunks * 8 + tid; i < n; i += stride) {
    float gv = ld(g, i), uv = ld(u, i), d = ld(dy, i);
    st(du, i, d * round_to<T>(act_fwd(gv, act)));
    st(dg, i, d * uv * act_grad(gv, act));
  }
}

// Where element e of y [b, heads, t, d] (contiguous) reads from: its feature `col`, the start of
// its row of cos/sin (`base`) and of x (returned; x strided by sb, sh, st_).
template <typename T>
__device__ __forceinline__ const T *rope_at(const T *x, long e, int heads, int t, int d, int rot,
                                            int cos_per_batch, long sb, long sh, long st_, int &col,
                                            long &base) {
  col = (int)(e % d);
  long row = e / d;
  int tq = (int)(row % t);
  long hi = (row / t) % heads;
  long bi = row / ((long)heads * t);
  base = (cos_per_batch ? bi : 0) * (long)t * rot + (long)tq * rot;
  return x + bi * sb + hi * sh + (long)tq * st_;
}

// One rotated feature: x·cos ∓ partner·sin, with the partner feature col ± rot/2 and sin read at
// the partner's index going backward. The sign is − for the first half going forward, + going
// backward, and the reverse for the second half.
__device__ __forceinline__ float rope_value(float x, float c, float p, float s, bool minus) {
  return minus ? x * c - p * s : x * c + p * s;
}

template <typename T>
__device__ void rope(const T *x, const T *cs, const T *sn, T *y, long n, int heads, int t, int d,
                     int rot, int cos_per_batch, int backward, long sb, long sh, long st_) {
  int half = rot / 2;
  long tid = blockIdx.x * (long)blockDim.x + threadIdx.x, stride = (long)gridDim.x * blockDim.x;
  // Vector path: 8 features of one row a thread (a chunk never straddles `half` or `rot`, and its
  // partner chunk, cos and sin are 8 aligned elements too). The index arithmetic, 64-bit
  // divisions, is paid once per chunk rather than per element.
  bool vec = d % 8 == 0 && rot % 16 == 0 && ((sb | sh | st_) & 7) == 0 && aligned16(x, cs, sn, y);
  long chunks = vec ? n / 8 : 0;
  for (long c = tid; c < chunks; c += stride) {
    long e = c * 8, base;
    int col;
    const T *xr = rope_at(x, e, heads, t, d, rot, cos_per_batch, sb, sh, st_, col, base);
    Pack8<T> xp;
    xp.load(xr + col);
    float xf[8];
    xp.unpack(xf);
    if (col >= rot) {
      store8(y + e, xf);
      continue;
    }
    int pcol = col < half ? col + half : col - half;
    Pack8<T> pp, cp, sp;
    pp.load(xr + pcol);
    cp.load(cs + base + col);
    sp.load(sn + base + (backward ? pcol : col));
    float pf[8], cf[8], sf[8], v[8];
    pp.unpack(pf);
    cp.unpack(cf);
    sp.unpack(sf);
    bool minus = (col < half) != (bool)backward;
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = rope_value(xf[i], cf[i], pf[i], sf[i], minus);
    store8(y + e, v);
  }
  for (long e = chunks * 8 + tid; e < n; e += stride) {
    long base;
    int col;
    const T *xr = rope_at(x, e, heads, t, d, rot, cos_per_batch, sb, sh, st_, col, base);
    if (col >= rot) {
      st(y, e, ld(xr, col));
      continue;
    }
    int pcol = col < half ? col + half : col - half;
    float v = rope_value(ld(xr, col), ld(cs, base + col), ld(xr, pcol),
                         ld(sn, base + (backward ? pcol : col)), (col < half) != (bool)backward);
    st(y, e, v);
  }
}

// ---------------------------------------------------------------------------------------------
// Attention softmax over one chunk of query rows, one block per row.
// Scores S: [bh, rows, L] (bh = batch · kv heads, rows = groups · C: query heads of one kv head
// stacked, C query positions each, the chunk starting at query position r0), keys ks .. ks+L.
// mask: f32 [mb, t, s] additive (null = none), mask_bstride = t·s, or 0 when one mask serves the
// whole batch. In place: S becomes P = softmax(S·scale + mask) in T. Forward writes each row's
// statistics (max m, 1 / Σexp) to stats[2·row]; with `recompute` it reads them instead and forms
// P = exp(S·scale + mask − m) / Σ (the backward's recomputation). (Keeping m apart rather than
// lse = m + log Σ keeps rows whose keys are all masked with a finite minimum exact: there
// m ≈ −3.4e38 swallows log Σ.)
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
  return v;
}

// A raw score's logit: scaled, then (Gemma 2, softcap > 0) softcapped as cap · tanh(x / cap).
__device__ __forceinline__ float attn_score(float raw, float scale, float softcap) {
  float x = raw * scale;
  return softcap > 0.f ? softcap * tanhf(x / softcap) : x;
}

template <typename T>
__device__ void attn_softmax(T *S, float *stats, const float *mask, int rows, int L, int C, int r0,
                             int ks, int nkv, int s, long mask_bstride, float scale, int recompute,
                             float softcap) {
  // One block per row: consecutive threads read consecutive keys (coalesced).
  long bh = blockIdx.y;
  int rr = blockIdx.x;
  long bi = bh / nkv;
  int tq = r0 + rr % C;
  T *row = S + (bh * rows + rr) * (long)L;
  const float *mrow = mask ? mask + bi * mask_bstride + (long)tq * s + ks : nullptr;
  float *srow = stats + 2 * (bh * rows + rr);
  if (recompute) {
    float m = srow[0], inv = srow[1];
    for (int j = threadIdx.x; j < L; j += blockDim.x) {
      float v = attn_score(ld(row, j), scale, softcap) + (mrow ? mrow[j] : 0.f);
      st(row, j, m == -INFINITY ? 0.f : expf(v - m) * inv);
    }
    return;
  }
  float m = -INFINITY, sum = 0.f;
  // Rows of up to PER · blockDim.x keys stay in registers: one read and one write of the scores.
  const int PER = 16;
  if (L <= PER * (int)blockDim.x) {
    float vals[PER];
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      int j = threadIdx.x + k * blockDim.x;
      float v = -INFINITY;
      if (j < L) v = attn_score(ld(row, j), scale, softcap) + (mrow ? mrow[j] : 0.f);
      vals[k] = v;
      m = fmaxf(m, v);
    }
    m = block_max(m);
    if (m != -INFINITY) {
#pragma unroll
      for (int k = 0; k < PER; ++k) {
        vals[k] = expf(vals[k] - m);  // exp(−∞) = 0 for the slots past L
        sum += vals[k];
      }
    }
    sum = block_sum(sum);
    float inv = m == -INFINITY ? 0.f : 1.f / sum;  // every key masked with −∞: zero weights
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      int j = threadIdx.x + k * blockDim.x;
      if (j < L) st(row, j, vals[k] * inv);
    }
    if (threadIdx.x == 0) {
      srow[0] = m;
      srow[1] = inv;
    }
    return;
  }
  for (int j = threadIdx.x; j < L; j += blockDim.x)
    m = fmaxf(m, attn_score(ld(row, j), scale, softcap) + (mrow ? mrow[j] : 0.f));
  m = block_max(m);
  if (m != -INFINITY)
    for (int j = threadIdx.x; j < L; j += blockDim.x)
      sum += expf(attn_score(ld(row, j), scale, softcap) + (mrow ? mrow[j] : 0.f) - m);
  sum = block_sum(sum);
  float inv = m == -INFINITY ? 0.f : 1.f / sum;
  for (int j = threadIdx.x; j < L; j += blockDim.x)
    st(row, j, m == -INFINITY ? 0.f : expf(attn_score(ld(row, j), scale, softcap) + (mrow ? mrow[j] : 0.f) - m) * inv);
  if (threadIdx.x == 0) {
    srow[0] = m;
    srow[1] = inv;
  }
}

// dS = P ⊙ (dP − D) · scale, in place over dP, elementwise over n = rows · L entries; D (one per
// row, f32) = rowsum(dO ⊙ O).
template <typename T>
__device__ void attn_dsoftmax(const T *P, T *dP, const float *D, long n, int L, float scale) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
    st(dP, i, ld(P, i) * (ld(dP, i) - D[n < 2147483647L ? (long)((unsigned)i / (unsigned)L) : i / L]) * scale);
}

// The softmax backward of softcapped attention for one chunk, in one pass per row (one block per
// row, as attn_softmax): S holds the raw scores Q·Kᵀ and dP = dO·Vᵀ; with x = S · scale,
// t = tanh(x / cap), the probabilities P = exp(cap · t + mask − m) · inv from the forward's
// statistics overwrite S (for dV = Pᵀ·dO), and dS = P ∘ (dP − D) ∘ (1 − t²) · scale overwrites dP
// (for dQ and dK). Needs no buffer beyond the two the chunk has.
template <typename T>
__device__ void attn_softcap_bwd(T *S, T *dP, const float *stats, const float *D, const float *mask,
                                 int rows, int L, int C, int r0, int ks, int nkv, int s,
                                 long mask_bstride, float scale, float softcap) {
  long bh = blockIdx.y;
  int rr = blockIdx.x;
  long bi = bh / nkv;
  int tq = r0 + rr % C;
  long off = (bh * rows + rr) * (long)L;
  const float *mrow = mask ? mask + bi * mask_bstride + (long)tq * s + ks : nullptr;
  const float *srow = stats + 2 * (bh * rows + rr);
  float m = srow[0], inv = srow[1], d = D[bh * rows + rr];
  for (int j = threadIdx.x; j < L; j += blockDim.x) {
    float t = tanhf(ld(S, off + j) * scale / softcap);
    float v = softcap * t + (mrow ? mrow[j] : 0.f);
    float p = m == -INFINITY ? 0.f : expf(v - m) * inv;
    float ds = p * (ld(dP, off + j) - d) * (1.f - t * t) * scale;
    st(S, off + j, p);
    st(dP, off + j, ds);
  }
}

// D[r] = Σ_j dO[r][j] · O[r][j] over rows of width d, one warp per row.
template <typename T>
__device__ void row_dot(const T *a, const T *b, float *out, long rows, int d) {
  int lane = threadIdx.x & 31;
  long r = blockIdx.x * (long)(blockDim.x >> 5) + (threadIdx.x >> 5);
  if (r >= rows) return;
  float acc = 0.f;
  for (int j = lane; j < d; j += 32) acc += ld(a, r * d + j) * ld(b, r * d + j);
  acc = warp_sum(acc);
  if (lane == 0) out[r] = acc;
}

// dst[b][off + i] += src[b][i] for b < nb, i < inner (dst f32 with row stride dst_stride, src T
// contiguous): accumulates a key range's dK/dV into the full-length f32 accumulator.
template <typename T>
__device__ void add_rows(float *dst, const T *src, int nb, long inner, long dst_stride, long off) {
  long n = nb * inner;
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
    long b = i / inner, j = i % inner;
    dst[b * dst_stride + off + j] += ld(src, i);
  }
}

// ---------------------------------------------------------------------------------------------
// Flash-attention forward for training (bf16, head dim D ∈ {64, 96, 128}): one block of 4 warps
// takes 64 query rows of one (batch, head) and walks its keys in tiles of 64, keeping the running
// row max and sum (the online softmax), so no score matrix reaches global memory. Q·Kᵀ and P·V run
// on the tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate); the scores stay in f32 and P is
// rounded to bf16 only as the second product's input, as FlashAttention-2 does. The per-row
// statistics (max, 1 / Σexp) are the ones the chunked backward (attn_softmax with recompute)
// reads, so the backward is unchanged.
//
// Fragment layouts are PTX's for mma.m16n8k16 (g = lane / 4, q = lane % 4; a register holds two
// bf16, the lower column/row index in the low half): A (16×16, row-major) a0 = A[g][2q..2q+1],
// a1 = A[g+8][2q..], a2 = A[g][2q+8..], a3 = A[g+8][2q+8..]; B (16×8, "col") b0 = B[2q..2q+1][g],
// b1 = B[2q+8..2q+9][g]; C (16×8, f32) c0,c1 = C[g][2q..2q+1], c2,c3 = C[g+8][2q..2q+1]. The CPU
// emulation (scripts/emulate-kernels) defines FT_MMA_EMULATED and its own mma_16816 from the same
// table.
#define FA_BQ 64   // query rows per block (16 per warp)
#define FA_BK 64   // keys per tile
#define FA_THREADS 128

#ifndef FT_MMA_EMULATED
__device__ __forceinline__ void mma_16816(float *c, const uint32_t *a, const uint32_t *b) {
#if __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();  // the host only launches the flash kernels on compute capability 8.0 and later
#endif
}
#endif

// Two floats as a bf16 pair (lo in the low half).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  return (uint32_t)__bfloat16_as_ushort(__float2bfloat16(lo)) |
         ((uint32_t)__bfloat16_as_ushort(__float2bfloat16(hi)) << 16);
}

// A fragment lane holds 2 rows × 2 columns of each 16×8 C tile; two adjacent C tiles (n-tiles 2j
// and 2j + 1, columns 16j .. 16j + 15) hold exactly the A fragment of a 16-wide k step over those
// columns: how a product's result (scores, dS) feeds the next product without leaving registers.
__device__ __forceinline__ void c_to_a(const float (*c)[4], int j, uint32_t *a) {
  a[0] = pack_bf16(c[2 * j][0], c[2 * j][1]);
  a[1] = pack_bf16(c[2 * j][2], c[2 * j][3]);
  a[2] = pack_bf16(c[2 * j + 1][0], c[2 * j + 1][1]);
  a[3] = pack_bf16(c[2 * j + 1][2], c[2 * j + 1][3]);
}

// A bf16 pair from memory (4-byte aligned).
__device__ __forceinline__ uint32_t ld_pair(const bf16 *p) { return *reinterpret_cast<const uint32_t *>(p); }

// Rows row0 .. row0 + 64 of two [rows, D] bf16 arrays into shared tiles of row stride D/2 + 4 words
// (zeros past row_end): every load issued before the first store.
template <int D>
__device__ __forceinline__ void flash_load2(uint32_t *d1, const bf16 *s1, uint32_t *d2, const bf16 *s2, int row0,
                                            int row_end) {
  constexpr int W = D / 2 + 4, L = FA_BK * (D / 8) / FA_THREADS;
  uint4 r1[L], r2[L];
#pragma unroll
  for (int u = 0; u < L; ++u) {
    int i = threadIdx.x + u * FA_THREADS, r = i / (D / 8), c = i % (D / 8);
    bool ok = row0 + r < row_end;
    r1[u] = ok ? *reinterpret_cast<const uint4 *>(s1 + (long)(row0 + r) * D + 8 * c) : make_uint4(0, 0, 0, 0);
    r2[u] = ok ? *reinterpret_cast<const uint4 *>(s2 + (long)(row0 + r) * D + 8 * c) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int u = 0; u < L; ++u) {
    int i = threadIdx.x + u * FA_THREADS, r = i / (D / 8), c = i % (D / 8);
    *reinterpret_cast<uint4 *>(&d1[r * W + 4 * c]) = r1[u];
    *reinterpret_cast<uint4 *>(&d2[r * W + 4 * c]) = r2[u];
  }
}

// Elements (r, c) and (r + 1, c) of a shared bf16 tile of row stride W words, as a pair: a B
// fragment register whose k runs down the tile's rows.
__device__ __forceinline__ uint32_t tile_col_pair(const uint32_t *tile, int W, int r, int c) {
  const uint16_t *h = reinterpret_cast<const uint16_t *>(tile);
  return (uint32_t)h[r * 2 * W + c] | ((uint32_t)h[(r + 1) * 2 * W + c] << 16);
}

// The additive mask as the flash kernels take it: an f32 mask [mb, t, s] (bstride elements between
// batch rows, 0 for one mask); or, where the host found every row of it 0 on one interval of keys
// and `masked` elsewhere, those intervals (row_keys [mb, t, 2], int pairs [first, last); an empty
// one for a row that sees no key), which spare a memory read per score; or neither (no mask).
struct FlashMask {
  const float *mask;
  long bstride;
  const int *row_keys;
  float masked;
};

// One query row of a FlashMask.
struct FlashMaskRow {
  const float *row;  // the mask's row, or null: 0 on keys [lo, hi), `masked` elsewhere
  int lo, hi;
  float masked;
  __device__ __forceinline__ float at(int key) const {
    return row ? row[key] : (key >= lo && key < hi ? 0.f : masked);
  }
};

// Row r of batch row bi; past the last row (never read), or without a mask, 0 everywhere.
__device__ __forceinline__ FlashMaskRow flash_mask_row(const FlashMask &m, int bi, int r, int t, int s) {
  if (r < t && m.row_keys) {
    const int *rk = m.row_keys + 2 * ((m.bstride ? (long)bi * t : 0) + r);
    return {nullptr, rk[0], rk[1], m.masked};
  }
  if (r < t && m.mask) return {m.mask + bi * m.bstride + (long)r * s, 0, 0, 0.f};
  return {nullptr, 0, 0x7fffffff, 0.f};
}

// q [b, nh, t, D], k/v [b, nkv, s, D] (contiguous, 16-byte aligned); fm the mask; key_range [blocks, 2]: the keys
// [first, last) any row of a 64-row block may see (the rest are masked for all of them). Writes
// o [b, nh, t, D] and stats [b, nh, t, 2] = (row max, 1 / Σexp); a row whose every score is −∞
// gets zeros and (−∞, 0), as attn_softmax gives it.
template <int D>
__device__ void flash_fwd(const bf16 *q, const bf16 *k, const bf16 *v, const FlashMask fm,
                          const int *key_range, int t, int s, int nh, int nkv, float scale,
                          float softcap, bf16 *o, float *stats) {
  static_assert(D % 32 == 0, "head dim must be a multiple of 32");
  // Row strides of the shared tiles in 32-bit words, padded by 4 so that the fragment reads of
  // a warp (8 rows × 4 words, or 4 row pairs × 8 half-words) fall in distinct banks.
  constexpr int W = D / 2 + 4;
  __shared__ uint32_t k_s[FA_BK * W];  // K tile, [key][D]
  __shared__ uint32_t v_s[FA_BK * W];  // V tile, [key][D]
  const int qb = gridDim.x - 1 - blockIdx.x;  // the longest blocks (causal: the last) first
  const long bh = blockIdx.y;
  const int bi = bh / nh, h = bh % nh, kvh = h / (nh / nkv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int rA = qb * FA_BQ + warp * 16 + g, rB = rA + 8;
  const bf16 *qh = q + bh * (long)t * D;
  const long kv_off = ((long)bi * nkv + kvh) * (long)s * D;
  const bf16 *kh = k + kv_off, *vh = v + kv_off;

  uint32_t qf[D / 16][4];
#pragma unroll
  for (int c = 0; c < D / 16; ++c) {
    qf[c][0] = rA < t ? ld_pair(qh + (long)rA * D + 16 * c + 2 * tq) : 0u;
    qf[c][1] = rB < t ? ld_pair(qh + (long)rB * D + 16 * c + 2 * tq) : 0u;
    qf[c][2] = rA < t ? ld_pair(qh + (long)rA * D + 16 * c + 8 + 2 * tq) : 0u;
    qf[c][3] = rB < t ? ld_pair(qh + (long)rB * D + 16 * c + 8 + 2 * tq) : 0u;
  }
  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float mA = -INFINITY, mB = -INFINITY, lA = 0.f, lB = 0.f;
  const FlashMaskRow maskA = flash_mask_row(fm, bi, rA, t, s), maskB = flash_mask_row(fm, bi, rB, t, s);
  const int k_first = key_range[2 * qb], k_end = min(key_range[2 * qb + 1], s);

  for (int k0 = k_first; k0 < k_end; k0 += FA_BK) {
    __syncthreads();  // every warp is done with the previous tiles
    flash_load2<D>(k_s, kh, v_s, vh, k0, k_end);
    __syncthreads();

    // S = Q·Kᵀ: the warp's 16 rows × 64 keys, as 8 tiles of 8 keys.
    float sc[FA_BK / 8][4];
#pragma unroll
    for (int n = 0; n < FA_BK / 8; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
    for (int c = 0; c < D / 16; ++c)
#pragma unroll
      for (int n = 0; n < FA_BK / 8; ++n) {
        const uint32_t *row = &k_s[(8 * n + g) * W + 8 * c + tq];
        uint32_t b[2] = {row[0], row[4]};
        mma_16816(sc[n], qf[c], b);
      }
    // Logits (scaled, softcapped, masked) and the tile's row maxima.
    float tmA = -INFINITY, tmB = -INFINITY;
#pragma unroll
    for (int n = 0; n < FA_BK / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int key = k0 + 8 * n + 2 * tq + (e & 1);
        float x = -INFINITY;
        if (key < k_end) x = attn_score(sc[n][e], scale, softcap) + (e < 2 ? maskA : maskB).at(key);
        sc[n][e] = x;
        if (e < 2) tmA = fmaxf(tmA, x);
        else tmB = fmaxf(tmB, x);
      }
    // A row's 64 scores are spread over the 4 lanes of a quad.
    tmA = fmaxf(tmA, __shfl_xor_sync(0xffffffff, tmA, 1));
    tmA = fmaxf(tmA, __shfl_xor_sync(0xffffffff, tmA, 2));
    tmB = fmaxf(tmB, __shfl_xor_sync(0xffffffff, tmB, 1));
    tmB = fmaxf(tmB, __shfl_xor_sync(0xffffffff, tmB, 2));
    const float nA = fmaxf(mA, tmA), nB = fmaxf(mB, tmB);
    // Rescale what came before to the new max (exp(−∞) = 0 for the first visible tile).
    const float cA = nA == -INFINITY ? 1.f : expf(mA - nA), cB = nB == -INFINITY ? 1.f : expf(mB - nB);
    mA = nA;
    mB = nB;
    lA *= cA;
    lB *= cB;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      acc[n][0] *= cA;
      acc[n][1] *= cA;
      acc[n][2] *= cB;
      acc[n][3] *= cB;
    }
#pragma unroll
    for (int n = 0; n < FA_BK / 8; ++n) {
      sc[n][0] = nA == -INFINITY ? 0.f : expf(sc[n][0] - nA);
      sc[n][1] = nA == -INFINITY ? 0.f : expf(sc[n][1] - nA);
      sc[n][2] = nB == -INFINITY ? 0.f : expf(sc[n][2] - nB);
      sc[n][3] = nB == -INFINITY ? 0.f : expf(sc[n][3] - nB);
      lA += sc[n][0] + sc[n][1];
      lB += sc[n][2] + sc[n][3];
    }
    // O += P·V: the C fragments of S are, pairwise, the A fragments of P (16 keys per step).
#pragma unroll
    for (int j = 0; j < FA_BK / 16; ++j) {
      uint32_t a[4];
      c_to_a(sc, j, a);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        uint32_t b[2] = {tile_col_pair(v_s, W, 16 * j + 2 * tq, 8 * n + g),
                         tile_col_pair(v_s, W, 16 * j + 2 * tq + 8, 8 * n + g)};
        mma_16816(acc[n], a, b);
      }
    }
  }
  // Each lane summed its own columns: the row sum is the quad's.
  lA += __shfl_xor_sync(0xffffffff, lA, 1);
  lA += __shfl_xor_sync(0xffffffff, lA, 2);
  lB += __shfl_xor_sync(0xffffffff, lB, 1);
  lB += __shfl_xor_sync(0xffffffff, lB, 2);
  const float iA = mA == -INFINITY ? 0.f : 1.f / lA, iB = mB == -INFINITY ? 0.f : 1.f / lB;
  bf16 *oh = o + bh * (long)t * D;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    if (rA < t)
      *reinterpret_cast<uint32_t *>(oh + (long)rA * D + 8 * n + 2 * tq) = pack_bf16(acc[n][0] * iA, acc[n][1] * iA);
    if (rB < t)
      *reinterpret_cast<uint32_t *>(oh + (long)rB * D + 8 * n + 2 * tq) = pack_bf16(acc[n][2] * iB, acc[n][3] * iB);
  }
  if (tq == 0) {
    float *st_h = stats + 2 * bh * (long)t;
    if (rA < t) {
      st_h[2 * rA] = mA;
      st_h[2 * rA + 1] = iA;
    }
    if (rB < t) {
      st_h[2 * rB] = mB;
      st_h[2 * rB + 1] = iB;
    }
  }
}

// The flash backward, in two kernels that each recompute the probabilities from the forward's
// statistics (FlashAttention-1's split, which needs no atomics on dQ): flash_bwd_dkdv walks the
// query blocks for one block of 64 keys and adds dK, dV into f32 accumulators shared by the query
// heads of a KV group; flash_bwd_dq walks the key tiles for one block of 64 query rows. With
// x = softcap(S · scale) + mask, P = exp(x − max) / Σ, D = rowsum(dO ∘ O):
// dS = P ∘ (dP − D) ∘ softcap′ · scale, dV = Pᵀ·dO, dK = dSᵀ·Q, dQ = dS·K, dP = dO·Vᵀ.

// P and dS of one score (query row `row`, key `key`) from the raw product `raw` = q·k and
// `dp` = dO·v, the row's mask, statistics (max m, 1 / Σ inv) and D; zeros outside [k_first, k_end)
// and past the last row, as the forward left those keys out.
__device__ __forceinline__ void flash_p_ds(float raw, float dp, int row, int key, int t, int k_first, int k_end,
                                           const FlashMaskRow &mr, float m, float inv, float d, float scale,
                                           float softcap, float &p, float &ds) {
  p = 0.f;
  ds = 0.f;
  if (row >= t || key < k_first || key >= k_end || m == -INFINITY) return;
  float x = raw * scale, tc = 0.f;
  if (softcap > 0.f) {
    tc = tanhf(x / softcap);
    x = softcap * tc;
  }
  x += mr.at(key);
  p = expf(x - m) * inv;
  ds = p * (dp - d) * scale;
  if (softcap > 0.f) ds *= 1.f - tc * tc;
}

// dK and dV: one block per 64 keys of one (batch, query head); warp w owns keys 16w .. 16w + 15 and
// accumulates their gradients over every query block whose key range meets the block, 32 queries
// at a time, then adds them (atomically: the group's heads share a KV head) into dk/dv, f32
// [b, nkv, s, D]. Dynamic shared memory: K, V, Q and dO tiles and the query block's statistics.
template <int D>
__device__ void flash_bwd_dkdv(const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *dout, const float *stats,
                               const float *drow, const FlashMask fm, const int *key_range, int t, int s, int nh,
                               int nkv, float scale, float softcap, float *dk, float *dv) {
  constexpr int W = D / 2 + 4;
  FT_DYNAMIC_SHARED(uint32_t, smem);
  uint32_t *k_s = smem, *v_s = k_s + FA_BK * W, *q_s = v_s + FA_BK * W, *do_s = q_s + FA_BQ * W;
  float *m_s = reinterpret_cast<float *>(do_s + FA_BQ * W), *inv_s = m_s + FA_BQ, *d_s = inv_s + FA_BQ;
  int *lo_s = reinterpret_cast<int *>(d_s + FA_BQ), *hi_s = lo_s + FA_BQ;  // the rows' key intervals
  const int key0 = blockIdx.x * FA_BK;
  const long bh = blockIdx.y;
  const int bi = bh / nh, h = bh % nh, kvh = h / (nh / nkv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const long kv_off = ((long)bi * nkv + kvh) * (long)s * D;
  const bf16 *qh = q + bh * (long)t * D, *doh = dout + bh * (long)t * D;
  const float *mask_b = fm.mask && !fm.row_keys ? fm.mask + bi * fm.bstride : nullptr;
  const int kA = key0 + warp * 16 + g, kB = kA + 8;  // this lane's keys (C fragment rows)
  flash_load2<D>(k_s, k + kv_off, v_s, v + kv_off, key0, s);
  float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dka[n][e] = dva[n][e] = 0.f;
  const int blocks = (t + FA_BQ - 1) / FA_BQ;
  for (int qb = 0; qb < blocks; ++qb) {
    const int k_first = key_range[2 * qb], k_end = min(key_range[2 * qb + 1], s);
    if (k_end <= key0 || k_first >= key0 + FA_BK) continue;  // no key of this block is seen
    __syncthreads();  // every warp is done with the previous query block
    flash_load2<D>(q_s, qh, do_s, doh, qb * FA_BQ, t);
    if (threadIdx.x < FA_BQ) {
      int r = qb * FA_BQ + threadIdx.x;
      m_s[threadIdx.x] = r < t ? stats[2 * (bh * t + r)] : -INFINITY;
      inv_s[threadIdx.x] = r < t ? stats[2 * (bh * t + r) + 1] : 0.f;
      d_s[threadIdx.x] = r < t ? drow[bh * t + r] : 0.f;
      const FlashMaskRow mr = flash_mask_row(fm, bi, r, t, s);
      lo_s[threadIdx.x] = mr.lo;
      hi_s[threadIdx.x] = mr.hi;
    }
    __syncthreads();
#pragma unroll 1
    for (int half = 0; half < 2; ++half) {
      const int qc = half * 32;  // the half's first row within the query block
      // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for the warp's 16 keys × 32 queries.
      float sc[4][4] = {}, dp[4][4] = {};
#pragma unroll
      for (int c = 0; c < D / 16; ++c) {
        const uint32_t *kr = &k_s[(warp * 16 + g) * W + 8 * c + tq], *vr = &v_s[(warp * 16 + g) * W + 8 * c + tq];
        uint32_t ak[4] = {kr[0], kr[8 * W], kr[4], kr[8 * W + 4]};
        uint32_t av[4] = {vr[0], vr[8 * W], vr[4], vr[8 * W + 4]};
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          const uint32_t *qr = &q_s[(qc + 8 * n + g) * W + 8 * c + tq], *dr = &do_s[(qc + 8 * n + g) * W + 8 * c + tq];
          uint32_t bq[2] = {qr[0], qr[4]}, bd[2] = {dr[0], dr[4]};
          mma_16816(sc[n], ak, bq);
          mma_16816(dp[n], av, bd);
        }
      }
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = qc + 8 * n + 2 * tq + (e & 1), row = qb * FA_BQ + qi;
          const FlashMaskRow mr = {mask_b ? mask_b + (long)row * s : nullptr, lo_s[qi], hi_s[qi], fm.masked};
          float p, ds;
          flash_p_ds(sc[n][e], dp[n][e], row, e < 2 ? kA : kB, t, k_first, k_end, mr, m_s[qi], inv_s[qi], d_s[qi],
                     scale, softcap, p, ds);
          sc[n][e] = p;
          dp[n][e] = ds;
        }
      // dV += Pᵀ·dO and dK += dSᵀ·Q, 16 queries per step (C fragments of Pᵀ are A fragments).
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t ap[4], as[4];
        c_to_a(sc, j, ap);
        c_to_a(dp, j, as);
        const int qr = qc + 16 * j + 2 * tq;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          uint32_t bd[2] = {tile_col_pair(do_s, W, qr, 8 * n + g), tile_col_pair(do_s, W, qr + 8, 8 * n + g)};
          uint32_t bq[2] = {tile_col_pair(q_s, W, qr, 8 * n + g), tile_col_pair(q_s, W, qr + 8, 8 * n + g)};
          mma_16816(dva[n], ap, bd);
          mma_16816(dka[n], as, bq);
        }
      }
    }
  }
  float *dkh = dk + kv_off, *dvh = dv + kv_off;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    int col = 8 * n + 2 * tq;
    if (kA < s) {
      atomicAdd(dkh + (long)kA * D + col, dka[n][0]);
      atomicAdd(dkh + (long)kA * D + col + 1, dka[n][1]);
      atomicAdd(dvh + (long)kA * D + col, dva[n][0]);
      atomicAdd(dvh + (long)kA * D + col + 1, dva[n][1]);
    }
    if (kB < s) {
      atomicAdd(dkh + (long)kB * D + col, dka[n][2]);
      atomicAdd(dkh + (long)kB * D + col + 1, dka[n][3]);
      atomicAdd(dvh + (long)kB * D + col, dva[n][2]);
      atomicAdd(dvh + (long)kB * D + col + 1, dva[n][3]);
    }
  }
}

// dQ: one block per 64 query rows of one (batch, head), as the forward, walking the same key
// tiles 32 keys at a time; writes dq [b, nh, t, D] (bf16).
template <int D>
__device__ void flash_bwd_dq(const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *dout, const float *stats,
                             const float *drow, const FlashMask fm, const int *key_range, int t, int s, int nh,
                             int nkv, float scale, float softcap, bf16 *dq) {
  constexpr int W = D / 2 + 4;
  __shared__ uint32_t k_s[FA_BK * W];
  __shared__ uint32_t v_s[FA_BK * W];
  const int qb = gridDim.x - 1 - blockIdx.x;
  const long bh = blockIdx.y;
  const int bi = bh / nh, h = bh % nh, kvh = h / (nh / nkv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int rA = qb * FA_BQ + warp * 16 + g, rB = rA + 8;
  const bf16 *qh = q + bh * (long)t * D, *doh = dout + bh * (long)t * D;
  const long kv_off = ((long)bi * nkv + kvh) * (long)s * D;
  const FlashMaskRow maskA = flash_mask_row(fm, bi, rA, t, s), maskB = flash_mask_row(fm, bi, rB, t, s);
  uint32_t qf[D / 16][4], df[D / 16][4];
#pragma unroll
  for (int c = 0; c < D / 16; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int r = e & 1 ? rB : rA, col = 16 * c + 2 * tq + (e & 2 ? 8 : 0);
      qf[c][e] = r < t ? ld_pair(qh + (long)r * D + col) : 0u;
      df[c][e] = r < t ? ld_pair(doh + (long)r * D + col) : 0u;
    }
  const float mA = rA < t ? stats[2 * (bh * t + rA)] : -INFINITY, iA = rA < t ? stats[2 * (bh * t + rA) + 1] : 0.f;
  const float mB = rB < t ? stats[2 * (bh * t + rB)] : -INFINITY, iB = rB < t ? stats[2 * (bh * t + rB) + 1] : 0.f;
  const float dA = rA < t ? drow[bh * t + rA] : 0.f, dB = rB < t ? drow[bh * t + rB] : 0.f;
  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  const int k_first = key_range[2 * qb], k_end = min(key_range[2 * qb + 1], s);
  for (int k0 = k_first; k0 < k_end; k0 += FA_BK) {
    __syncthreads();
    flash_load2<D>(k_s, k + kv_off, v_s, v + kv_off, k0, k_end);
    __syncthreads();
#pragma unroll 1
    for (int half = 0; half < 2; ++half) {
      const int kc = half * 32;
      float sc[4][4] = {}, dp[4][4] = {};
#pragma unroll
      for (int c = 0; c < D / 16; ++c)
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          const uint32_t *kr = &k_s[(kc + 8 * n + g) * W + 8 * c + tq], *vr = &v_s[(kc + 8 * n + g) * W + 8 * c + tq];
          uint32_t bk[2] = {kr[0], kr[4]}, bv[2] = {vr[0], vr[4]};
          mma_16816(sc[n], qf[c], bk);
          mma_16816(dp[n], df[c], bv);
        }
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float p, ds;
          bool a = e < 2;
          flash_p_ds(sc[n][e], dp[n][e], a ? rA : rB, k0 + kc + 8 * n + 2 * tq + (e & 1), t, k_first, k_end,
                     a ? maskA : maskB, a ? mA : mB, a ? iA : iB, a ? dA : dB, scale, softcap, p, ds);
          dp[n][e] = ds;
        }
      // dQ += dS·K, 16 keys per step.
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t as[4];
        c_to_a(dp, j, as);
        const int kr = kc + 16 * j + 2 * tq;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          uint32_t bk[2] = {tile_col_pair(k_s, W, kr, 8 * n + g), tile_col_pair(k_s, W, kr + 8, 8 * n + g)};
          mma_16816(acc[n], as, bk);
        }
      }
    }
  }
  bf16 *dqh = dq + bh * (long)t * D;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    if (rA < t) *reinterpret_cast<uint32_t *>(dqh + (long)rA * D + 8 * n + 2 * tq) = pack_bf16(acc[n][0], acc[n][1]);
    if (rB < t) *reinterpret_cast<uint32_t *>(dqh + (long)rB * D + 8 * n + 2 * tq) = pack_bf16(acc[n][2], acc[n][3]);
  }
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy over rows of logits [rows, V] (in place): loss[r] = lse − logit[target], and the
// logits become dlogits = softmax − onehot(target), the gradient of the summed loss (PyTorch's
// F.cross_entropy(logits.float(), reduction="sum"): statistics in f32, gradient cast to T).
// A target of 0xFFFFFFFF marks a row without one: its loss and gradient are 0.
template <typename T>
__device__ void ce_fwd_bwd(T *logits, const uint32_t *targets, float *loss, int V) {
  long r = blockIdx.x;
  T *row = logits + r * (long)V;
  if (targets[r] == 0xFFFFFFFFu) {
    for (int j = threadIdx.x; j < V; j += blockDim.x) st(row, j, 0.f);
    if (threadIdx.x == 0) loss[r] = 0.f;
    return;
  }
  float m = -INFINITY;
  for (int j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, ld(row, j));
  m = block_max(m);
  float sum = 0.f;
  for (int j = threadIdx.x; j < V; j += blockDim.x) sum += expf(ld(row, j) - m);
  sum = block_sum(sum);
  float lse = m + logf(sum);
  int tgt = (int)targets[r];
  float tl = ld(row, tgt);  // read by every thread before any thread writes the row
  __syncthreads();
  if (threadIdx.x == 0) loss[r] = lse - tl;
  for (int j = threadIdx.x; j < V; j += blockDim.x)
    st(row, j, expf(ld(row, j) - lse) - (j == tgt ? 1.f : 0.f));
}

// dst[idx[i]] = src[i] for rows of width h (rows with a target back into place among all rows).
template <typename T>
__device__ void scatter_rows(T *dst, const T *src, const uint32_t *idx, long m, int h) {
  long n = m * h;
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
    dst[(long)idx[i / h] * h + i % h] = src[i];
}

// out[r][j] += bias[j] for rows × cols (a linear layer's bias).
template <typename T>
__device__ void bias_add(T *out, const T *bias, long rows, int cols) {
  long n = rows * cols;
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
    st(out, i, ld(out, i) + ld(bias, i % cols));
}

// ---------------------------------------------------------------------------------------------
// An NF4 weight (QLoRA's frozen base, torchao's layout) expanded to T: two 4-bit level indices per
// byte (the first in the high nibble), one int8 scale per 64 values and one factor per 256 scales.
// Each value is levels[code] * (q / factor + mean), every step rounded to T as torch rounds it
// (crate::nf4 holds the CPU form and its reference). `levels` are the 16 levels rounded to T.
template <typename T>
__device__ void nf4_dequant(const uint8_t *codes, const int8_t *scalers, const float *factors,
                            const float *levels, float mean, T *out, long n) {
  long pairs = (n + 1) / 2;
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < pairs;
       i += (long)gridDim.x * blockDim.x) {
    long e = 2 * i, block = e / 64;
    float scaler = round_to<T>(round_to<T>((float)scalers[block] / factors[block / 256]) + mean);
    uint8_t c = codes[i];
    st(out, e, round_to<T>(levels[c >> 4] * scaler));
    if (e + 1 < n) st(out, e + 1, round_to<T>(levels[c & 15] * scaler));
  }
}

// ---------------------------------------------------------------------------------------------
// One AdamW step (torch.optim.AdamW's single-tensor arithmetic, with lerp's weight < 0.5 branch)
// on the f32 parameter p32, its moments m and v, and the gradient g (in T, times grad_scale);
// p_out (when not null) receives the result rounded to T (the model's bf16 copy of a parameter
// whose f32 master is p32).
template <typename T>
__device__ void adamw(float *p32, T *p_out, const T *g, float *m, float *v, long n, float grad_scale,
                      float decay, float omb1, float b2, float omb2, float bc2_sqrt, float eps,
                      float neg_step) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
    float x = p32[i] * decay;
    float gi = ld(g, i) * grad_scale;
    float mi = m[i] + (gi - m[i]) * omb1;
    float vi = v[i] * b2 + (gi * omb2) * gi;
    float denom = sqrtf(vi) / bc2_sqrt + eps;
    x = x + (mi * neg_step) / denom;
    p32[i] = x;
    m[i] = mi;
    v[i] = vi;
    if (p_out) st(p_out, i, x);
  }
}

// ---------------------------------------------------------------------------------------------
// Decode step: one new token for each of B ≤ 8 rows. Reading the weights once per token is
// the whole cost, so the projections are warp-per-output-row GEMVs with 16-byte loads, several in
// flight per lane, instead of cuBLAS GEMMs shaped for many rows; the layer needs 8 launches in all.
// Loops that contain warp shuffles run the same number of times in every warp of a block (idle
// warps compute on a clamped index and drop the result), which the CPU emulation requires.

__device__ __forceinline__ void load8(const bf16 *p, float *f) {
  uint4 u = *reinterpret_cast<const uint4 *>(p);
  const bf16 *h = reinterpret_cast<const bf16 *>(&u);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = __bfloat162float(h[i]);
}

__device__ __forceinline__ void load8(const float *p, float *f) {
  float4 a = reinterpret_cast<const float4 *>(p)[0];
  float4 b = reinterpret_cast<const float4 *>(p)[1];
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
  f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

// The first `chunks` 256-element chunks of a weight row in L2, one line per 8 lanes: what dec_dot
// reads first, requested before pdl_wait() (weights are no kernel's output).
template <typename T>
__device__ __forceinline__ void prefetch_row(const T *wr, int K, int chunks, int lane) {
  if (lane & 7) return;
  for (int u = 0; u < chunks; ++u) {
    int k = lane * 8 + u * 256;
    if (k < K) prefetch_l2(wr + k);
  }
}

// acc[b] += W[row] · x[b] over this lane's share of K (K a multiple of 8): lane l reads elements
// 8l .. 8l+7 of every 256-element chunk, UNROLL chunks of the weight row loaded before use.
template <typename T, int UNROLL, int NB>
__device__ __forceinline__ void dec_dot(const T *wr, const T *x, int K, float *acc, int lane) {
  int k = lane * 8;
  for (; k + (UNROLL - 1) * 256 < K; k += UNROLL * 256) {
    Pack8<T> w[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) w[u].load(wr + k + u * 256);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float wf[8];
      w[u].unpack(wf);
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        float xv[8];
        load8(x + (long)b * K + k + u * 256, xv);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[b] += wf[i] * xv[i];
      }
    }
  }
  for (; k < K; k += 256) {
    Pack8<T> w;
    w.load(wr + k);
    float wf[8];
    w.unpack(wf);
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      float xv[8];
      load8(x + (long)b * K + k, xv);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[b] += wf[i] * xv[i];
    }
  }
}

// out[b][r] = round(x[b] · W[r]) (+ bias, rounded again: candle's matmul then broadcast add) for the
// rows of up to three stacked matrices (q, k, v), out: [B, n0 + n1 + n2]. With `residual`,
// out[b][r] = round(residual[b][r] + that): the residual add after o_proj / down_proj.
template <typename T, int NB>
__device__ void dec_gemv(const T *x, int K, const T *w0, const T *b0, int n0, const T *w1,
                         const T *b1, int n1, const T *w2, const T *b2, int n2, const T *residual,
                         T *out) {
  int lane = threadIdx.x & 31;
  int N = n0 + n1 + n2;
  int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  bool active = r < N;
  if (!active) r = N - 1;
  const T *w = w0, *bias = b0;
  int rr = r;
  if (rr >= n0) {
    rr -= n0;
    w = w1;
    bias = b1;
    if (rr >= n1) {
      rr -= n1;
      w = w2;
      bias = b2;
    }
  }
  pdl_trigger();
  prefetch_row(w + (long)rr * K, K, 4, lane);
  pdl_wait();
  // The epilogue's bias and residual are loaded before the dot product, so that their round trip
  // overlaps the weight stream instead of following it.
  float bias_v = bias ? ld(bias, rr) : 0.f;
  float res[NB];
#pragma unroll
  for (int b = 0; b < NB; ++b) res[b] = residual ? ld(residual, (long)b * N + r) : 0.f;
  float acc[NB];
#pragma unroll
  for (int b = 0; b < NB; ++b) acc[b] = 0.f;
  dec_dot<T, 4, NB>(w + (long)rr * K, x, K, acc, lane);
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    float s = warp_sum(acc[b]);
    if (active && lane == 0) {
      float v = round_to<T>(s);
      if (bias) v = round_to<T>(v + bias_v);
      if (residual) v = v + res[b];
      st(out, (long)b * N + r, v);
    }
  }
}

// out[b][r] = round(round(act(g)) · u) with g = round(x[b] · Wg[r]), u = round(x[b] · Wu[r]) (each
// plus its bias, rounded again, when given): the gated MLP's gate and up projections and activation
// in one pass over both weights.
template <typename T, int NB>
__device__ void dec_gated_gemv(const T *x, int K, const T *wg, const T *bg, const T *wu,
                               const T *bu, int N, T *out, int act) {
  int lane = threadIdx.x & 31;
  int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  bool active = r < N;
  if (!active) r = N - 1;
  pdl_trigger();
  prefetch_row(wg + (long)r * K, K, 2, lane);
  prefetch_row(wu + (long)r * K, K, 2, lane);
  pdl_wait();
  float ag[NB], au[NB];
#pragma unroll
  for (int b = 0; b < NB; ++b) ag[b] = au[b] = 0.f;
  dec_dot<T, 2, NB>(wg + (long)r * K, x, K, ag, lane);
  dec_dot<T, 2, NB>(wu + (long)r * K, x, K, au, lane);
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    float g = round_to<T>(warp_sum(ag[b]));
    float u = round_to<T>(warp_sum(au[b]));
    if (active && lane == 0) {
      if (bg) g = round_to<T>(g + ld(bg, r));
      if (bu) u = round_to<T>(u + ld(bu, r));
      st(out, (long)b * N + r, round_to<T>(act_fwd(g, act)) * u);
    }
  }
}

// The projections' output of one token per row, qkv [B, (nh + 2·nkv) · hd], one block per
// (head, row), blockDim = hd rounded up to a multiple of 32. Query and key heads get the optional
// per-head RMSNorm (Qwen3's q_norm / k_norm, rounded as rmsnorm_fwd does) and RoPE over the first
// `rot` features (cos, sin: [B, rot]; one rounding, as the rope kernel); queries go to
// q_out [B, nh, hd], keys to slot `pos` of kc [B, nkv, cap, hd]; values are copied to slot `pos`
// of vc. With `counters` ([slot, len], a replayed CUDA graph's step position), the slot is
// counters[0] instead of `pos`.
template <typename T>
__device__ void dec_qkv_rope(const T *qkv, const T *cs, const T *sn, const T *qn, const T *kn,
                             float eps, int offset_one, T *q_out, T *kc, T *vc, int nh, int nkv,
                             int hd, int rot, int cap, int pos, const uint32_t *counters) {
  FT_DYNAMIC_SHARED(float, head_vals);  // hd floats
  pdl_trigger();
  pdl_wait();
  int head = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
  if (counters) pos = (int)counters[0];
  bool on = d < hd;
  long width = (long)(nh + 2 * nkv) * hd;
  float v = on ? ld(qkv, b * width + (long)head * hd + d) : 0.f;
  if (head >= nh + nkv) {
    if (on) st(vc, (((long)b * nkv + (head - nh - nkv)) * cap + pos) * hd + d, v);
    return;
  }
  // Everything else this thread reads is loaded up front, in one memory round trip with qkv's.
  bool rotated = on && d < rot;
  float c = rotated ? ld(cs, (long)b * rot + d) : 0.f, s = rotated ? ld(sn, (long)b * rot + d) : 0.f;
  const T *nw = head < nh ? qn : kn;
  float wj = nw && on ? ld(nw, d) : 0.f;
  if (nw) {
    float ss = block_sum(v * v);
    float xn = v * (1.f / sqrtf(ss / (float)hd + eps));
    v = round_to<T>(rms_apply<T>(xn, wj, offset_one));
  }
  if (on) head_vals[d] = v;
  __syncthreads();
  if (!on) return;
  float y = v;
  int half = rot / 2;
  if (d < rot) {
    y = d < half ? v * c - head_vals[d + half] * s : v * c + head_vals[d - half] * s;
  }
  if (head < nh)
    st(q_out, ((long)b * nh + head) * hd + d, y);
  else
    st(kc, (((long)b * nkv + (head - nh)) * cap + pos) * hd + d, y);
}

// The decode attention's two passes over the keys of one (query head, row), shared by
// dec_attention and dec_attention_part. The score pass computes the scores of keys [start, end)
// against the query `qs` (shared memory), rounded to T before scaling as the training kernels
// do, softcapped when softcap > 0 (Gemma 2: cap · tanh(s / cap), before the softmax as in the
// forward), written to sc[j]; it returns the block's max (−∞ without keys), after a barrier that
// publishes sc. It comes in two forms with the same results, chosen per launch by the grid:
//
// dec_scores_per_thread: one key per thread, its features in batches of loads (128 for bf16)
// in flight before the first is used. Fewest memory round trips in a row, for grids that fit
// on the GPU at once (a batch-1 step: one block per head, or a few splits each), but 106
// registers: two blocks an SM.
template <typename T>
__device__ float dec_scores_per_thread(const float *qs, const T *kb, int hd, int start, int end, float scale,
                                       float softcap, float *sc) {
  float m = -INFINITY;
  for (int j = start + threadIdx.x; j < end; j += blockDim.x) {
    const T *kr = kb + (long)j * hd;
    float acc = 0.f;
    // A batch of features' loads (128 for bf16, 64 for f32: 64 registers) is in flight before
    // the first is used: the keys were written by an earlier kernel, and waiting for each 8
    // features in turn made this pass a chain of hd / 8 memory round trips.
    constexpr int BATCH = sizeof(T) == 2 ? 16 : 8;
    for (int d0 = 0; d0 < hd; d0 += BATCH * 8) {
      Pack8<T> kp[BATCH];
#pragma unroll
      for (int c = 0; c < BATCH; ++c)
        if (d0 + c * 8 < hd) kp[c].load(kr + d0 + c * 8);
#pragma unroll
      for (int c = 0; c < BATCH; ++c) {
        if (d0 + c * 8 < hd) {
          float k8[8];
          kp[c].unpack(k8);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc += qs[d0 + c * 8 + i] * k8[i];
        }
      }
    }
    float s = round_to<T>(acc) * scale;
    if (softcap > 0.f) s = softcap * tanhf(s / softcap);
    sc[j] = s;
    m = fmaxf(m, s);
  }
  return block_max(m);
}

// dec_scores_shared_lanes: lanes share a key: a key's hd / 8 chunks of 8 features go to `lanes`
// lanes (the next power of two, at most 32; lanes past the last chunk idle, a lane takes every
// lanes-th chunk past 32), so a warp's load reads whole consecutive key rows, coalesced; each
// lane keeps KEYS keys' loads in flight, and the lanes' partial dot products are summed by
// shuffles. 56 registers, four blocks an SM: for grids past what the per-thread form runs at
// once (the split attention over a long cache: 32 heads × 16 splits at 4096 keys, where the
// per-thread form waited a second wave and decoded 10 % slower than before it batched loads).
template <typename T>
__device__ float dec_scores_shared_lanes(const float *qs, const T *kb, int hd, int start, int end, float scale,
                                        float softcap, float *sc) {
  constexpr int KEYS = 4;
  int chunks = hd / 8;
  int lanes = 1;
  while (lanes < chunks && lanes < 32) lanes <<= 1;
  int per_warp = 32 / lanes;  // keys a load instruction covers
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  int sub = lane / lanes, c0 = lane % lanes;
  float m = -INFINITY;
  // A warp's tile: KEYS · per_warp consecutive keys. Every thread of the block makes the same
  // number of passes (a warp past `end` loads nothing), so every shuffle has all of its lanes;
  // the block-wide bound also keeps the CPU emulation's 64-fiber warps in step.
  for (int pass = start; pass < end; pass += warps * KEYS * per_warp) {
    int tile = pass + warp * KEYS * per_warp;
    float acc[KEYS] = {};
    for (int cb = 0; cb < chunks; cb += lanes) {
      int c = cb + c0;
      Pack8<T> kp[KEYS];
#pragma unroll
      for (int u = 0; u < KEYS; ++u) {
        int j = tile + u * per_warp + sub;
        if (j < end && c < chunks) kp[u].load(kb + (long)j * hd + c * 8);
      }
      if (c < chunks) {
        float q8[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) q8[i] = qs[c * 8 + i];
#pragma unroll
        for (int u = 0; u < KEYS; ++u) {
          if (tile + u * per_warp + sub < end) {
            float k8[8];
            kp[u].unpack(k8);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[u] += q8[i] * k8[i];
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < KEYS; ++u) {
      for (int o = lanes / 2; o > 0; o >>= 1) acc[u] += __shfl_xor_sync(0xffffffff, acc[u], o);
      int j = tile + u * per_warp + sub;
      if (c0 == 0 && j < end) {
        float s = round_to<T>(acc[u]) * scale;
        if (softcap > 0.f) s = softcap * tanhf(s / softcap);
        sc[j] = s;
        m = fmaxf(m, s);
      }
    }
  }
  return block_max(m);
}

// The score pass a launch chose: LANES, dec_scores_shared_lanes, else dec_scores_per_thread.
template <typename T, bool LANES>
__device__ float dec_scores(const float *qs, const T *kb, int hd, int start, int end, float scale,
                            float softcap, float *sc) {
  if constexpr (LANES) return dec_scores_shared_lanes<T>(qs, kb, hd, start, end, scale, softcap, sc);
  else return dec_scores_per_thread<T>(qs, kb, hd, start, end, scale, softcap, sc);
}

// dec_values: Σ_j sc[j] · v_j over keys [start, end), the weights sc published to the block
// (a barrier after they were written): 8 features of every groups-th key per thread, each
// group's sums left in acc_sh ([groups, hd] floats, groups = blockDim.x / (hd / 8)); returns
// groups, after a barrier, so that a thread can add up feature d as Σ_g acc_sh[g · hd + d].
template <typename T>
__device__ int dec_values(const float *sc, const T *vb, int hd, int start, int end, float *acc_sh) {
  int per_key = hd / 8;
  int groups = blockDim.x / per_key;
  int d8 = (threadIdx.x % per_key) * 8, g = threadIdx.x / per_key;
  if (g < groups) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int j = start + g;
    // 8 keys' loads in flight at a time (same summation order as one key after another).
    for (; j + 7 * groups < end; j += 8 * groups) {
      Pack8<T> vp[8];
      float p[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        p[u] = sc[j + u * groups];
        vp[u].load(vb + (long)(j + u * groups) * hd + d8);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        float v8[8];
        vp[u].unpack(v8);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += p[u] * v8[i];
      }
    }
    for (; j < end; j += groups) {
      float p = sc[j], v8[8];
      load8(vb + (long)j * hd + d8, v8);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += p * v8[i];
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) acc_sh[g * hd + d8 + i] = acc[i];
  }
  __syncthreads();
  return groups;
}

// Attention of one query per row over keys lo .. len−1 of the cache (lo = the row's first real key,
// raised to len − window for a sliding window), one block per (query head, row). Rounds as the
// training kernels do: scores rounded to T before scaling, P rounded to T, the output once.
// q: [B, nh, hd]; kc, vc: [B, nkv, cap, hd]; out: [B, nh · hd]; scores: f32 scratch [B, nh, cap].
// A decode step's attention is short and latency-bound, so every thread keeps many independent
// loads in flight: a few keys per lane for the scores, 8 features of every groups-th key per
// thread for P·V. Needs hd a multiple of 8 and hd ≤ 8 · blockDim.x; dynamic shared memory:
// (hd + 8 · blockDim.x) floats. With `counters` ([slot, len], a replayed CUDA graph's step
// position), the keys end at counters[1] instead of `len`.
template <typename T, bool LANES>
__device__ void dec_attention(const T *q, const T *kc, const T *vc, T *out, float *scores,
                              const uint32_t *lo_rows, int len, int window, int nh, int nkv, int hd,
                              int cap, float scale, float softcap, const uint32_t *counters) {
  FT_DYNAMIC_SHARED(float, dsh);
  pdl_trigger();
  pdl_wait();
  int h = blockIdx.x, b = blockIdx.y;
  if (counters) len = (int)counters[1];
  int kvh = h / (nh / nkv);
  int lo = (int)lo_rows[b];
  if (window > 0) lo = max(lo, len - window);
  const T *qr = q + ((long)b * nh + h) * hd;
  long kv_off = ((long)b * nkv + kvh) * (long)cap * hd;
  const T *kb = kc + kv_off;
  const T *vb = vc + kv_off;
  float *sc = scores + ((long)b * nh + h) * (long)cap;
  float *qs = dsh, *part = dsh + hd;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = ld(qr, d);
  __syncthreads();
  float m = dec_scores<T, LANES>(qs, kb, hd, lo, len, scale, softcap, sc);
  // dec_scores' barrier published the scores; each thread now rescales the ones at its own j,
  // and the barrier below publishes those.
  float sum = 0.f;
  for (int j = lo + threadIdx.x; j < len; j += blockDim.x) sum += expf(sc[j] - m);
  sum = block_sum(sum);
  float inv = 1.f / sum;
  for (int j = lo + threadIdx.x; j < len; j += blockDim.x) sc[j] = round_to<T>(expf(sc[j] - m) * inv);
  __syncthreads();
  int groups = dec_values<T>(sc, vb, hd, lo, len, part);
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float s = 0.f;
    for (int gg = 0; gg < groups; ++gg) s += part[gg * hd + d];
    st(out, ((long)b * nh + h) * hd + d, s);
  }
}

// Long caches: dec_attention has one block per (query head, row), a few dozen blocks for a whole
// GPU, and reads every key of a long cache in that one block. Split over keys instead
// (flash-decoding): block (head, row, split) takes keys [split · chunk, (split + 1) · chunk) of
// the visible range and leaves its running max m, its sum l = Σ exp(s − m) and the unnormalized
// Σ exp(s − m) · v in `part` ([B, nh, splits, hd + 2] floats: hd accumulators, then m and l);
// dec_attention_combine weighs the splits by exp(m − max m) and writes the output. The split
// count follows the cache capacity, not the length, so a recorded CUDA graph stays valid as the
// cache fills. Scores are rounded to T before scaling as in dec_attention; the probabilities are
// not rounded to T (they are only known up to the final sum), a difference within T's precision.
// Dynamic shared memory: (hd + 8 · blockDim.x) floats.
template <typename T, bool LANES>
__device__ void dec_attention_part(const T *q, const T *kc, const T *vc, float *part, float *scores,
                                   const uint32_t *lo_rows, int len, int window, int nh, int nkv,
                                   int hd, int cap, int chunk, float scale, float softcap,
                                   const uint32_t *counters) {
  FT_DYNAMIC_SHARED(float, dsh);
  pdl_trigger();
  pdl_wait();
  int h = blockIdx.x, b = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
  if (counters) len = (int)counters[1];
  int kvh = h / (nh / nkv);
  int lo = (int)lo_rows[b];
  if (window > 0) lo = max(lo, len - window);
  int start = max(lo, split * chunk), end = min(len, (split + 1) * chunk);
  const T *qr = q + ((long)b * nh + h) * hd;
  long kv_off = ((long)b * nkv + kvh) * (long)cap * hd;
  const T *kb = kc + kv_off;
  const T *vb = vc + kv_off;
  float *sc = scores + ((long)b * nh + h) * (long)cap;
  float *out = part + (((long)b * nh + h) * splits + split) * (hd + 2);
  float *qs = dsh, *acc_sh = dsh + hd;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = ld(qr, d);
  __syncthreads();
  float m = dec_scores<T, LANES>(qs, kb, hd, start, end, scale, softcap, sc);
  float l = 0.f;
  for (int j = start + threadIdx.x; j < end; j += blockDim.x) {
    float e = expf(sc[j] - m);
    sc[j] = e;
    l += e;
  }
  l = block_sum(l);  // its barriers publish the exponentials written above
  int groups = dec_values<T>(sc, vb, hd, start, end, acc_sh);
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float s = 0.f;
    if (end > start)
      for (int gg = 0; gg < groups; ++gg) s += acc_sh[gg * hd + d];
    out[d] = s;
  }
  if (threadIdx.x == 0) {
    out[hd] = end > start ? m : -INFINITY;
    out[hd + 1] = end > start ? l : 0.f;
  }
}

// out[b][h] = Σ_split exp(m − M) · acc / Σ_split exp(m − M) · l over the splits of
// dec_attention_part (M the largest m), rounded to T; one block per (query head, row), blockDim.x
// a multiple of 32. Each split's weight exp(m − M) is computed once, by one thread, into dynamic
// shared memory (`splits` floats); the sums over splits then load 8 splits' partials at a time.
template <typename T>
__device__ void dec_attention_combine(const float *part, T *out, int nh, int hd, int splits) {
  FT_DYNAMIC_SHARED(float, weight);
  pdl_trigger();
  pdl_wait();
  int h = blockIdx.x, b = blockIdx.y;
  long stride = hd + 2;
  const float *p = part + ((long)b * nh + h) * splits * stride;
  float mx = -INFINITY;
  for (int s = threadIdx.x; s < splits; s += blockDim.x) mx = fmaxf(mx, p[s * stride + hd]);
  mx = block_max(mx);
  float denom = 0.f;
  for (int s = threadIdx.x; s < splits; s += blockDim.x) {
    float m = p[s * stride + hd];
    float e = m != -INFINITY ? expf(m - mx) : 0.f;
    weight[s] = e;
    denom += e * p[s * stride + hd + 1];
  }
  denom = block_sum(denom);  // its barriers publish `weight`
  float inv = denom > 0.f ? 1.f / denom : 0.f;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float v = 0.f;
    int s = 0;
    for (; s + 8 <= splits; s += 8) {
      float a[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) a[u] = p[(s + u) * stride + d];
#pragma unroll
      for (int u = 0; u < 8; ++u) v += weight[s + u] * a[u];
    }
    for (; s < splits; ++s) v += weight[s] * p[s * stride + d];
    st(out, ((long)b * nh + h) * hd + d, v * inv);
  }
}

// ---------------------------------------------------------------------------------------------
#define FOR_TYPES(X) X(float, f32) X(bf16, bf16)

// The decode attention's two kernels with one score pass (dec_scores): dec_attention_<SUF> and
// dec_attention_part_<SUF> per thread (LANES false, INFIX empty), dec_attention_lanes_<SUF> and
// dec_attention_part_lanes_<SUF> with lanes sharing a key.
#define EXPORT_DEC_ATTENTION(T, SUF, INFIX, LANES)                                                  \
  extern "C" __global__ void dec_attention_##INFIX##SUF(                                            \
      const T *q, const T *kc, const T *vc, T *out, float *scores, const uint32_t *lo_rows,       \
      int len, int window, int nh, int nkv, int hd, int cap, float scale, float softcap,          \
      const uint32_t *counters) {                                                                 \
    dec_attention<T, LANES>(q, kc, vc, out, scores, lo_rows, len, window, nh, nkv, hd, cap, scale, \
                            softcap, counters);                                                   \
  }                                                                                               \
  extern "C" __global__ void dec_attention_part_##INFIX##SUF(                                       \
      const T *q, const T *kc, const T *vc, float *part, float *scores, const uint32_t *lo_rows,  \
      int len, int window, int nh, int nkv, int hd, int cap, int chunk, float scale,              \
      float softcap, const uint32_t *counters) {                                                  \
    dec_attention_part<T, LANES>(q, kc, vc, part, scores, lo_rows, len, window, nh, nkv, hd, cap, \
                                 chunk, scale, softcap, counters);                                \
  }

#define EXPORT(T, SUF)                                                                              \
  extern "C" __global__ void rmsnorm_fwd_##SUF(const T *x, const T *w, T *y, int h, float eps,      \
                                             int offset_one) {                                    \
    rmsnorm_fwd<T>(x, w, y, h, eps, offset_one);                                                  \
  }                                                                                               \
  extern "C" __global__ void rmsnorm_bwd_##SUF(const T *x, const T *w, const T *dy, T *dx,          \
                                             float *dw_acc, int rows, int h, float eps,           \
                                             int offset_one, int rows_per_block) {                \
    rmsnorm_bwd<T>(x, w, dy, dx, dw_acc, rows, h, eps, offset_one, rows_per_block);               \
  }                                                                                               \
  extern "C" __global__ void glu_fwd_##SUF(const T *g, const T *u, T *y, long n, int act) {         \
    glu_fwd<T>(g, u, y, n, act);                                                                  \
  }                                                                                               \
  extern "C" __global__ void glu_bwd_##SUF(const T *g, const T *u, const T *dy, T *dg, T *du,       \
                                         long n, int act) {                                       \
    glu_bwd<T>(g, u, dy, dg, du, n, act);                                                         \
  }                                                                                               \
  extern "C" __global__ void rope_##SUF(const T *x, const T *c, const T *s, T *y, long n, int heads, \
                                      int t, int d, int rot, int cos_per_batch, int backward,     \
                                      long sb, long sh, long st_) {                               \
    rope<T>(x, c, s, y, n, heads, t, d, rot, cos_per_batch, backward, sb, sh, st_);               \
  }                                                                                               \
  extern "C" __global__ void attn_softcap_bwd_##SUF(T *S, T *dP, const float *stats,             \
                                                    const float *D, const float *mask, int rows,   \
                                                    int L, int C, int r0, int ks, int nkv, int s,  \
                                                    long mask_bstride, float scale,                \
                                                    float softcap) {                               \
    attn_softcap_bwd<T>(S, dP, stats, D, mask, rows, L, C, r0, ks, nkv, s, mask_bstride, scale,    \
                        softcap);                                                                  \
  }                                                                                               \
  extern "C" __global__ void attn_softmax_##SUF(T *S, float *lse, const float *mask, int rows,      \
                                              int L, int C, int r0, int ks, int nkv, int s,       \
                                              long mask_bstride, float scale, int recompute,      \
                                              float softcap) {                                    \
    attn_softmax<T>(S, lse, mask, rows, L, C, r0, ks, nkv, s, mask_bstride, scale, recompute,     \
                    softcap);                                                                     \
  }                                                                                               \
  extern "C" __global__ void attn_dsoftmax_##SUF(const T *P, T *dP, const float *D, long n,        \
                                               int L, float scale) {                              \
    attn_dsoftmax<T>(P, dP, D, n, L, scale);                                                      \
  }                                                                                               \
  extern "C" __global__ void row_dot_##SUF(const T *a, const T *b, float *out, long rows, int d) { \
    row_dot<T>(a, b, out, rows, d);                                                               \
  }                                                                                               \
  extern "C" __global__ void add_rows_##SUF(float *dst, const T *src, int nb, long inner,           \
                                          long dst_stride, long off) {                            \
    add_rows<T>(dst, src, nb, inner, dst_stride, off);                                            \
  }                                                                                               \
  extern "C" __global__ void ce_fwd_bwd_##SUF(T *logits, const uint32_t *targets, float *loss,      \
                                            int V) {                                              \
    ce_fwd_bwd<T>(logits, targets, loss, V);                                                      \
  }                                                                                               \
  extern "C" __global__ void scatter_rows_##SUF(T *dst, const T *src, const uint32_t *idx, long m, \
                                              int h) {                                            \
    scatter_rows<T>(dst, src, idx, m, h);                                                         \
  }                                                                                               \
  extern "C" __global__ void bias_add_##SUF(T *out, const T *bias, long rows, int cols) {         \
    bias_add<T>(out, bias, rows, cols);                                                           \
  }                                                                                               \
  extern "C" __global__ void nf4_dequant_##SUF(const uint8_t *codes, const int8_t *scalers,        \
                                             const float *factors, const float *levels,           \
                                             float mean, T *out, long n) {                        \
    nf4_dequant<T>(codes, scalers, factors, levels, mean, out, n);                                \
  }                                                                                               \
  extern "C" __global__ void dec_qkv_rope_##SUF(const T *qkv, const T *cs, const T *sn,             \
                                              const T *qn, const T *kn, float eps, int offset_one, \
                                              T *q_out, T *kc, T *vc, int nh, int nkv, int hd,    \
                                              int rot, int cap, int pos,                          \
                                              const uint32_t *counters) {                         \
    dec_qkv_rope<T>(qkv, cs, sn, qn, kn, eps, offset_one, q_out, kc, vc, nh, nkv, hd, rot, cap,   \
                    pos, counters);                                                               \
  }                                                                                               \
  EXPORT_DEC_ATTENTION(T, SUF, , false)                                                             \
  EXPORT_DEC_ATTENTION(T, SUF, lanes_, true)                                                        \
  extern "C" __global__ void dec_attention_combine_##SUF(const float *part, T *out, int nh,       \
                                                         int hd, int splits) {                    \
    dec_attention_combine<T>(part, out, nh, hd, splits);                                          \
  }                                                                                               \
  extern "C" __global__ void adamw_##SUF(float *p32, T *p_out, const T *g, float *m, float *v,    \
                                         long n, float grad_scale, float decay, float omb1,      \
                                         float b2, float omb2, float bc2_sqrt, float eps,        \
                                         float neg_step) {                                        \
    adamw<T>(p32, p_out, g, m, v, n, grad_scale, decay, omb1, b2, omb2, bc2_sqrt, eps, neg_step); \
  }

FOR_TYPES(EXPORT)

// Flash attention's forward and backward, one kernel per head dim (its fragments are unrolled per D).
#define EXPORT_FLASH(D)                                                                             \
  extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_fwd_bf16_d##D(                     \
      const bf16 *q, const bf16 *k, const bf16 *v, const float *mask, long mask_bstride,            \
      const int *row_keys, float masked, const int *key_range, int t, int s, int nh, int nkv,       \
      float scale, float softcap, bf16 *o, float *stats) {                                          \
    flash_fwd<D>(q, k, v, {mask, mask_bstride, row_keys, masked}, key_range, t, s, nh, nkv, scale,  \
                 softcap, o, stats);                                                                \
  }                                                                                                 \
  extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_bwd_dkdv_bf16_d##D(                \
      const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *dout, const float *stats,           \
      const float *drow, const float *mask, long mask_bstride, const int *row_keys, float masked,   \
      const int *key_range, int t, int s, int nh, int nkv, float scale, float softcap, float *dk,   \
      float *dv) {                                                                                  \
    flash_bwd_dkdv<D>(q, k, v, dout, stats, drow, {mask, mask_bstride, row_keys, masked},          \
                      key_range, t, s, nh, nkv, scale, softcap, dk, dv);                            \
  }                                                                                                 \
  extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_bwd_dq_bf16_d##D(                  \
      const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *dout, const float *stats,           \
      const float *drow, const float *mask, long mask_bstride, const int *row_keys, float masked,   \
      const int *key_range, int t, int s, int nh, int nkv, float scale, float softcap, bf16 *dq) {  \
    flash_bwd_dq<D>(q, k, v, dout, stats, drow, {mask, mask_bstride, row_keys, masked}, key_range, \
                    t, s, nh, nkv, scale, softcap, dq);                                             \
  }
EXPORT_FLASH(64)
EXPORT_FLASH(96)
EXPORT_FLASH(128)

// The decode GEMVs, one kernel per row count NB (1..8): registers, and with them occupancy, are
// set per kernel, so one kernel for all counts would run batch 1 at batch 8's register budget.
#define EXPORT_DEC_ROWS(T, SUF, NB)                                                                 \
  extern "C" __global__ void dec_gemv_##SUF##_##NB(const T *x, int K, const T *w0, const T *b0,    \
                                                 int n0, const T *w1, const T *b1, int n1,        \
                                                 const T *w2, const T *b2, int n2,                \
                                                 const T *residual, T *out) {                     \
    dec_gemv<T, NB>(x, K, w0, b0, n0, w1, b1, n1, w2, b2, n2, residual, out);                     \
  }                                                                                               \
  extern "C" __global__ void dec_gated_gemv_##SUF##_##NB(const T *x, int K, const T *wg,           \
                                                       const T *bg, const T *wu, const T *bu,     \
                                                       int N, T *out, int act) {                  \
    dec_gated_gemv<T, NB>(x, K, wg, bg, wu, bu, N, out, act);                                     \
  }
#define EXPORT_DEC(T, SUF)                                                                          \
  EXPORT_DEC_ROWS(T, SUF, 1) EXPORT_DEC_ROWS(T, SUF, 2) EXPORT_DEC_ROWS(T, SUF, 3)                  \
  EXPORT_DEC_ROWS(T, SUF, 4) EXPORT_DEC_ROWS(T, SUF, 5) EXPORT_DEC_ROWS(T, SUF, 6)                  \
  EXPORT_DEC_ROWS(T, SUF, 7) EXPORT_DEC_ROWS(T, SUF, 8)

FOR_TYPES(EXPORT_DEC)
