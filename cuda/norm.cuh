// norm.cuh — LayerNorm and RMSNorm over the last axis: the per-row maths that the forward
// (norm_fwd.cu) and backward (norm_bwd.cu) kernels share, written once here.
//
// Forward, per row of x [rows, hidden] (RMS = false / true):
//   LayerNorm: mu = mean(x), rs = rsqrt(mean((x - mu)^2) + eps), y = (x - mu) rs g + beta
//   RMSNorm:   rs = rsqrt(mean(x^2) + eps),                      y = x rs g
//   g = gamma (+1 with zero_centered_gamma). mu, rsigma [rows] float are saved. With an FP8
//   OUT type, y is written as FP8 codes of y * scale and amax[0] gets max |y| (the input of
//   the next FP8 GEMM, cast in the same pass).
// Backward, per row: xhat = (x - mu) rs, dxhat = dy g,
//   dx = rs (dxhat - mean(dxhat) - xhat mean(dxhat xhat))   (no mean(dxhat) term for RMS)
//   dgamma = sum_rows dy xhat, dbeta = sum_rows dy: each block sums its rows into one
//   partial row [2 hidden] of float; norm_bwd_reduce(_vec) adds the partials up.
// A chunk is VEC elements moved as one vector: 16 bytes, or one element where rows are not
// 16-byte multiples. Kernels (tecupy/kernels/norm.py picks one per shape and GPU; PERFLOG.md
// says why each exists and what it measured):
//   norm_fwd_stream  Hopper, 16-byte rows of >= 4 KB: G warps per row, rows streamed into
//                    shared memory by bulk copies (the default there)
//   norm_fwd_warp    a warp per row, the row in registers (up to 16 chunks per lane)
//   norm_fwd         a block per row, the row in registers (longer rows)
//   norm_bwd_grp     Hopper, 16-byte rows of <= 2 chunks per thread: groups of threads, each
//                    streaming rows into shared memory by bulk copies (the default there)
//   norm_bwd_ring    those rows elsewhere: a block per row, next rows streamed by cp.async
//   norm_bwd         every other row: a block per row (two for short rows), from registers
#pragma once
#include "common.cuh"

// The chunks k < CHUNKS of a thread: elements i = first + k stride (a block per row: first
// = threadIdx.x VEC, stride = blockDim.x VEC; so a warp reads consecutive vectors).
#define CHUNKS_OF(k, i, first, stride) \
    for (int k = 0, i = (first); k < CHUNKS; ++k, i += (stride))
#define OWNED(k, i) CHUNKS_OF(k, i, threadIdx.x * VEC, blockDim.x * VEC)

template <typename T, int VEC, int CHUNKS>
__device__ __forceinline__ void load_row(Vec<T, VEC> (&r)[CHUNKS], const T* p, int hidden) {
#pragma unroll
    OWNED(k, i) if (i < hidden) r[k] = load_vec<VEC>(p + i);
}

// ---- forward -----------------------------------------------------------------------------
// The moments are one reduction of two sums over x - x0 (one barrier pair instead of two),
// x0 the mean of the row's (or the warp's portion's) first chunk: any value near the row's
// mean keeps E[d^2] - E[d]^2 free of cancellation; one element alone may sit 4 sigma out,
// and then the variance lost 4 bits (float32 rows failed the test).
template <typename T, int VEC> __device__ __forceinline__ float shift_of(const Vec<T, VEC> a) {
    float f[VEC], s = 0.f;  // a by value: one 16-byte (shared) load, not VEC 2-byte ones
    unpack(a, f);
#pragma unroll
    for (int j = 0; j < VEC; ++j) s += f[j];
    return s * (1.f / VEC);
}

// sum += sum of (x(j) - x0), sq += sum of (x(j) - x0)^2 over the VEC elements x(j) of one
// chunk, the chunk summed first so a thread's running sums stay short (a long sequential
// float sum lost digits at 3000 wide).
template <int VEC, typename X>
__device__ __forceinline__ void add_moments(X x, float x0, float& sum, float& sq) {
    float cs = 0.f, cq = 0.f;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        const float d = x(j) - x0;
        cs += d;
        cq += d * d;
    }
    sum += cs;
    sq += cq;
}
template <typename T, int VEC>
__device__ __forceinline__ void add_moments(const Vec<T, VEC> a, float x0, float& sum,
                                            float& sq) {  // a by value: one 16-byte load
    float f[VEC];
    unpack(a, f);
    add_moments<VEC>([&](int j) { return f[j]; }, x0, sum, sq);
}

