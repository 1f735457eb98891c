// common.cuh — helpers shared by the kernels: dtype conversion, block reductions, vectors,
// cp.async, Philox.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

constexpr float kFltMax = 3.402823466e+38f;  // FLT_MAX (NVRTC has no <cfloat>)
#define kInf __int_as_float(0x7f800000)     // +infinity (no <cmath> INFINITY either)

// Programmatic dependent launch (Hopper; the Python side's common.launch): a kernel launched
// with it may start while the previous kernel in the stream is still finishing, so
// PDL_WAIT() must come before its first global memory access (it returns once the previous
// grid has completed and its writes are visible); PDL_TRIGGER() after the main loop lets
// the next kernel's blocks be scheduled as this grid's blocks finish. Both are no-ops when
// the kernel was launched without PDL.
#if __CUDA_ARCH__ >= 900
#define PDL_WAIT() asm volatile("griddepcontrol.wait;\n" ::: "memory")
#define PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory")
#else
#define PDL_WAIT()
#define PDL_TRIGGER()
#endif

// ---- conversion to and from float ------------------------------------------------------
template <typename T> __device__ __forceinline__ float to_float(T v) { return (float)v; }
template <> __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 v) {
    return __bfloat162float(v);
}

template <typename T> __device__ __forceinline__ T from_float(float v) { return (T)v; }
template <> __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float v) {
    return __float2bfloat16_rn(v);
}

// Output element of kernels with an optional fused FP8 cast: T itself, or (OUT =
// __nv_fp8_e4m3 / __nv_fp8_e5m2) the FP8 code of v * scale, in which case the kernel also
// reduces amax = max |v| into amax[0].
template <typename OUT> struct Out {
    static constexpr bool fp8 = false;
    __device__ static OUT make(float v, float) { return from_float<OUT>(v); }
};
template <> struct Out<__nv_fp8_e4m3> {
    static constexpr bool fp8 = true;
    __device__ static __nv_fp8_e4m3 make(float v, float s) { return __nv_fp8_e4m3(v * s); }
};
template <> struct Out<__nv_fp8_e5m2> {
    static constexpr bool fp8 = true;
    __device__ static __nv_fp8_e5m2 make(float v, float s) { return __nv_fp8_e5m2(v * s); }
};

// FP8 codes of a and b (a in the low byte) from one conversion instruction on sm_89+
// (cvt ... e4m3x2 / e5m2x2), where F8(v).__x takes one per element; the same rounding and
// saturation (__NV_SATFINITE) as F8(float).
template <typename F8> struct Fp8Kind;
template <> struct Fp8Kind<__nv_fp8_e4m3> { static constexpr auto value = __NV_E4M3; };
template <> struct Fp8Kind<__nv_fp8_e5m2> { static constexpr auto value = __NV_E5M2; };
template <typename F8> __device__ __forceinline__ unsigned fp8x2(float a, float b) {
    return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, Fp8Kind<F8>::value);
}

// FP8 codes of a, b, c, d in one word (a in the low byte): two conversions writing the two
// halves of the word (ptxas merges them; through fp8x2 each half is masked and permuted
// into place: 3 more instructions per word).
template <typename F8> __device__ __forceinline__ unsigned fp8x4(float a, float b, float c,
                                                                 float d) {
#if __CUDA_ARCH__ >= 890
    unsigned w;
    if constexpr (Fp8Kind<F8>::value == __NV_E4M3)
        asm("{.reg .b16 lo, hi;\n"
            "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
            "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
            "mov.b32 %0, {lo, hi};}\n" : "=r"(w) : "f"(a), "f"(b), "f"(c), "f"(d));
    else
        asm("{.reg .b16 lo, hi;\n"
            "cvt.rn.satfinite.e5m2x2.f32 lo, %2, %1;\n"
            "cvt.rn.satfinite.e5m2x2.f32 hi, %4, %3;\n"
            "mov.b32 %0, {lo, hi};}\n" : "=r"(w) : "f"(a), "f"(b), "f"(c), "f"(d));
    return w;
#else
    return __byte_perm(fp8x2<F8>(a, b), fp8x2<F8>(c, d), 0x5410);
#endif
}

// ---- reductions --------------------------------------------------------------------------
// fmaxf ignores NaN, which is Transformer Engine's amax rule.
struct MaxOp {
    __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
    __device__ float operator()(float a, float b) const { return a + b; }
};

