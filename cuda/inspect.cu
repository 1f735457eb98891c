// inspect.cu — FP8Inspector's statistics of one FP8 cast in one pass (tecupy/inspect.py;
// NumPy reference: tecupy/reference/inspect.py, same names and argument order).
//
// A record is 8 words of 8 bytes in a per-step accumulator acc [records, 8] (int64, zeroed
// before the step's first cast; read to the host once per step), row `row` per cast:
//   0 amax       double: max |x| (NaN ignored), by atomicMax on the bits (valid for >= +0)
//   1 scale      double: the scale the cast used
//   2 nonzero    int64: non-NaN x != 0
//   3 flushed    int64: non-NaN x != 0 whose code is +-0 (code & 0x7F == 0)
//   4 valid      int64: non-NaN x
//   5 saturated  int64: |float(x) * scale| > the format's max (float32 product; inf
//                included, NaN not): the values the cast saturated to +-max
//   6 err2       double: sum over sampled finite x of (dequantize(code) - x)^2, dequantize
//                = float(F8 code) * scale_inv in float32 (fp8_dequantize's rounding), the
//                difference and the squares in double
//   7 ref2       double: sum over sampled finite x of x^2
// Sampled: the elements i with i % stride == 0 (stride 1: every element). Each thread sums
// in registers (32-bit counts, double sums), each block reduces and adds its totals with one
// atomic per statistic (atomicAdd(double): sm_60+).
//
// inspect_cast<T, F8, VEC>: x [n] of T (float, __half, __nv_bfloat16) and its FP8 codes
//   q [n] (uint8, the same element order: row-wise codes of a contiguous x), both read once.
//   scale, scale_inv [1] float. VEC elements per load (16 bytes of x; x 16-byte aligned and
//   q VEC-byte aligned when VEC > 1; the n % VEC tail element by element).
// inspect_block_cast<T, F8, VEC>: the same for a block cast (Float8BlockScaling): x [rows,
//   cols] and its row-wise codes, each element's scale_inv that of its row's 128 columns,
//   sinv[(r / rdiv) * rs + (c / 128) * bs] (strides in elements: 1x128 blocks' [cols / 128,
//   rows] with rdiv 1, 128x128 blocks' [rows / 128, cols / 128] with rdiv 128). Word 5
//   counts |x| > max * its scale_inv (the reference's); word 1 (the smallest block scale) is
//   the caller's. VEC > 1 only where cols % VEC == 0 (a chunk stays in one row and block).
// inspect_codes<VEC>: a producer-fused cast counted from its codes q [n] alone: words 2 and
//   4 the non-NaN codes (magnitude <= top, the format's max code: 0x7E E4M3, 0x7B E5M2),
//   3 the +-0 codes, 5 the +-max codes; 0 the amax slot's value (NaN without one), 1 the
//   scale, 6 and 7 NaN (no round-trip error without x).
// Launch: 1-D grid-stride, blockDim 256 (a multiple of 32, <= 1024).
#include "common.cuh"

template <typename F8> struct Fp8Max;
template <> struct Fp8Max<__nv_fp8_e4m3> { static constexpr float value = 448.f; };
template <> struct Fp8Max<__nv_fp8_e5m2> { static constexpr float value = 57344.f; };

constexpr unsigned kFull = 0xffffffffu;

struct Stats {
    unsigned nonzero, flushed, valid, saturated;  // per thread: < 2^32 elements each
    float amax;
    double err2, ref2;
};

// ---- where an element's scale comes from --------------------------------------------------
struct TensorScale {  // one scale for the tensor
    float s, sinv;
    __device__ __forceinline__ float inv(long long) const { return sinv; }
    template <typename F8> __device__ __forceinline__ bool saturates(float v, float) const {
        return fabsf(v * s) > Fp8Max<F8>::value;
    }
};
struct BlockScale {  // one per 128 columns of a row (inspect_block_cast, above)
    const float* sinv;
    long long cols, rdiv, rs, bs;
    __device__ __forceinline__ float inv(long long i) const {
        const long long r = i / cols;
        return sinv[r / rdiv * rs + (i - r * cols) / 128 * bs];
    }
    template <typename F8> __device__ __forceinline__ bool saturates(float v, float si) const {
        return fabsf(v) > Fp8Max<F8>::value * si;
    }
};

