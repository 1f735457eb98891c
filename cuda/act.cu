// act.cu — activations, forward and backward (Transformer Engine's definitions, in float),
// with an optional bias added to the input (BIAS) and an optional FP8 output (OUT).
//
// ACT: a struct of act_math.cuh (Gelu, Relu, Silu) with f and df in float; FAST (its fast
// sigmoid) for 16-bit and FP8 results. Which activation uses which struct and kernel, plain
// or gated: the table in tecupy/activation_table.py.
// With BIAS, x is replaced by x + bias[col] (bias over the last axis, in float).
// Plain:  act_fwd:   y[i] = f(x[i]);                  act_bwd:   dx[i] = dy[i] f'(x[i])
// Gated (x [rows, 2n] -> y [rows, n], a = x[r, c], b = x[r, n + c]):
//         gated_fwd: y[r, c] = f(a) b;   gated_bwd: dx[r, c] = dy b f'(a), dx[r, n + c] = dy f(a)
//   swiglu = gated silu, geglu = gated gelu.
// An FP8 OUT writes the codes of y * scale and reduces amax = max |y| into amax[0] (the
// input of the next FP8 GEMM, cast in the same pass).
// dbias (the column sums of dx) is colsum.cu's.
// Launch: 1-D grid-stride over VEC-wide chunks (n % VEC == 0 when VEC > 1), blockDim 256.
#include "act_math.cuh"
#include "common.cuh"

// f and f' of ACT (`ACT::template f<FAST>` spelled once, so the kernels read as maths)
template <typename ACT, bool FAST> __device__ __forceinline__ float act(float x) {
    return ACT::template f<FAST>(x);
}

template <typename ACT, bool FAST> __device__ __forceinline__ float dact(float x) {
    return ACT::template df<FAST>(x);
}

// x + bias for element j of a vector; b: the bias of the vector's VEC columns (unused
// without BIAS).
template <bool BIAS, typename T, int VEC>
__device__ __forceinline__ float input(const Vec<T, VEC>& a, const Vec<T, VEC>& b, int j) {
    return to_float(a.v[j]) + (BIAS ? to_float(b.v[j]) : 0.f);
}

// The bias of the VEC columns from column c (c % VEC == 0: one vector load), or nothing.
template <bool BIAS, typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> bias_at(const T* bias, int c) {
    Vec<T, VEC> b;
    if (BIAS) b = load_vec<VEC>(bias + c);
    return b;
}

// Row and column of a grid-stride loop's element i in rows of n: one 64-bit division at the
// start, then adds per step (a 64-bit % or / per step cost more than gelu with a bias:
// gelu + bias -> FP8 ran at 52% of copy on an H200).
struct RowCol {
    long long r;
    int c, dc, n;
    long long dr;
    __device__ RowCol(long long i, long long stride, int n_)
        : r(i / n_), c(int(i % n_)), dc(int(stride % n_)), n(n_), dr(stride / n_) {}
    __device__ __forceinline__ void next() {
        r += dr;
        c += dc;
        if (c >= n) { c -= n; ++r; }
    }
};

template <typename OUT>
__device__ __forceinline__ void finish_amax(float m, float* amax, unsigned* slot) {
    if (Out<OUT>::fp8) grid_amax(m, amax, slot);
}

// for (i over this thread's VEC-wide chunks of n items), with pos at (row, column) of i in
// rows of `cols` items
#define GRID_STRIDE(i, n, cols, pos) \
    const long long stride_ = (long long)VEC * gridDim.x * blockDim.x; \
    RowCol pos(VEC * (blockIdx.x * (long long)blockDim.x + threadIdx.x), stride_, cols); \
    for (long long i = VEC * (blockIdx.x * (long long)blockDim.x + threadIdx.x); i < (n); \
         i += stride_, pos.next())

