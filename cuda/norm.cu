// norm.cu — LayerNorm and RMSNorm over the last axis, forward and backward.
//
// Forward, per row of x [rows, hidden] (RMS = false / true):
//   LayerNorm: mu = mean(x), rs = rsqrt(mean((x - mu)^2) + eps), y = (x - mu) rs g + beta
//   RMSNorm:   rs = rsqrt(mean(x^2) + eps),                      y = x rs g
//   g = gamma (+1 with zero_centered_gamma). mu, rsigma [rows] float are saved. With an FP8
//   OUT type, y is written as FP8 codes of y * scale and amax[0] gets max |y| (the input of
//   the next FP8 GEMM, cast in the same pass).
// Backward, per row: xhat = (x - mu) rs, dxhat = dy g,
//   dx = rs (dxhat - mean(dxhat) - xhat mean(dxhat xhat))   (no mean(dxhat) term for RMS)
//   dgamma = sum_rows dy xhat, dbeta = sum_rows dy.
// Launch: a grid-stride over rows, a few blocks per SM. Thread t owns the VEC-wide chunks
// c = t + k blockDim (k < CHUNKS) of every row, in registers, so inputs are read once; the
// next row's chunks are loaded (packed) before this row's reductions, to keep memory busy.
// The backward sums dgamma/dbeta of its rows in registers and writes one partial row per
// block [2 hidden]; norm_bwd_reduce adds the partials up.
#include "common.cuh"

#define OWNED(k, i) \
    for (int k = 0, i = threadIdx.x * VEC; k < CHUNKS; ++k, i += blockDim.x * VEC)

template <typename T, int VEC, int CHUNKS>
__device__ __forceinline__ void load_row(Vec<T, VEC> (&r)[CHUNKS], const T* p, int hidden) {
#pragma unroll
    OWNED(k, i) if (i < hidden) r[k] = load_vec<VEC>(p + i);
}

// ---- forward ---------------------------------------------------------------------------
template <typename T, int VEC, int CHUNKS, bool RMS, typename OUT>
__global__ void __launch_bounds__(512)
norm_fwd(const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta,
         OUT* __restrict__ y, float* __restrict__ mu, float* __restrict__ rsigma,
         long long rows, int hidden, float eps, int zero_centered,
         const float* __restrict__ scale, float* __restrict__ amax) {
    const float zc = zero_centered ? 1.f : 0.f;
    const float sc = Out<OUT>::fp8 ? scale[0] : 1.f;
    float m = 0.f;
    Vec<T, VEC> nxt[CHUNKS];
    if (blockIdx.x < rows) load_row(nxt, x + blockIdx.x * (long long)hidden, hidden);
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        // One reduction for both moments, on data shifted by the row's first element (any
        // value near the mean keeps E[d^2] - E[d]^2 free of cancellation).
        const float x0 = RMS ? 0.f : to_float(x[row * hidden]);
        float v[CHUNKS][VEC];
        float sum = 0.f, sq = 0.f;
#pragma unroll
        OWNED(k, i) if (i < hidden)
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                v[k][j] = to_float(nxt[k].v[j]);
                const float d = v[k][j] - x0;
                sum += d;
                sq += d * d;
            }
        if (row + gridDim.x < rows) load_row(nxt, x + (row + gridDim.x) * hidden, hidden);
        const float2 s = block_sum2(sum, sq);
        const float dmean = s.x / hidden, mean = RMS ? 0.f : x0 + dmean;
        const float var = RMS ? s.y / hidden : fmaxf(s.y / hidden - dmean * dmean, 0.f);
        const float rs = rsqrtf(var + eps);
#pragma unroll
        OWNED(k, i) if (i < hidden) {
            const Vec<T, VEC> g = load_vec<VEC>(gamma + i);
            Vec<T, VEC> b;
            Vec<OUT, VEC> out;
            if (!RMS) b = load_vec<VEC>(beta + i);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                float o = (v[k][j] - mean) * rs * (to_float(g.v[j]) + zc);
                if (!RMS) o += to_float(b.v[j]);
                if (Out<OUT>::fp8) m = fmaxf(m, fabsf(o));
                out.v[j] = Out<OUT>::make(o, sc);
            }
            store_vec<VEC>(y + row * hidden + i, out);
        }
        if (threadIdx.x == 0) {
            if (!RMS) mu[row] = mean;
            rsigma[row] = rs;
        }
    }
    if (Out<OUT>::fp8) {
        m = block_max(m);
        if (threadIdx.x == 0 && m > 0.f) atomic_max_nonneg(amax, m);
    }
}