// ---- one element ---------------------------------------------------------------------------
template <typename F8, typename S>
__device__ __forceinline__ void inspect_one(float v, unsigned char code, const S& sc,
                                            float sinv, bool sampled, Stats& a) {
    const bool valid = v == v, nonzero = valid && v != 0.f;
    a.valid += valid;
    a.nonzero += nonzero;
    a.flushed += nonzero && (code & 0x7F) == 0;
    a.saturated += sc.template saturates<F8>(v, sinv);
    a.amax = fmaxf(a.amax, fabsf(v));
    if (sampled && fabsf(v) < kInf) {  // finite x only
        F8 q;
        q.__x = code;
        const double e = (double)(float(q) * sinv) - (double)v;
        a.err2 += e * e;
        a.ref2 += (double)v * (double)v;
    }
}

// ---- block reduction, then one atomic per statistic -----------------------------------------
template <typename V> __device__ __forceinline__ V warp_total(V v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    return v;
}

// c: the four counts of words 2..5; m: amax (< 0: none, word 0 untouched); e, r: words 6, 7
__device__ void add_record(unsigned long long (&c)[4], float m, double e, double r,
                           long long* rec) {
    __shared__ unsigned long long sc[4][32];
    __shared__ double se[32], sr[32];
    __shared__ float sm[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
    for (int k = 0; k < 4; ++k) c[k] = warp_total(c[k]);
    e = warp_total(e);
    r = warp_total(r);
    m = warp_reduce(m, MaxOp());
    if (lane == 0) {
#pragma unroll
        for (int k = 0; k < 4; ++k) sc[k][warp] = c[k];
        se[warp] = e;
        sr[warp] = r;
        sm[warp] = m;
    }
    __syncthreads();
    if (warp != 0) return;
    const bool in = lane < warps;
#pragma unroll
    for (int k = 0; k < 4; ++k) c[k] = warp_total(in ? sc[k][lane] : 0ull);
    e = warp_total(in ? se[lane] : 0.0);
    r = warp_total(in ? sr[lane] : 0.0);
    m = warp_reduce(in ? sm[lane] : -1.f, MaxOp());
    if (lane != 0) return;
    unsigned long long* w = reinterpret_cast<unsigned long long*>(rec);
#pragma unroll
    for (int k = 0; k < 4; ++k)
        if (c[k]) atomicAdd(w + 2 + k, c[k]);
    if (m > 0.f) atomicMax(w, (unsigned long long)__double_as_longlong((double)m));
    if (e != 0.0) atomicAdd(reinterpret_cast<double*>(rec + 6), e);  // (NaN: added)
    if (r != 0.0) atomicAdd(reinterpret_cast<double*>(rec + 7), r);
}

// ---- a cast with its input -------------------------------------------------------------------
// This thread's elements of x and q (a grid-stride loop over VEC-element chunks, each with
// one scale_inv), then the block's totals into rec.
template <typename T, typename F8, int VEC, typename S>
__device__ __forceinline__ void inspect_range(const T* __restrict__ x,
                                              const unsigned char* __restrict__ q,
                                              const S& sc, long long* rec, long long n,
                                              long long stride) {
    Stats a = {0u, 0u, 0u, 0u, 0.f, 0.0, 0.0};
    const long long tid = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long threads = (long long)gridDim.x * blockDim.x, chunks = n / VEC;
    // r = (first element of this thread's chunk) % stride, kept by adding the step mod stride
    long long r = (tid * VEC) % stride;
    const long long step = (threads * VEC) % stride;
    const int every = stride < VEC ? (int)stride : VEC;  // a second sample in the chunk?
    for (long long c = tid; c < chunks; c += threads) {
        const Vec<T, VEC> xv = load_vec<VEC>(x + c * VEC);
        const Vec<unsigned char, VEC> qv = load_vec<VEC>(q + c * VEC);
        const float sinv = sc.inv(c * VEC);
        float v[VEC];
        unpack(xv, v);
        int next = r == 0 ? 0 : (stride - r < VEC ? (int)(stride - r) : VEC);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const bool sampled = j == next;
            if (sampled) next += every;
            inspect_one<F8>(v[j], qv.v[j], sc, sinv, sampled, a);
        }
        r += step;
        if (r >= stride) r -= stride;
    }
    for (long long i = chunks * VEC + tid; i < n; i += threads)  // the n % VEC tail
        inspect_one<F8>(to_float(x[i]), q[i], sc, sc.inv(i), i % stride == 0, a);
    PDL_TRIGGER();
    unsigned long long c[4] = {a.nonzero, a.flushed, a.valid, a.saturated};
    add_record(c, a.amax, a.err2, a.ref2, rec);
}

