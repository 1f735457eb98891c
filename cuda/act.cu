// act.cu — activations, forward and backward (Transformer Engine's definitions, in float).
//
// gelu (tanh): 0.5 x (1 + tanh(k0 (x + k1 x^3))); relu: max(x, 0); silu: x / (1 + e^-x).
// Plain:  act_fwd:   y[i] = f(x[i]);                  act_bwd:   dx[i] = dy[i] f'(x[i])
// Gated (x [rows, 2n] -> y [rows, n], a = x[r, c], b = x[r, n + c]):
//         gated_fwd: y[r, c] = f(a) b;   gated_bwd: dx[r, c] = dy b f'(a), dx[r, n + c] = dy f(a)
//   swiglu = gated silu, geglu = gated gelu.
// Launch: 1-D grid-stride over VEC-wide chunks (n % VEC == 0 when VEC > 1), blockDim 256.
#include "common.cuh"

enum { GELU = 0, RELU = 1, SILU = 2 };
constexpr float kK0 = 0.7978845608028654f, kK1 = 0.044715f;

template <int ACT> __device__ __forceinline__ float act(float x) {
    if (ACT == GELU) return 0.5f * x * (1.f + tanhf(kK0 * x * (1.f + kK1 * x * x)));
    if (ACT == RELU) return fmaxf(x, 0.f);
    return x / (1.f + expf(-x));
}

template <int ACT> __device__ __forceinline__ float dact(float x) {
    if (ACT == GELU) {
        const float t = tanhf(kK0 * x * (1.f + kK1 * x * x));
        return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * kK0 * (1.f + 3.f * kK1 * x * x);
    }
    if (ACT == RELU) return x > 0.f ? 1.f : 0.f;
    const float s = 1.f / (1.f + expf(-x));
    return s * (1.f + x * (1.f - s));
}

#define GRID_STRIDE(i, n) \
    for (long long i = VEC * (blockIdx.x * (long long)blockDim.x + threadIdx.x); i < (n); \
         i += (long long)VEC * gridDim.x * blockDim.x)

// ---- plain -----------------------------------------------------------------------------
template <typename T, int VEC, int ACT>
__global__ void act_fwd(const T* __restrict__ x, T* __restrict__ y, long long n) {
    GRID_STRIDE(i, n) {
        const Vec<T, VEC> a = load_vec<VEC>(x + i);
        Vec<T, VEC> out;
#pragma unroll
        for (int j = 0; j < VEC; ++j) out.v[j] = from_float<T>(act<ACT>(to_float(a.v[j])));
        store_vec<VEC>(y + i, out);
    }
}

template <typename T, int VEC, int ACT>
__global__ void act_bwd(const T* __restrict__ dy, const T* __restrict__ x,
                        T* __restrict__ dx, long long n) {
    GRID_STRIDE(i, n) {
        const Vec<T, VEC> a = load_vec<VEC>(x + i), d = load_vec<VEC>(dy + i);
        Vec<T, VEC> out;
#pragma unroll
        for (int j = 0; j < VEC; ++j)
            out.v[j] = from_float<T>(to_float(d.v[j]) * dact<ACT>(to_float(a.v[j])));
        store_vec<VEC>(dx + i, out);
    }
}

// ---- gated -----------------------------------------------------------------------------
template <typename T, int VEC, int ACT>
__global__ void gated_fwd(const T* __restrict__ x, T* __restrict__ y, long long rows, int n) {
    GRID_STRIDE(i, rows * n) {
        const long long r = i / n, c = i - r * n;
        const Vec<T, VEC> a = load_vec<VEC>(x + r * 2 * n + c);
        const Vec<T, VEC> b = load_vec<VEC>(x + r * 2 * n + n + c);
        Vec<T, VEC> out;
#pragma unroll
        for (int j = 0; j < VEC; ++j)
            out.v[j] = from_float<T>(act<ACT>(to_float(a.v[j])) * to_float(b.v[j]));
        store_vec<VEC>(y + i, out);
    }
}

template <typename T, int VEC, int ACT>
__global__ void gated_bwd(const T* __restrict__ dy, const T* __restrict__ x,
                          T* __restrict__ dx, long long rows, int n) {
    GRID_STRIDE(i, rows * n) {
        const long long r = i / n, c = i - r * n;
        const Vec<T, VEC> a = load_vec<VEC>(x + r * 2 * n + c);
        const Vec<T, VEC> b = load_vec<VEC>(x + r * 2 * n + n + c);
        const Vec<T, VEC> d = load_vec<VEC>(dy + i);
        Vec<T, VEC> da, db;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const float af = to_float(a.v[j]), g = to_float(d.v[j]);
            da.v[j] = from_float<T>(g * to_float(b.v[j]) * dact<ACT>(af));
            db.v[j] = from_float<T>(g * act<ACT>(af));
        }
        store_vec<VEC>(dx + r * 2 * n + c, da);
        store_vec<VEC>(dx + r * 2 * n + n + c, db);
    }
}