// One warp per row, four rows per block: the reductions are warp shuffles only (no block
// barrier), and with the row packed in registers many rows stay in flight per SM.
// Lane l owns chunks c = l + 32 k, k < CHUNKS.
template <typename T, int VEC, int CHUNKS, bool RMS, typename OUT>
__global__ void __launch_bounds__(128)
norm_fwd_warp(const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta,
              OUT* __restrict__ y, float* __restrict__ mu, float* __restrict__ rsigma,
              long long rows, int hidden, float eps, int zero_centered,
              const float* __restrict__ scale, float* __restrict__ amax) {
    const int lane = threadIdx.x & 31;
    const float zc = zero_centered ? 1.f : 0.f;
    const float sc = Out<OUT>::fp8 ? scale[0] : 1.f;
    float m = 0.f;
    for (long long row = blockIdx.x * 4LL + (threadIdx.x >> 5); row < rows;
         row += gridDim.x * 4LL) {
        const T* xr = x + row * hidden;
        Vec<T, VEC> a[CHUNKS];
#pragma unroll
        for (int k = 0; k < CHUNKS; ++k) {
            const int i = (lane + 32 * k) * VEC;
            if (i < hidden) a[k] = load_vec<VEC>(xr + i);
        }
        const float x0 = RMS ? 0.f : to_float(xr[0]);
        float sum = 0.f, sq = 0.f;
#pragma unroll
        for (int k = 0; k < CHUNKS; ++k)
            if ((lane + 32 * k) * VEC < hidden)
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const float d = to_float(a[k].v[j]) - x0;
                    sum += d;
                    sq += d * d;
                }
        sum = warp_sum(sum);
        sq = warp_sum(sq);
        const float dmean = sum / hidden, mean = RMS ? 0.f : x0 + dmean;
        const float var = RMS ? sq / hidden : fmaxf(sq / hidden - dmean * dmean, 0.f);
        const float rs = rsqrtf(var + eps);
#pragma unroll
        for (int k = 0; k < CHUNKS; ++k) {
            const int i = (lane + 32 * k) * VEC;
            if (i < hidden) {
                const Vec<T, VEC> g = load_vec<VEC>(gamma + i);
                Vec<T, VEC> b;
                Vec<OUT, VEC> out;
                if (!RMS) b = load_vec<VEC>(beta + i);
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    float o = (to_float(a[k].v[j]) - mean) * rs * (to_float(g.v[j]) + zc);
                    if (!RMS) o += to_float(b.v[j]);
                    if (Out<OUT>::fp8) m = fmaxf(m, fabsf(o));
                    out.v[j] = Out<OUT>::make(o, sc);
                }
                store_vec<VEC>(y + row * hidden + i, out);
            }
        }
        if (lane == 0) {
            if (!RMS) mu[row] = mean;
            rsigma[row] = rs;
        }
    }
    if (Out<OUT>::fp8) {
        m = warp_reduce(m, MaxOp());
        if (lane == 0 && m > 0.f) atomic_max_nonneg(amax, m);
    }
}

// ---- backward --------------------------------------------------------------------------
// Each iteration takes ROWS rows at once (rows r, r + 1, ...): their loads are in flight
// together and one barrier pair reduces all their sums. Registers hold the dgamma/dbeta
// sums and the packed x, dy; xhat and dxhat are recomputed in the second pass and gamma
// re-read (an L1 hit), which keeps the kernel free of spills at CHUNKS * VEC = 16.
#define SLOT(i, j) ((j) * (hidden / VEC) + (i) / VEC)

