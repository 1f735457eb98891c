// loss.cu — softmax cross entropy over the last axis, one row (token) per block, reading the
// logits in their own dtype: nothing of the size of the logits is allocated but dlogits.
// (The reference on CuPy makes several float32 copies of [tokens, vocab]: at 16k tokens x
// 50k vocab each is 3.3 GB.)
//
// Per row with logits x [V], target c, label smoothing eps (maths: reference/loss.py):
//   lse = log sum_j exp x[j];  loss = lse - (1 - eps) x[c] - eps mean_j x[j]
//   dx[j] = w (exp(x[j] - lse) - eps / V - (1 - eps) [j == c])
// with w = dloss[row]; a row whose target is ignore_index gets loss 0 and dx 0; a target
// outside [0, V) (not ignored) gets a NaN loss and a NaN dx row (the host never reads CuPy
// targets back). loss and lse are float32 [rows]; dx in the logits' dtype.
// Launch: one block of 256..1024 threads per row (grid = rows); the forward keeps an online
// (max, sum of exp) per thread (one exp per element; a rescale only when the max grows) and
// merges them in the block; the backward makes one pass.
#include "common.cuh"

template <typename T, typename I>
__global__ void cross_entropy_fwd(const T* __restrict__ x, const I* __restrict__ target,
                                  float* __restrict__ loss, float* __restrict__ lse_out,
                                  int V, long long ignore_index, float eps) {
    PDL_WAIT();
    const long long row = blockIdx.x;
    const T* xr = x + row * V;
    float m = -kInf, s = 0.f, sx = 0.f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float v = to_float(xr[j]);
        sx += v;
        if (v > m) {
            s = s * expf(m - v) + 1.f;  // (m = -inf at first: 0 * 0 + 1)
            m = v;
        } else if (v != -kInf) {
            s += expf(v - m);  // (NaN stays NaN)
        }
    }
    const float M = block_max(m, -kInf);
    const float2 t = block_sum2(m == -kInf ? 0.f : s * expf(m - M), sx);
    if (threadIdx.x != 0) return;
    const float lse = M + logf(t.x);
    const long long c = (long long)target[row];
    float l = 0.f;
    if (c != ignore_index) {
        l = (c < 0 || c >= V) ? __int_as_float(0x7fc00000)
                              : lse - (1.f - eps) * to_float(xr[c]) - eps * (t.y / V);
    }
    loss[row] = l;
    lse_out[row] = lse;
}

template <typename T, typename I>
__global__ void cross_entropy_bwd(const float* __restrict__ dloss, const T* __restrict__ x,
                                  const I* __restrict__ target, const float* __restrict__ lse,
                                  T* __restrict__ dx, int V, long long ignore_index,
                                  float eps) {
    PDL_WAIT();
    const long long row = blockIdx.x;
    const long long c = (long long)target[row];
    const bool ignored = c == ignore_index, bad = !ignored && (c < 0 || c >= V);
    const float w = ignored ? 0.f : bad ? __int_as_float(0x7fc00000) : dloss[row];
    const float l = lse[row], off = eps / V, hit = 1.f - eps;
    const T* xr = x + row * V;
    T* dr = dx + row * V;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float p = expf(to_float(xr[j]) - l) - off - (j == c ? hit : 0.f);
        dr[j] = from_float<T>(w * p);
    }
}
