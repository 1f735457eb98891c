// cast.cu — FP8 cast with amax, and FP8 dequantize.
//
// cast_to_fp8<T, F8>:  q[i] = F8(x[i] * scale[0])   (round to nearest even, __NV_SATFINITE:
//                      overflow and inf saturate to +-max, NaN stays NaN)
//                      amax[0] = max(amax[0], max_i |x[i]|)   (NaN ignored, as fmaxf)
//   x [n] of T (float, double, __half, __nv_bfloat16), q [n] uint8, scale/amax [1] float.
//   Launch: 1-D grid-stride, blockDim 256, each thread 4 elements per step; one atomicMax
//   per block. amax must hold a non-negative value before the launch.
// fp8_dequantize<F8, T>: y[i] = T(float(F8 q[i]) * scale_inv[0]).
#include "common.cuh"

// ---- cast ------------------------------------------------------------------------------
template <typename T, typename F8>
__global__ void cast_to_fp8(const T* __restrict__ x, const float* __restrict__ scale,
                            unsigned char* __restrict__ q, float* __restrict__ amax,
                            long long n) {
    const float s = scale[0];
    float m = 0.f;
    const long long stride = 4LL * gridDim.x * blockDim.x;
    for (long long base = 4LL * (blockIdx.x * (long long)blockDim.x + threadIdx.x); base < n;
         base += stride) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (base + j < n) {
                const float v = to_float(x[base + j]);
                m = fmaxf(m, fabsf(v));
                q[base + j] = F8(v * s).__x;
            }
        }
    }
    m = block_max(m);
    if (threadIdx.x == 0 && m > 0.f) atomic_max_nonneg(amax, m);
}

// ---- dequantize --------------------------------------------------------------------------
template <typename F8, typename T>
__global__ void fp8_dequantize(const unsigned char* __restrict__ q,
                               const float* __restrict__ scale_inv, T* __restrict__ y,
                               long long n) {
    const float s = scale_inv[0];
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        F8 v;
        v.__x = q[i];
        y[i] = from_float<T>(float(v) * s);
    }
}