// (mean, rs) of a row from its sums over hidden elements (shifted by x0; RMS: x0 = 0, and
// only sq counts)
template <bool RMS>
__device__ __forceinline__ float2 row_stats(float sum, float sq, float x0, int hidden,
                                            float eps) {
    const float dmean = sum / hidden, mean = RMS ? 0.f : x0 + dmean;
    const float var = RMS ? sq / hidden : fmaxf(sq / hidden - dmean * dmean, 0.f);
    return make_float2(mean, rsqrtf(var + eps));
}

// The register kernels' output chunk at element i of the row yr, x(j) its elements as
// floats: y = (x - mean) rs g + beta, g = gamma + zc (gamma and beta from global memory: L1
// hits after the first row), amax of y maxed into m for an FP8 OUT. (norm_fwd_stream has
// its own form: norm_fwd.cu.)
template <typename T, int VEC, bool RMS, typename OUT, typename X>
__device__ __forceinline__ void store_y(OUT* yr, X x, const T* gamma, const T* beta, int i,
                                        float2 st, float zc, float sc, float& m) {
    const float mean = st.x, rs = st.y;
    const Vec<T, VEC> g = load_vec<VEC>(gamma + i);
    Vec<T, VEC> b;
    float o[VEC];
    if (!RMS) b = load_vec<VEC>(beta + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        o[j] = (x(j) - mean) * rs * (to_float(g.v[j]) + zc);
        if (!RMS) o[j] += to_float(b.v[j]);
        if (Out<OUT>::fp8) m = fmaxf(m, fabsf(o[j]));
    }
    store_vec<VEC>(yr + i, make_out<OUT, VEC>(o, sc));
}

// ---- backward ----------------------------------------------------------------------------
// norm_bwd and norm_bwd_ring, one element x, dy (of T) with g() = gamma (+1), mu (0 for
// RMSNorm) and rs of its row: xhat = (x - mu) rs, dxhat = dy g. The row's sums s1 +=
// dxhat, s2 += dxhat xhat and the column's dg += dy xhat, db += dy; xhat and dxhat are
// recomputed for dx (fewer live registers than keeping them).
template <typename T, typename G>
__device__ __forceinline__ void bwd_sums(T x, T dy, G g, float mu, float rs, float& s1,
                                         float& s2, float& dg, float& db) {
    const float dyf = to_float(dy);
    const float xh = (to_float(x) - mu) * rs;
    const float dxh = dyf * g();
    s1 += dxh;
    s2 += dxh * xh;
    dg += dyf * xh;
    db += dyf;
}
// dx once the row's mean1 = s1 / hidden (0 for RMSNorm) and mean2 = s2 / hidden are known.
template <typename T, typename G>
__device__ __forceinline__ float bwd_dx(T x, T dy, G g, float mu, float rs, float mean1,
                                        float mean2) {
    const float xh = (to_float(x) - mu) * rs;
    const float dxh = to_float(dy) * g();
    return rs * (dxh - mean1 - xh * mean2);
}

// norm_bwd_grp's forms of the same maths, with d = x - mu (fewest instructions per element;
// they round differently, so each kernel keeps its own): s1 += g dy, s2 += g dy d, dg +=
// dy d rs, db += dy (RMS: no s1, no db); dx = dy (g rs) - (d c2 + c1) with c1 = rs s1 / n,
// c2 = rs^3 s2 / n (= rs (dxhat - mean1 - xhat mean2)).
template <bool RMS>
__device__ __forceinline__ void grp_sums(float x, float dy, float g, float mu, float rs,
                                         float& s1, float& s2, float& dg, float& db) {
    const float t = dy * (x - mu);
    dg = fmaf(t, rs, dg);
    s2 = fmaf(g, t, s2);
    if (!RMS) {
        s1 = fmaf(g, dy, s1);
        db += dy;
    }
}
__device__ __forceinline__ float grp_dx(float x, float dy, float g, float mu, float rs,
                                        float c1, float c2) {
    return fmaf(dy, g * rs, -fmaf(x - mu, c2, c1));
}
