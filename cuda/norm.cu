// norm.cu — LayerNorm and RMSNorm over the last axis, forward and backward.
//
// Forward, per row of x [rows, hidden] (RMS = false / true):
//   LayerNorm: mu = mean(x), rs = rsqrt(mean((x - mu)^2) + eps), y = (x - mu) rs g + beta
//   RMSNorm:   rs = rsqrt(mean(x^2) + eps),                      y = x rs g
//   g = gamma (+1 with zero_centered_gamma). mu, rsigma [rows] float are saved.
// Backward, per row: xhat = (x - mu) rs, dxhat = dy g,
//   dx = rs (dxhat - mean(dxhat) - xhat mean(dxhat xhat))   (no mean(dxhat) term for RMS)
//   dgamma = sum_rows dy xhat, dbeta = sum_rows dy.
// Launch: one block per row (forward) or a grid-stride over rows (backward); thread t owns
// the VEC-wide chunks c = t + k blockDim, k < CHUNKS, of every row and keeps them in
// registers, so x and dy are read once. The backward sums its rows' dgamma/dbeta in
// registers and writes one partial row per block [2 hidden]; norm_bwd_reduce adds them up.
#include "common.cuh"

// ---- forward ---------------------------------------------------------------------------
template <typename T, int VEC, int CHUNKS, bool RMS>
__global__ void norm_fwd(const T* __restrict__ x, const T* __restrict__ gamma,
                         const T* __restrict__ beta, T* __restrict__ y,
                         float* __restrict__ mu, float* __restrict__ rsigma, int hidden,
                         float eps, int zero_centered) {
    const long long off = (long long)blockIdx.x * hidden;
    float v[CHUNKS][VEC];
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
        const int i = (threadIdx.x + k * blockDim.x) * VEC;
        if (i < hidden) {
            const Vec<T, VEC> a = load_vec<VEC>(x + off + i);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                v[k][j] = to_float(a.v[j]);
                sum += RMS ? v[k][j] * v[k][j] : v[k][j];
            }
        }
    }
    const float mean = RMS ? 0.f : block_sum(sum) / hidden;
    float sq = RMS ? sum : 0.f;
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k)
        if (!RMS && (threadIdx.x + k * blockDim.x) * VEC < hidden)
#pragma unroll
            for (int j = 0; j < VEC; ++j) sq += (v[k][j] - mean) * (v[k][j] - mean);
    const float rs = rsqrtf(block_sum(sq) / hidden + eps);
    const float zc = zero_centered ? 1.f : 0.f;
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
        const int i = (threadIdx.x + k * blockDim.x) * VEC;
        if (i < hidden) {
            const Vec<T, VEC> g = load_vec<VEC>(gamma + i);
            Vec<T, VEC> b, out;
            if (!RMS) b = load_vec<VEC>(beta + i);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                float o = (v[k][j] - mean) * rs * (to_float(g.v[j]) + zc);
                if (!RMS) o += to_float(b.v[j]);
                out.v[j] = from_float<T>(o);
            }
            store_vec<VEC>(y + off + i, out);
        }
    }
    if (threadIdx.x == 0) {
        if (!RMS) mu[blockIdx.x] = mean;
        rsigma[blockIdx.x] = rs;
    }
}

// ---- backward --------------------------------------------------------------------------
template <typename T, int VEC, int CHUNKS, bool RMS>
__global__ void norm_bwd(const T* __restrict__ dy, const T* __restrict__ x,
                         const float* __restrict__ mu, const float* __restrict__ rsigma,
                         const T* __restrict__ gamma, T* __restrict__ dx,
                         float* __restrict__ part, long long rows, int hidden,
                         int zero_centered) {
    float g[CHUNKS][VEC], dg[CHUNKS][VEC], db[CHUNKS][VEC];
    const float zc = zero_centered ? 1.f : 0.f;
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
        const int i = (threadIdx.x + k * blockDim.x) * VEC;
        Vec<T, VEC> gv;
        if (i < hidden) gv = load_vec<VEC>(gamma + i);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            g[k][j] = i < hidden ? to_float(gv.v[j]) + zc : 0.f;
            dg[k][j] = db[k][j] = 0.f;
        }
    }
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long off = row * hidden;
        const float m = RMS ? 0.f : mu[row], rs = rsigma[row];
        float xh[CHUNKS][VEC], dxh[CHUNKS][VEC];
        float s1 = 0.f, s2 = 0.f;  // sum dxhat, sum dxhat * xhat
#pragma unroll
        for (int k = 0; k < CHUNKS; ++k) {
            const int i = (threadIdx.x + k * blockDim.x) * VEC;
            if (i < hidden) {
                const Vec<T, VEC> a = load_vec<VEC>(x + off + i);
                const Vec<T, VEC> d = load_vec<VEC>(dy + off + i);
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const float dyf = to_float(d.v[j]);
                    xh[k][j] = (to_float(a.v[j]) - m) * rs;
                    dxh[k][j] = dyf * g[k][j];
                    s1 += dxh[k][j];
                    s2 += dxh[k][j] * xh[k][j];
                    dg[k][j] += dyf * xh[k][j];
                    db[k][j] += dyf;
                }
            }
        }
        s1 = RMS ? 0.f : block_sum(s1) / hidden;
        s2 = block_sum(s2) / hidden;
#pragma unroll
        for (int k = 0; k < CHUNKS; ++k) {
            const int i = (threadIdx.x + k * blockDim.x) * VEC;
            if (i < hidden) {
                Vec<T, VEC> out;
#pragma unroll
                for (int j = 0; j < VEC; ++j)
                    out.v[j] = from_float<T>(rs * (dxh[k][j] - s1 - xh[k][j] * s2));
                store_vec<VEC>(dx + off + i, out);
            }
        }
    }
    float* p = part + (long long)blockIdx.x * 2 * hidden;
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
        const int i = (threadIdx.x + k * blockDim.x) * VEC;
        if (i < hidden)
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                p[i + j] = dg[k][j];
                p[hidden + i + j] = db[k][j];
            }
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