// ---- plain -----------------------------------------------------------------------------
template <typename T, int VEC, typename ACT, typename OUT, bool BIAS>
__global__ void act_fwd(const T* __restrict__ x, const T* __restrict__ bias,
                        OUT* __restrict__ y, long long n, int ncols,
                        const float* __restrict__ scale, float* __restrict__ amax,
                        unsigned* __restrict__ slot) {
    PDL_WAIT();
    const float s = Out<OUT>::fp8 ? scale[0] : 1.f;
    float m = 0.f;
    GRID_STRIDE(i, n, ncols, pos) {
        const Vec<T, VEC> a = load_vec<VEC>(x + i), b = bias_at<BIAS, T, VEC>(bias, pos.c);
        float v[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            v[j] = act<ACT, (sizeof(OUT) < 4)>(input<BIAS>(a, b, j));
            if (Out<OUT>::fp8) m = fmaxf(m, fabsf(v[j]));
        }
        store_vec<VEC>(y + i, make_out<OUT, VEC>(v, s));
    }
    PDL_TRIGGER();
    finish_amax<OUT>(m, amax, slot);
}

// dx may be dy (in place: each element read, then written, by one thread): no __restrict__
template <typename T, int VEC, typename ACT, bool BIAS>
__global__ void act_bwd(const T* dy, const T* __restrict__ x, const T* __restrict__ bias,
                        T* dx, long long n, int ncols) {
    PDL_WAIT();
    GRID_STRIDE(i, n, ncols, pos) {
        const Vec<T, VEC> a = load_vec<VEC>(x + i), d = load_vec<VEC>(dy + i);
        const Vec<T, VEC> b = bias_at<BIAS, T, VEC>(bias, pos.c);
        Vec<T, VEC> out;
#pragma unroll
        for (int j = 0; j < VEC; ++j)
            out.v[j] = from_float<T>(to_float(d.v[j]) *
                                     dact<ACT, (sizeof(T) < 4)>(input<BIAS>(a, b, j)));
        store_vec<VEC>(dx + i, out);
    }
}

// ---- gated -----------------------------------------------------------------------------
template <typename T, int VEC, typename ACT, typename OUT, bool BIAS>
__global__ void gated_fwd(const T* __restrict__ x, const T* __restrict__ bias,
                          OUT* __restrict__ y, long long rows, int n,
                          const float* __restrict__ scale, float* __restrict__ amax,
                          unsigned* __restrict__ slot) {
    PDL_WAIT();
    const float s = Out<OUT>::fp8 ? scale[0] : 1.f;
    float m = 0.f;
    GRID_STRIDE(i, rows * n, n, pos) {
        const long long r = pos.r, c = pos.c;
        const Vec<T, VEC> a = load_vec<VEC>(x + r * 2 * n + c);
        const Vec<T, VEC> b = load_vec<VEC>(x + r * 2 * n + n + c);
        const Vec<T, VEC> ba = bias_at<BIAS, T, VEC>(bias, c);
        const Vec<T, VEC> bb = bias_at<BIAS, T, VEC>(bias, n + c);
        float v[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            v[j] = act<ACT, (sizeof(OUT) < 4)>(input<BIAS>(a, ba, j)) * input<BIAS>(b, bb, j);
            if (Out<OUT>::fp8) m = fmaxf(m, fabsf(v[j]));
        }
        store_vec<VEC>(y + i, make_out<OUT, VEC>(v, s));
    }
    PDL_TRIGGER();
    finish_amax<OUT>(m, amax, slot);
}

template <typename T, int VEC, typename ACT, bool BIAS>
__global__ void gated_bwd(const T* __restrict__ dy, const T* __restrict__ x,
                          const T* __restrict__ bias, T* __restrict__ dx, long long rows,
                          int n) {
    PDL_WAIT();
    GRID_STRIDE(i, rows * n, n, pos) {
        const long long r = pos.r, c = pos.c;
        const Vec<T, VEC> a = load_vec<VEC>(x + r * 2 * n + c);
        const Vec<T, VEC> b = load_vec<VEC>(x + r * 2 * n + n + c);
        const Vec<T, VEC> d = load_vec<VEC>(dy + i);
        const Vec<T, VEC> ba = bias_at<BIAS, T, VEC>(bias, c);
        const Vec<T, VEC> bb = bias_at<BIAS, T, VEC>(bias, n + c);
        Vec<T, VEC> da, db;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const float af = input<BIAS>(a, ba, j), g = to_float(d.v[j]);
            da.v[j] = from_float<T>(g * input<BIAS>(b, bb, j) * dact<ACT, (sizeof(T) < 4)>(af));
            db.v[j] = from_float<T>(g * act<ACT, (sizeof(T) < 4)>(af));
        }
        store_vec<VEC>(dx + r * 2 * n + c, da);
        store_vec<VEC>(dx + r * 2 * n + n + c, db);
    }
}
