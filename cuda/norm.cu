// norm.cu — LayerNorm and RMSNorm over the last axis, forward and backward.
//
// Forward, per row of x [rows, hidden] (RMS = false / true):
//   LayerNorm: mu = mean(x), rs = rsqrt(mean((x - mu)^2) + eps), y = (x - mu) rs g + beta
//   RMSNorm:   rs = rsqrt(mean(x^2) + eps),                      y = x rs g
//   g = gamma (+1 with zero_centered_gamma). mu, rsigma [rows] float are saved.
//   Launch: one block per row, the row kept in shared memory as float (hidden * 4 bytes);
//   each thread owns the VEC-wide chunks i = (t + k * blockDim) * VEC.
// Backward, per row: xhat = (x - mu) rs, dxhat = dy g,
//   dx = rs (dxhat - mean(dxhat) - xhat mean(dxhat xhat))   (no mean(dxhat) term for RMS)
//   dgamma = sum_rows dy xhat, dbeta = sum_rows dy: each block sums its rows into shared
//   memory [2 * hidden] and writes one partial row; norm_bwd_reduce sums the partials.
//   Launch: grid-stride over rows, a few blocks per SM.
#include "common.cuh"

// ---- forward ---------------------------------------------------------------------------
template <typename T, int VEC, bool RMS>
__global__ void norm_fwd(const T* __restrict__ x, const T* __restrict__ gamma,
                         const T* __restrict__ beta, T* __restrict__ y,
                         float* __restrict__ mu, float* __restrict__ rsigma, int hidden,
                         float eps, int zero_centered) {
    extern __shared__ float srow[];
    const long long off = (long long)blockIdx.x * hidden;
    const int step = blockDim.x * VEC;
    float sum = 0.f;
    for (int i = threadIdx.x * VEC; i < hidden; i += step) {
        const Vec<T, VEC> a = load_vec<VEC>(x + off + i);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const float f = to_float(a.v[j]);
            srow[i + j] = f;
            sum += RMS ? f * f : f;
        }
    }
    const float mean = RMS ? 0.f : block_sum(sum) / hidden;
    float sq = RMS ? sum : 0.f;
    if (!RMS) {
        for (int i = threadIdx.x * VEC; i < hidden; i += step)
#pragma unroll
            for (int j = 0; j < VEC; ++j) sq += (srow[i + j] - mean) * (srow[i + j] - mean);
    }
    const float rs = rsqrtf(block_sum(sq) / hidden + eps);
    const float zc = zero_centered ? 1.f : 0.f;
    for (int i = threadIdx.x * VEC; i < hidden; i += step) {
        const Vec<T, VEC> g = load_vec<VEC>(gamma + i);
        Vec<T, VEC> b, out;
        if (!RMS) b = load_vec<VEC>(beta + i);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            float v = (srow[i + j] - mean) * rs * (to_float(g.v[j]) + zc);
            if (!RMS) v += to_float(b.v[j]);
            out.v[j] = from_float<T>(v);
        }
        store_vec<VEC>(y + off + i, out);
    }
    if (threadIdx.x == 0) {
        if (!RMS) mu[blockIdx.x] = mean;
        rsigma[blockIdx.x] = rs;
    }
}

// ---- backward --------------------------------------------------------------------------
template <typename T, int VEC, bool RMS>
__global__ void norm_bwd(const T* __restrict__ dy, const T* __restrict__ x,
                         const float* __restrict__ mu, const float* __restrict__ rsigma,
                         const T* __restrict__ gamma, T* __restrict__ dx,
                         float* __restrict__ part, long long rows, int hidden,
                         int zero_centered) {
    extern __shared__ float sacc[];  // [0, hidden): dgamma, [hidden, 2 hidden): dbeta
    const int step = blockDim.x * VEC;
    const float zc = zero_centered ? 1.f : 0.f;
    for (int i = threadIdx.x * VEC; i < hidden; i += step)
#pragma unroll
        for (int j = 0; j < VEC; ++j) sacc[i + j] = sacc[hidden + i + j] = 0.f;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long off = row * hidden;
        const float m = RMS ? 0.f : mu[row], rs = rsigma[row];
        float s1 = 0.f, s2 = 0.f;  // sum dxhat, sum dxhat * xhat
        for (int i = threadIdx.x * VEC; i < hidden; i += step) {
            const Vec<T, VEC> a = load_vec<VEC>(x + off + i), d = load_vec<VEC>(dy + off + i);
            const Vec<T, VEC> g = load_vec<VEC>(gamma + i);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const float xh = (to_float(a.v[j]) - m) * rs, dyf = to_float(d.v[j]);
                const float dxh = dyf * (to_float(g.v[j]) + zc);
                s1 += dxh;
                s2 += dxh * xh;
                sacc[i + j] += dyf * xh;
                sacc[hidden + i + j] += dyf;
            }
        }
        s1 = RMS ? 0.f : block_sum(s1) / hidden;
        s2 = block_sum(s2) / hidden;
        for (int i = threadIdx.x * VEC; i < hidden; i += step) {
            const Vec<T, VEC> a = load_vec<VEC>(x + off + i), d = load_vec<VEC>(dy + off + i);
            const Vec<T, VEC> g = load_vec<VEC>(gamma + i);
            Vec<T, VEC> out;
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const float xh = (to_float(a.v[j]) - m) * rs;
                const float dxh = to_float(d.v[j]) * (to_float(g.v[j]) + zc);
                out.v[j] = from_float<T>(rs * (dxh - s1 - xh * s2));
            }
            store_vec<VEC>(dx + off + i, out);
        }
    }
    float* p = part + (long long)blockIdx.x * 2 * hidden;
    for (int i = threadIdx.x * VEC; i < hidden; i += step)
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            p[i + j] = sacc[i + j];
            p[hidden + i + j] = sacc[hidden + i + j];
        }
}

// dgamma[c] = sum_b part[b, c], dbeta[c] = sum_b part[b, hidden + c]; one thread per column.
template <typename T>
__global__ void norm_bwd_reduce(const float* __restrict__ part, int nparts, int hidden,
                                T* __restrict__ dgamma, T* __restrict__ dbeta, int has_beta) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= hidden) return;
    float g = 0.f, b = 0.f;
    for (int k = 0; k < nparts; ++k) {
        g += part[(long long)k * 2 * hidden + c];
        b += part[(long long)k * 2 * hidden + hidden + c];
    }
    dgamma[c] = from_float<T>(g);
    if (has_beta) dbeta[c] = from_float<T>(b);
}
