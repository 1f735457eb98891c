// act.cu — activations, forward and backward (Transformer Engine's definitions, in float),
// with an optional bias added to the input (BIAS) and an optional FP8 output (OUT).
//
// gelu (tanh): 0.5 x (1 + tanh(k0 (x + k1 x^3))); relu: max(x, 0); silu: x / (1 + e^-x).
// (16-bit and FP8 results: the same functions through a fast sigmoid, see act() below.)
// With BIAS, x is replaced by x + bias[col] (bias over the last axis, in float).
// Plain:  act_fwd:   y[i] = f(x[i]);                  act_bwd:   dx[i] = dy[i] f'(x[i])
// Gated (x [rows, 2n] -> y [rows, n], a = x[r, c], b = x[r, n + c]):
//         gated_fwd: y[r, c] = f(a) b;   gated_bwd: dx[r, c] = dy b f'(a), dx[r, n + c] = dy f(a)
//   swiglu = gated silu, geglu = gated gelu.
// An FP8 OUT writes the codes of y * scale and reduces amax = max |y| into amax[0] (the
// input of the next FP8 GEMM, cast in the same pass).
// col_sum: dbias = sum over rows of dx, in two deterministic stages of partial sums.
// Launch: 1-D grid-stride over VEC-wide chunks (n % VEC == 0 when VEC > 1), blockDim 256.
#include "common.cuh"

enum { GELU = 0, RELU = 1, SILU = 2 };
constexpr float kK0 = 0.7978845608028654f, kK1 = 0.044715f;

// FAST (16-bit and FP8 results): gelu as x sigmoid(2u) (0.5 (1 + tanh(u)) = sigmoid(2u)) and
// silu's sigmoid from ex2.approx and a fast division: ~1e-7 relative error, far below the
// result's rounding, in ~8 instructions where tanhf / expf took ~25 (gelu + bias -> FP8 was
// issue-bound). float32 results keep tanhf / expf.
__device__ __forceinline__ float fast_sigmoid(float z) { return __fdividef(1.f, 1.f + __expf(-z)); }

template <int ACT, bool FAST> __device__ __forceinline__ float act(float x) {
    if (ACT == GELU) {
        const float u = kK0 * x * (1.f + kK1 * x * x);
        return FAST ? x * fast_sigmoid(2.f * u) : 0.5f * x * (1.f + tanhf(u));
    }
    if (ACT == RELU) return fmaxf(x, 0.f);
    return FAST ? x * fast_sigmoid(x) : x / (1.f + expf(-x));
}

template <int ACT, bool FAST> __device__ __forceinline__ float dact(float x) {
    if (ACT == GELU) {
        const float u = kK0 * x * (1.f + kK1 * x * x), du = kK0 * (1.f + 3.f * kK1 * x * x);
        if (FAST) {  // 0.5 (1 + t) = s, 0.5 (1 - t^2) = 2 s (1 - s)
            const float s = fast_sigmoid(2.f * u);
            return s + 2.f * x * s * (1.f - s) * du;
        }
        const float t = tanhf(u);
        return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * du;
    }
    if (ACT == RELU) return x > 0.f ? 1.f : 0.f;
    const float s = FAST ? fast_sigmoid(x) : 1.f / (1.f + expf(-x));
    return s * (1.f + x * (1.f - s));
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
template <typename T, int VEC, int ACT, typename OUT, bool BIAS>
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

template <typename T, int VEC, int ACT, bool BIAS>
__global__ void act_bwd(const T* __restrict__ dy, const T* __restrict__ x,
                        const T* __restrict__ bias, T* __restrict__ dx, long long n,
                        int ncols) {
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
template <typename T, int VEC, int ACT, typename OUT, bool BIAS>
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

template <typename T, int VEC, int ACT, bool BIAS>
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

// ---- column sums (dbias) -----------------------------------------------------------------
// out[s, c] = sum of x[r, c] over the rows r of split s (rows_per_split each). Launch:
// blocks of (32, 8) threads, grid (ceil(ncols / 32), splits); rows of threads stride the
// rows and meet in shared memory.
template <typename T, typename OUTT>
__global__ void col_sum(const T* __restrict__ x, OUTT* __restrict__ out, long long rows,
                        int ncols, long long rows_per_split) {
    __shared__ float acc[8][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    const long long r0 = blockIdx.y * rows_per_split;
    const long long r1 = r0 + rows_per_split < rows ? r0 + rows_per_split : rows;
    float a = 0.f;
    if (c < ncols)
        for (long long r = r0 + threadIdx.y; r < r1; r += 8) a += to_float(x[r * ncols + c]);
    acc[threadIdx.y][threadIdx.x] = a;
    __syncthreads();
    if (threadIdx.y == 0 && c < ncols) {
        float t = 0.f;
#pragma unroll
        for (int y = 0; y < 8; ++y) t += acc[y][threadIdx.x];
        out[(long long)blockIdx.y * ncols + c] = from_float<OUTT>(t);
    }
}
