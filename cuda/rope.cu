// rope.cu — rotary position embedding (RoPE), Transformer Engine's non-interleaved layout.
//
// x [s, b, H, d] with any strides on s, b and H (the head dim contiguous): sbhd as it is,
// bshd viewed as sbhd by the caller, or the fused QKV projection's output [s, b, hq+hk+hv, d].
// Heads [0, nq) rotate with freqs_q, heads [nq, nq + nk) with freqs_k, the rest are copied
// (v of a packed qkv). freqs [>= s, d2] float32 (row p: the angles of position p), d2 even
// and <= d; columns >= d2 are copied (partial rotary). With c = cos f[p, j], s = sin f[p, j]
// and h = d2 / 2 (rotate_half(x) = [-x[h:d2], x[:h]]):
//   rope_fwd:  y[j] = x[j] c[j] - x[j + h] s[j]   (j < h)
//              y[j] = x[j] c[j] + x[j - h] s[j]   (h <= j < d2)
//   backward (the transpose, BWD = true; TE's too, exact for any freqs, not only cat(f, f)):
//              dx[j] = dy[j] c[j] + dy[j + h] s[j + h]   (j < h)
//              dx[j] = dy[j] c[j] - dy[j - h] s[j - h]   (h <= j < d2)
// In float; y is written [s, b, H, d] at its own strides (all strides in elements).
// Launch: grid (s, b), blocks of (32, 4) threads: x over the head dim, y over heads. The
// block's position p is one s index: cos and sin of its d2 angles (twice: q and k) are
// computed once into shared memory (sincosf: accurate, no fast math) and read by every head.
#include "common.cuh"

template <typename T, bool BWD>
__global__ void rope(const T* __restrict__ x, T* __restrict__ y,
                     const float* __restrict__ freqs_q, const float* __restrict__ freqs_k,
                     int H, int d, int d2, int nq, int nk, long long xs, long long xb,
                     long long xh, long long ys, long long yb, long long yh) {
    extern __shared__ float cs[];  // [2][2][d2]: (q, k) x (cos, sin)
    PDL_WAIT();
    const long long p = blockIdx.x, bi = blockIdx.y;
    const int tid = threadIdx.y * blockDim.x + threadIdx.x, nt = blockDim.x * blockDim.y;
    for (int i = tid; i < 2 * d2; i += nt) {
        const float* f = i < d2 ? freqs_q : freqs_k;  // (freqs_k = freqs_q when nk = 0)
        const int j = i < d2 ? i : i - d2, which = i < d2 ? 0 : 2 * d2;
        float sn, cn;
        sincosf(f[p * d2 + j], &sn, &cn);
        cs[which + j] = cn;
        cs[which + d2 + j] = sn;
    }
    __syncthreads();
    const int half = d2 / 2;
    for (int h = threadIdx.y; h < H; h += blockDim.y) {
        const T* src = x + p * xs + bi * xb + h * xh;
        T* dst = y + p * ys + bi * yb + h * yh;
        const bool rot = h < nq + nk;
        const float* c = cs + (h < nq ? 0 : 2 * d2);
        const float* sn = c + d2;
        for (int j = threadIdx.x; j < d; j += blockDim.x) {
            if (!rot || j >= d2) {
                dst[j] = src[j];
                continue;
            }
            const bool lo = j < half;
            const int k = lo ? j + half : j - half;  // the partner column
            const float a = to_float(src[j]), b = to_float(src[k]);
            float v;
            if (!BWD) v = a * c[j] + (lo ? -b : b) * sn[j];
            else v = a * c[j] + (lo ? b : -b) * sn[k];
            dst[j] = from_float<T>(v);
        }
    }
}
