// delayed_scaling.cu — Transformer Engine's amax-history and scale update, for every slot of
// many FP8 metas in one launch, on the device (no host synchronisation).
//
// Meta m has amax_history [L, n_m], scale, scale_inv, fp8_max [n_m] (float). Block b is
// slot j of meta m, where slot_start[m] <= b < slot_start[m + 1]. With a = history[0, j]:
//   if a != 0: history rolls by -1 (new[i] = old[i + 1], new[L - 1] = old[0]) and row 0 is
//              zeroed; amax = max over the old history (fmaxf: NaN ignored)
//   amax = a instead for most_recent; amax = 0 when a == 0
//   scale = (fp8_max * down) / amax when amax is finite and > 0, else unchanged, where
//   down = 2^-margin (Transformer Engine's scaled_max / amax: with margin >= 1 an amax so
//   tiny that fp8_max / amax overflows can still give a finite scale);
//   an infinite scale becomes FLT_MAX; scale_inv = 1 / scale (IEEE division).
// table: int64 [4 * nmetas] pointers (history, scale, scale_inv, fp8_max per meta), then
// [nmetas + 1] slot starts. Launch: grid = total slots, blockDim 128 (multiple of 32).
// scale_inverse: scale_inv = 1 / scale for the unfused (callable) update path; a kernel of
// ours because CuPy compiles its own with -ftz=true, which flushes 1 / scale to 0 for a
// scale above 2^126 where Transformer Engine keeps the subnormal.
// Both are launched with PDL (tecupy/kernels/scaling.py's Launchers): they wait for the
// kernel before them (which wrote the amaxes or the scale) before touching memory.
#include "common.cuh"

__global__ void delayed_scaling_update(const long long* __restrict__ table, int nmetas,
                                       int length, int most_recent, float down) {
    PDL_WAIT();
    const long long* starts = table + 4 * nmetas;
    int m = 0;
    while (starts[m + 1] <= blockIdx.x) ++m;
    const int j = blockIdx.x - (int)starts[m], n = (int)(starts[m + 1] - starts[m]);
    float* h = reinterpret_cast<float*>(table[4 * m]);
    float* scale = reinterpret_cast<float*>(table[4 * m + 1]);
    float* scale_inv = reinterpret_cast<float*>(table[4 * m + 2]);
    const float* fp8_max = reinterpret_cast<const float*>(table[4 * m + 3]);

    const float last = h[j];
    float amax = 0.f;
    if (last != 0.f) {  // uniform over the block
        for (int off = 0; off < length; off += blockDim.x) {
            const int i = off + threadIdx.x;
            float a = 0.f;
            if (i < length) {
                a = (i < length - 1) ? h[(long long)(i + 1) * n + j] : last;
                amax = fmaxf(amax, a);
            }
            __syncthreads();  // every read of this chunk before any write (in-place roll)
            if (i < length) h[(long long)i * n + j] = (i > 0) ? a : 0.f;
        }
        amax = block_max(amax);
    }
    if (most_recent) amax = (last != 0.f) ? last : 0.f;
    if (threadIdx.x == 0) {
        float s = scale[j];
        if (isfinite(amax) && amax > 0.f) s = (fp8_max[j] * down) / amax;
        if (isinf(s)) s = kFltMax;
        scale[j] = s;
        scale_inv[j] = 1.f / s;
    }
}

__global__ void scale_inverse(const float* __restrict__ scale, float* __restrict__ scale_inv,
                              int n) {
    PDL_WAIT();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) scale_inv[i] = 1.f / scale[i];
}