template <typename T, typename F8, int VEC>
__global__ void __launch_bounds__(256)
inspect_cast(const T* __restrict__ x, const unsigned char* __restrict__ q,
             const float* __restrict__ scale, const float* __restrict__ scale_inv,
             long long* __restrict__ acc, int row, long long n, long long stride) {
    PDL_WAIT();
    long long* rec = acc + 8LL * row;
    const float s = scale[0];
    if (blockIdx.x == 0 && threadIdx.x == 0) rec[1] = __double_as_longlong((double)s);
    inspect_range<T, F8, VEC>(x, q, TensorScale{s, scale_inv[0]}, rec, n, stride);
}

template <typename T, typename F8, int VEC>
__global__ void __launch_bounds__(256)
inspect_block_cast(const T* __restrict__ x, const unsigned char* __restrict__ q,
                   const float* __restrict__ sinv, long long cols, long long rdiv,
                   long long rs, long long bs, long long* __restrict__ acc, int row,
                   long long n, long long stride) {
    PDL_WAIT();
    inspect_range<T, F8, VEC>(x, q, BlockScale{sinv, cols, rdiv, rs, bs}, acc + 8LL * row, n,
                              stride);
}

// ---- a producer-fused cast: its codes only -----------------------------------------------------
template <int VEC>
__global__ void __launch_bounds__(256)
inspect_codes(const unsigned char* __restrict__ q, const float* __restrict__ scale,
              const float* __restrict__ amax, long long* __restrict__ acc, int row,
              long long n, int top) {
    PDL_WAIT();
    long long* rec = acc + 8LL * row;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        const double nan = __longlong_as_double(0x7ff8000000000000LL);
        rec[0] = __double_as_longlong(amax == nullptr ? nan : (double)amax[0]);
        rec[1] = __double_as_longlong((double)scale[0]);
        rec[6] = rec[7] = __double_as_longlong(nan);
    }
    unsigned valid = 0u, zeros = 0u, at_max = 0u;
    const long long tid = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long threads = (long long)gridDim.x * blockDim.x, chunks = n / VEC;
    for (long long c = tid; c < chunks; c += threads) {
        const Vec<unsigned char, VEC> qv = load_vec<VEC>(q + c * VEC);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const unsigned mag = qv.v[j] & 0x7Fu;
            valid += mag <= (unsigned)top;  // above: inf and NaN codes
            zeros += mag == 0u;
            at_max += mag == (unsigned)top;
        }
    }
    for (long long i = chunks * VEC + tid; i < n; i += threads) {
        const unsigned mag = q[i] & 0x7Fu;
        valid += mag <= (unsigned)top;
        zeros += mag == 0u;
        at_max += mag == (unsigned)top;
    }
    PDL_TRIGGER();
    unsigned long long c[4] = {valid, zeros, valid, at_max};
    add_record(c, -1.f, 0.0, 0.0, rec);
}