template <typename T, int VEC, int CHUNKS, bool RMS, bool ACC_SMEM, int ROWS>
__global__ void __launch_bounds__(512)
norm_bwd(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mu,
         const float* __restrict__ rsigma, const T* __restrict__ gamma, T* __restrict__ dx,
         float* __restrict__ part, long long rows, int hidden, int zero_centered) {
    static_assert(ROWS == 1 || ROWS == 2, "one reduction takes the sums of at most 2 rows");
    // dgamma/dbeta sums of this block's rows: registers, or (ACC_SMEM) shared memory
    // [2 hidden], which frees registers for more resident rows. Each thread owns its columns;
    // in shared memory column i + j sits at j * (hidden / VEC) + i / VEC, so the lanes of a
    // warp touch consecutive words (no bank conflicts).
    extern __shared__ float acc[];
    float dg[ACC_SMEM ? 1 : CHUNKS][VEC], db[ACC_SMEM ? 1 : CHUNKS][VEC];
    const float zc = zero_centered ? 1.f : 0.f;
#pragma unroll
    OWNED(k, i)
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            if (ACC_SMEM && i < hidden) acc[SLOT(i, j)] = acc[hidden + SLOT(i, j)] = 0.f;
            if (!ACC_SMEM) dg[k][j] = db[k][j] = 0.f;
        }
    for (long long row0 = blockIdx.x * (long long)ROWS; row0 < rows;
         row0 += (long long)gridDim.x * ROWS) {
        Vec<T, VEC> cx[ROWS][CHUNKS], cd[ROWS][CHUNKS];
        float m[ROWS], rs[ROWS], s1[ROWS], s2[ROWS];  // s1 = sum dxhat, s2 = sum dxhat xhat
#pragma unroll
        for (int q = 0; q < ROWS; ++q) {
            const bool ok = row0 + q < rows;
            m[q] = (RMS || !ok) ? 0.f : mu[row0 + q];
            rs[q] = ok ? rsigma[row0 + q] : 0.f;
            s1[q] = s2[q] = 0.f;
            if (ok) {
                load_row(cx[q], x + (row0 + q) * hidden, hidden);
                load_row(cd[q], dy + (row0 + q) * hidden, hidden);
            }
        }
#pragma unroll
        OWNED(k, i) if (i < hidden) {
            const Vec<T, VEC> gv = load_vec<VEC>(gamma + i);
#pragma unroll
            for (int q = 0; q < ROWS; ++q) {
                if (row0 + q >= rows) continue;
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const float dyf = to_float(cd[q][k].v[j]);
                    const float xh = (to_float(cx[q][k].v[j]) - m[q]) * rs[q];
                    const float dxh = dyf * (to_float(gv.v[j]) + zc);
                    s1[q] += dxh;
                    s2[q] += dxh * xh;
                    if (ACC_SMEM) {
                        acc[SLOT(i, j)] += dyf * xh;
                        acc[hidden + SLOT(i, j)] += dyf;
                    } else {
                        dg[k][j] += dyf * xh;
                        db[k][j] += dyf;
                    }
                }
            }
        }
        float mean1[ROWS], mean2[ROWS];
        if (ROWS == 1) {
            const float2 s = block_sum2(s1[0], s2[0]);
            mean1[0] = s.x / hidden;
            mean2[0] = s.y / hidden;
        } else {
            const float4 s = block_sum4(s1[0], s2[0], s1[ROWS - 1], s2[ROWS - 1]);
            mean1[0] = s.x / hidden;
            mean2[0] = s.y / hidden;
            mean1[ROWS - 1] = s.z / hidden;
            mean2[ROWS - 1] = s.w / hidden;
        }
#pragma unroll
        OWNED(k, i) if (i < hidden) {
            const Vec<T, VEC> gv = load_vec<VEC>(gamma + i);
#pragma unroll
            for (int q = 0; q < ROWS; ++q) {
                if (row0 + q >= rows) continue;
                Vec<T, VEC> out;
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const float xh = (to_float(cx[q][k].v[j]) - m[q]) * rs[q];
                    const float dxh = to_float(cd[q][k].v[j]) * (to_float(gv.v[j]) + zc);
                    out.v[j] = from_float<T>(rs[q] * (dxh - (RMS ? 0.f : mean1[q])
                                                      - xh * mean2[q]));
                }
                store_vec<VEC>(dx + (row0 + q) * hidden + i, out);
            }
        }
    }
    float* p = part + (long long)blockIdx.x * 2 * hidden;
#pragma unroll
    OWNED(k, i) if (i < hidden)
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            p[i + j] = ACC_SMEM ? acc[SLOT(i, j)] : dg[k][j];
            p[hidden + i + j] = ACC_SMEM ? acc[hidden + SLOT(i, j)] : db[k][j];
        }
}

// dgamma[c] = sum_b part[b, c], dbeta[c] = sum_b part[b, hidden + c]. Launch: blocks of
// (32, 8) threads, one block per 32 of the 2 hidden columns; the 8 rows of threads split the
// partials and meet in shared memory (one thread per column alone would leave most SMs idle).
template <typename T>
__global__ void norm_bwd_reduce(const float* __restrict__ part, int nparts, int hidden,
                                T* __restrict__ dgamma, T* __restrict__ dbeta, int has_beta) {
    __shared__ float acc[8][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    float a = 0.f;
    if (c < 2 * hidden)
        for (int k = threadIdx.y; k < nparts; k += 8) a += part[(long long)k * 2 * hidden + c];
    acc[threadIdx.y][threadIdx.x] = a;
    __syncthreads();
    if (threadIdx.y == 0 && c < 2 * hidden) {
        float t = 0.f;
#pragma unroll
        for (int y = 0; y < 8; ++y) t += acc[y][threadIdx.x];
        if (c < hidden) dgamma[c] = from_float<T>(t);
        else if (has_beta) dbeta[c - hidden] = from_float<T>(t);
    }
}