template <typename Op> __device__ __forceinline__ float warp_reduce(float v, Op op) {
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Reduce over the block; the result is valid in every thread. blockDim.x % 32 == 0, <= 1024.
// `identity` fills the unused warp slots.
template <typename Op>
__device__ __forceinline__ float block_reduce(float v, float identity, Op op) {
    __shared__ float partial[32];
    v = warp_reduce(v, op);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();  // partial may still be read by an earlier call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = (lane < (blockDim.x >> 5)) ? partial[lane] : identity;  // every warp reduces all
    return warp_reduce(v, op);
}

__device__ __forceinline__ float warp_sum(float v) { return warp_reduce(v, SumOp()); }
__device__ __forceinline__ float block_sum(float v) { return block_reduce(v, 0.f, SumOp()); }
// identity 0 suits amax (values >= 0); pass -kInf for a general max.
__device__ __forceinline__ float block_max(float v, float identity = 0.f) {
    return block_reduce(v, identity, MaxOp());
}

// scale_inv[0] = 1 / s (IEEE division) from the first thread of block `blk` 0 of a kernel
// that writes FP8 codes with scale s (the casts, the norms): the FP8 tensor's dequantizing
// factor, as Transformer Engine's casts write it, with no launch of its own (nullptr: the
// caller has none)
__device__ __forceinline__ void write_scale_inv(float* scale_inv, float s, int blk) {
    if (scale_inv != nullptr && blk == 0 && threadIdx.x == 0) scale_inv[0] = 1.f / s;
}

// amax[0] = the largest m (every m >= 0) of all threads of the grid, written once, by the
// last block to get here (every block must call this). The blocks merge into `slot`
// ({max as bits, blocks done}), which is zero on entry and left zero for the next launch
// (common.amax_slot), so amax needs no zeroing memset before the kernel: that memset cost
// 4-7 points of copy bandwidth at 8192 x 4096, 8-15 at 2048 x 4096 (H200; PERFLOG.md).
// With no slot (nullptr), amax[0] (>= +0) is the caller's running max, Transformer
// Engine's way (the amax history's current row): each block's max goes in by one atomicMax,
// with no count and no round trip at the end (~1 us less per launch).
__device__ __forceinline__ void grid_amax(float m, float* amax, unsigned* slot) {
    m = block_max(m);
    if (threadIdx.x == 0 && slot == nullptr) {
        if (m > 0.f) atomicMax(reinterpret_cast<unsigned*>(amax), __float_as_uint(m));
    } else if (threadIdx.x == 0) {
        if (m > 0.f) atomicMax(slot, __float_as_uint(m));
        __threadfence();  // this block's max lands before its count
        const unsigned blocks = gridDim.x * gridDim.y * gridDim.z;
        if (atomicAdd(slot + 1, 1u) == blocks - 1) {
            amax[0] = __uint_as_float(atomicExch(slot, 0u));
            atomicExch(slot + 1, 0u);
        }
    }
}

// Two sums at once (one pair of barriers instead of two); valid in every thread.
__device__ __forceinline__ float2 block_sum2(float a, float b) {
    __shared__ float2 partial2[32];
    a = warp_sum(a);
    b = warp_sum(b);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) partial2[warp] = make_float2(a, b);
    __syncthreads();
    const float2 p = (lane < (blockDim.x >> 5)) ? partial2[lane] : make_float2(0.f, 0.f);
    return make_float2(warp_sum(p.x), warp_sum(p.y));
}

// Four sums at once; valid in every thread.
__device__ __forceinline__ float4 block_sum4(float a, float b, float c, float d) {
    __shared__ float4 partial4[32];
    a = warp_sum(a);
    b = warp_sum(b);
    c = warp_sum(c);
    d = warp_sum(d);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) partial4[warp] = make_float4(a, b, c, d);
    __syncthreads();
    const float4 p = (lane < (blockDim.x >> 5)) ? partial4[lane] : make_float4(0, 0, 0, 0);
    return make_float4(warp_sum(p.x), warp_sum(p.y), warp_sum(p.z), warp_sum(p.w));
}

