// softmax.cu — scaled, masked softmax over the last axis and its backward (the unfused
// attention path).
//
// x [rows, sk] viewed as [..., sq, sk]; row r is query i = r % sq. Entry j is excluded when
// mask[r, j] != 0 (HAS_MASK; the mask is materialized to x's shape) or, with causal,
// j > i. y = exp(scale x - m) / sum over kept entries, m = max over kept; a row with every
// entry excluded gives zeros. Backward: dx = scale y (dy - sum(dy y)).
// Launch: one block per row, 128 threads; the row is read three times (max, sum, write):
// the second and third reads hit L1/L2.
#include "common.cuh"

template <bool HAS_MASK>
__device__ __forceinline__ bool kept(const unsigned char* mask, long long r, int j, int i,
                                     int causal, int sk) {
    if (causal && j > i) return false;
    return !HAS_MASK || mask[r * sk + j] == 0;
}

template <typename T, bool HAS_MASK>
__global__ void softmax_fwd(const T* __restrict__ x, const unsigned char* __restrict__ mask,
                            T* __restrict__ y, int sq, int sk, float scale, int causal) {
    const long long r = blockIdx.x;
    const int i = (int)(r % sq);
    const T* xr = x + r * sk;
    float m = -kInf;
    for (int j = threadIdx.x; j < sk; j += blockDim.x)
        if (kept<HAS_MASK>(mask, r, j, i, causal, sk)) m = fmaxf(m, scale * to_float(xr[j]));
    m = block_max(m, -kInf);
    if (m == -kInf) m = 0.f;  // nothing kept (or only -inf): the row becomes zeros
    float s = 0.f;
    for (int j = threadIdx.x; j < sk; j += blockDim.x)
        if (kept<HAS_MASK>(mask, r, j, i, causal, sk)) s += expf(scale * to_float(xr[j]) - m);
    s = block_sum(s);
    const float denom = s > 0.f ? s : 1.f;
    for (int j = threadIdx.x; j < sk; j += blockDim.x) {
        const bool k = kept<HAS_MASK>(mask, r, j, i, causal, sk);
        y[r * sk + j] = from_float<T>(k ? expf(scale * to_float(xr[j]) - m) / denom : 0.f);
    }
}

template <typename T>
__global__ void softmax_bwd(const T* __restrict__ dy, const T* __restrict__ y,
                            T* __restrict__ dx, int sk, float scale) {
    const long long off = (long long)blockIdx.x * sk;
    float dot = 0.f;
    for (int j = threadIdx.x; j < sk; j += blockDim.x)
        dot += to_float(dy[off + j]) * to_float(y[off + j]);
    dot = block_sum(dot);
    for (int j = threadIdx.x; j < sk; j += blockDim.x)
        dx[off + j] =
            from_float<T>(scale * to_float(y[off + j]) * (to_float(dy[off + j]) - dot));
}

// ---- one warp per row ----------------------------------------------------------------------
// For rows of at most 32 * VEC * CHUNKS entries (sk % VEC == 0): lane l keeps chunks
// c = l + 32 k of its row in registers, reads x (and the mask) once, and reduces with warp
// shuffles only. Four rows per block of 128 threads, grid-stride over rows.
template <typename T, int VEC, int CHUNKS, bool HAS_MASK>
__global__ void __launch_bounds__(128)
softmax_fwd_warp(const T* __restrict__ x, const unsigned char* __restrict__ mask,
                 T* __restrict__ y, long long rows, int sq, int sk, float scale, int causal) {
    const int lane = threadIdx.x & 31;
    for (long long r = blockIdx.x * 4LL + (threadIdx.x >> 5); r < rows; r += gridDim.x * 4LL) {
        const int qi = (int)(r % sq);
        float v[CHUNKS][VEC];
        float m = -kInf;
#pragma unroll
        for (int k = 0; k < CHUNKS; ++k) {
            const int c = (lane + 32 * k) * VEC;
            if (c >= sk) continue;
            const Vec<T, VEC> a = load_vec<VEC>(x + r * sk + c);
            Vec<unsigned char, VEC> mk;
            if (HAS_MASK) mk = load_vec<VEC>(mask + r * sk + c);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const bool keep = !(causal && c + j > qi) && !(HAS_MASK && mk.v[j]);
                v[k][j] = keep ? scale * to_float(a.v[j]) : -kInf;
                m = fmaxf(m, v[k][j]);
            }
        }
        m = warp_reduce(m, MaxOp());
        if (m == -kInf) m = 0.f;  // nothing kept (or only -inf): the row becomes zeros
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < CHUNKS; ++k)
            if ((lane + 32 * k) * VEC < sk)
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    v[k][j] = expf(v[k][j] - m);  // exp(-inf) = 0 for excluded entries
                    s += v[k][j];
                }
        s = warp_sum(s);
        const float denom = s > 0.f ? s : 1.f;
#pragma unroll
        for (int k = 0; k < CHUNKS; ++k) {
            const int c = (lane + 32 * k) * VEC;
            if (c >= sk) continue;
            Vec<T, VEC> out;
#pragma unroll
            for (int j = 0; j < VEC; ++j) out.v[j] = from_float<T>(v[k][j] / denom);
            store_vec<VEC>(y + r * sk + c, out);
        }
    }
}

template <typename T, int VEC, int CHUNKS>
__global__ void __launch_bounds__(128)
softmax_bwd_warp(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
                 long long rows, int sk, float scale) {
    const int lane = threadIdx.x & 31;
    for (long long r = blockIdx.x * 4LL + (threadIdx.x >> 5); r < rows; r += gridDim.x * 4LL) {
        Vec<T, VEC> d[CHUNKS], p[CHUNKS];
        float dot = 0.f;
#pragma unroll
        for (int k = 0; k < CHUNKS; ++k) {
            const int c = (lane + 32 * k) * VEC;
            if (c >= sk) continue;
            d[k] = load_vec<VEC>(dy + r * sk + c);
            p[k] = load_vec<VEC>(y + r * sk + c);
#pragma unroll
            for (int j = 0; j < VEC; ++j) dot += to_float(d[k].v[j]) * to_float(p[k].v[j]);
        }
        dot = warp_sum(dot);
#pragma unroll
        for (int k = 0; k < CHUNKS; ++k) {
            const int c = (lane + 32 * k) * VEC;
            if (c >= sk) continue;
            Vec<T, VEC> out;
#pragma unroll
            for (int j = 0; j < VEC; ++j)
                out.v[j] = from_float<T>(scale * to_float(p[k].v[j]) *
                                         (to_float(d[k].v[j]) - dot));
            store_vec<VEC>(dx + r * sk + c, out);
        }
    }
}
