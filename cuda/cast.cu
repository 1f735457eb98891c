// cast.cu — FP8 cast with amax, and FP8 dequantize.
//
// cast_to_fp8<T, F8>:  q[i] = F8(x[i] * scale[0])   (round to nearest even, __NV_SATFINITE:
//                      overflow and inf saturate to +-max, NaN stays NaN)
//                      amax[0] = max(amax[0], max_i |x[i]|)   (NaN ignored, as fmaxf)
//   x [n] of T (float, double, __half, __nv_bfloat16), q [n] uint8, scale/amax [1] float.
//   Launch: 1-D grid-stride over VEC-wide chunks (16-byte loads; n % VEC == 0 when
//   VEC > 1), blockDim 256; one atomicMax per block. amax must hold a value >= 0 before.
// fp8_dequantize<F8, T>: y[i] = T(float(F8 q[i]) * scale_inv[0]).
#include "common.cuh"

// ---- cast ------------------------------------------------------------------------------
template <typename T, typename F8, int VEC>
__global__ void cast_to_fp8(const T* __restrict__ x, const float* __restrict__ scale,
                            unsigned char* __restrict__ q, float* __restrict__ amax,
                            long long n) {
    const float s = scale[0];
    float m = 0.f;
    for (long long i = VEC * (blockIdx.x * (long long)blockDim.x + threadIdx.x); i < n;
         i += (long long)VEC * gridDim.x * blockDim.x) {
        const Vec<T, VEC> a = load_vec<VEC>(x + i);
        Vec<unsigned char, VEC> out;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const float v = to_float(a.v[j]);
            m = fmaxf(m, fabsf(v));
            out.v[j] = F8(v * s).__x;
        }
        store_vec<VEC>(q + i, out);
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