// ---- vectors: VEC elements of T moved as one load/store (16 bytes when VEC*sizeof(T)=16)
template <typename T, int VEC> struct alignas(sizeof(T) * VEC) Vec { T v[VEC]; };

template <int VEC, typename T> __device__ __forceinline__ Vec<T, VEC> load_vec(const T* p) {
    return *reinterpret_cast<const Vec<T, VEC>*>(p);
}
// A vector's elements as floats. bf16 by bit operations on whole words (low half << 16,
// high half & 0xffff0000: one instruction each, where the conversion took two for the
// high half); an odd-length bf16 vector element by element.
template <typename T, int VEC>
__device__ __forceinline__ void unpack(const Vec<T, VEC>& v, float (&f)[VEC]) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) f[j] = to_float(v.v[j]);
}
template <int VEC>
__device__ __forceinline__ void unpack(const Vec<__nv_bfloat16, VEC>& v, float (&f)[VEC]) {
    if constexpr (VEC % 2 == 0) {
        const unsigned* w = reinterpret_cast<const unsigned*>(&v);
#pragma unroll
        for (int j = 0; j < VEC / 2; ++j) {
            f[2 * j] = __uint_as_float(w[j] << 16);
            f[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
        }
    } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) f[j] = to_float(v.v[j]);
    }
}

// To global memory, as one vector store for 4, 8 and 16 bytes: a struct copy of Vec may be
// split into narrower stores (a 16-byte bf16 store became four 4-byte or eight 2-byte
// stores in norm_fwd_stream: twice the kernel time). No "memory" clobber, so loads may
// move across it: no kernel reads back, in the same thread, what it stores here.
template <int VEC, typename T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, VEC>& v) {
    constexpr int B = sizeof(T) * VEC;
    const unsigned* w = reinterpret_cast<const unsigned*>(&v);
    if constexpr (B == 16)
        asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(w[0]),
                     "r"(w[1]), "r"(w[2]), "r"(w[3]));
    else if constexpr (B == 8)
        asm volatile("st.global.v2.b32 [%0], {%1, %2};\n" ::"l"(p), "r"(w[0]), "r"(w[1]));
    else if constexpr (B == 4)
        asm volatile("st.global.b32 [%0], %1;\n" ::"l"(p), "r"(w[0]));
    else
        *reinterpret_cast<Vec<T, VEC>*>(p) = v;
}

// VEC outputs from floats: T itself, or the FP8 codes of v * s, four per word through two
// fp8x2 conversions (VEC % 4 == 0; else one conversion each).
template <typename OUT, int VEC>
__device__ __forceinline__ Vec<OUT, VEC> make_out(const float (&v)[VEC], float s) {
    Vec<OUT, VEC> out;
    if constexpr (Out<OUT>::fp8 && VEC % 4 == 0) {
        unsigned* w = reinterpret_cast<unsigned*>(&out);
#pragma unroll
        for (int j = 0; j < VEC; j += 4)
            w[j / 4] = fp8x4<OUT>(v[j] * s, v[j + 1] * s, v[j + 2] * s, v[j + 3] * s);
    } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) out.v[j] = Out<OUT>::make(v[j], s);
    }
    return out;
}

// ---- cp.async (sm_80+): 16-byte global -> shared copies that bypass registers ----------
// (attention.cu has its own predicated forms under other names.)
__device__ __forceinline__ void cp_async_16b(void* smem, const void* gmem) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit_group() {
    asm volatile("cp.async.commit_group;\n" ::);
}
// Wait until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- Philox4x32-10 (dropout.cu, attention.cu; reference/dropout.py has the same maths)
// The key: `seed`, or where `seed_ptr` is not null, the seed it points to (a launch captured
// in a CUDA graph reads each replay's seed from the graph's seed table: tecupy/graphs.py).
__device__ __forceinline__ uint2 philox_key(unsigned long long seed,
                                            const unsigned long long* seed_ptr) {
    if (seed_ptr) seed = *seed_ptr;
    return make_uint2((unsigned)seed, (unsigned)(seed >> 32));
}

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const unsigned lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
        const unsigned lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
        k.x += 0x9E3779B9u;
        k.y += 0xBB67AE85u;
    }
    return c;
}

__device__ __forceinline__ bool keep_word(unsigned w, float p) {
    return (float)(w >> 8) * 5.9604644775390625e-8f >= p;  // 2^-24
}
