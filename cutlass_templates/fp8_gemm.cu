// FP8 GEMM for Hopper (sm_90a), built from CuTe/CUTLASS arch-level pieces (TMA copy atoms,
// transaction barriers, wgmma atoms, register reconfiguration) and compiled by NVRTC.
//
//   D[M, N] = alpha * A[M, K] . B[N, K]^T  (+ bias[N])  (+ D when ACCUM),  alpha = *sa * *sb
//   EPI 2: D = gelu(that), and aux = that (the value before gelu, for the backward).
//   EPI 3: D = T(that) * gelu'(aux + bias) (gelu's backward, aux read; no bias on D).
//   EPI 4, 5: D = T(T(that) + aux) (the residual add: aux of D's shape and type, read; 5 has
//          the bias, 4 none), the two roundings of the GEMM then the add kernel; the producer
//          prefetches each tile's aux rows into L2 during its mainloop. EPI 6, 7: 4, 5 without
//          the prefetch (to time it).
//   FP8 D: codes of D * *scale_out (saturated), and *amax_out = max(*amax_out, amax(D)).
//
// "TN": both operands K-major uint8 codes (E4M3 or E5M2; the wgmma atom MMA names the pair).
// alpha and bias are applied in float32 once, in the epilogue, as one FMA (alpha acc + bias
// rounded once, written as fmaf so that no instantiation differs); D is rounded once to TOut.
// bias is in D's type for a 16-bit D (bf16, half), float otherwise (bias_t).
// Scales are read from device memory (no host sync).
//
// Launch: persistent grid (<= one CTA per SM), 384 threads = 3 warpgroups.
//   warpgroup 0: producer. One thread issues TMA loads of a BM x BK tile of A and a BN x BK
//                tile of B (128-byte swizzled, zero-filled past M, N, K) into stage s and
//                arms full[s] with their byte count; it waits on empty[s] before reuse.
//   warpgroups 1, 2: math. Each owns 64 rows of the BM = 128 row tile, waits on full[s],
//                runs BK / 32 wgmma m64nBNk32 on it, then lane 0 of each warp arrives on
//                empty[s]. The accumulator stays in registers (BN / 2 floats per thread).
// PROMOTE (TE's split accumulator): each k-block of 128 accumulates into a fresh fragment
// that is added into a float32 total, since Hopper's FP8 wgmma accumulates with fewer bits
// than float32 (DeepSeek-V3 sec. 3.3); otherwise wgmma accumulates in place ("fast").
// Block scaling (fp8_block_gemm_tn, Float8BlockScaling: DeepSeek-V3's and Transformer
// Engine's blockwise recipe): D = sum over k-blocks kb of (A_kb . B_kb^T) * sa * sb, the
// factors applied at each promotion (split accumulation always):
//   sa [ceil(K / 128), M]: A's 1x128 blocks, the factor of row m in k-block kb at [kb, m]
//   SCALE 1: sb [ceil(K / 128), N]: B's 1x128 blocks, a factor per output column (the
//            producer copies a tile's BN factors of each k-block into its stage)
//   SCALE 2: sb [ceil(N / 128), ceil(K / 128)]: B's 128x128 blocks, one per 128 columns
//            (fp8_block_gemm_pipe_tn: rows of ceil(K / 128) rounded up to 4 floats, nk4)
// alpha is 1 there; the per-tensor kernels (SCALE 0) have no factors and the same code.
// Tiles are visited in groups of GROUP_M row blocks so that concurrent CTAs share A and B in
// L2; fp8_gemm_tn_cluster2 pairs CTAs that multicast the A tile. 16-bit D leaves through a
// swizzled shared-memory buffer and TMA stores. Dynamic shared memory: STAGES x (BM + BN) x
// BK bytes, [2 x 64 x BN x 2 bytes of D staging], barriers; 1024-byte aligned.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/numeric/integer_sequence.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "act_math.cuh"  // cuda/ is on every file's include path

namespace tc {

constexpr int BM = 128, BK = 128, THREADS = 384, GROUP_M = 16;
using Barrier = cutlass::arch::ClusterTransactionBarrier;
// wgmma atoms: 64 x BN x 32, both operands K-major in shared memory, f32 accumulator.
using cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN;
using cute::SM90::GMMA::MMA_64x192x32_F32E4M3E4M3_SS_TN;
using cute::SM90::GMMA::MMA_64x256x32_F32E4M3E4M3_SS_TN;
using cute::SM90::GMMA::MMA_64x128x32_F32E5M2E4M3_SS_TN;
using cute::SM90::GMMA::MMA_64x192x32_F32E5M2E4M3_SS_TN;
using cute::SM90::GMMA::MMA_64x256x32_F32E5M2E4M3_SS_TN;
using cute::SM90::GMMA::MMA_64x128x32_F32E4M3E5M2_SS_TN;
using cute::SM90::GMMA::MMA_64x192x32_F32E4M3E5M2_SS_TN;
using cute::SM90::GMMA::MMA_64x256x32_F32E4M3E5M2_SS_TN;

// wgmma shared-memory descriptor of a K-major tile with 128-byte rows, 128B swizzle, as TMA
// wrote it: 8-row groups 1024 bytes apart (SBO); LBO is unused for this layout.
__device__ __forceinline__ uint64_t smem_desc(const void* p) {
    cute::GmmaDescriptor d;
    d.bitfield.start_address_ = cute::cast_smem_ptr_to_uint(p) >> 4;
    d.bitfield.leading_byte_offset_ = 1;
    d.bitfield.stride_byte_offset_ = 1024 >> 4;
    d.bitfield.base_offset_ = 0;
    d.bitfield.layout_type_ = 1;  // SWIZZLE_128B
    return d.desc_;
}

// The descriptor of the tile `bytes` further on: only the start address (bits 0-13, 16-byte
// units; shared addresses stay below 2^18, so the sum never carries out of the field) moves.
// The loops add to descriptors built once per kernel instead of building each from a pointer:
// ~50 fewer instructions per k-block and warp, +2-12% split, +0-12% fast (H200, PERFLOG).
__device__ __forceinline__ uint64_t desc_at(uint64_t d, int bytes) {
    return (d & 0xffffffff00000000ull) | uint32_t(uint32_t(d) + (bytes >> 4));
}

// One wgmma with the accumulator array unpacked into the atom's N / 2 register operands.
template <class MMA, int N, int... I>
__device__ __forceinline__ void wgmma(uint64_t da, uint64_t db, float (&d)[N], bool acc,
                                      cute::integer_sequence<int, I...>) {
    MMA::fma(da, db, d[I]..., acc ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

template <class MMA, int N>
__device__ __forceinline__ void wgmma(uint64_t da, uint64_t db, float (&d)[N], bool acc) {
    wgmma<MMA>(da, db, d, acc, cute::make_integer_sequence<int, N>{});
}

template <class MMA>
constexpr int mma_n() { return int(sizeof(typename MMA::CRegisters) / sizeof(float)) * 2; }

template <int N>
__device__ __forceinline__ void fence(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) cute::warpgroup_fence_operand(d[i]);
}

// Tile t -> (row block, column block), row blocks grouped by GROUP_M for L2 reuse.
__device__ __forceinline__ void tile_coords(int t, int num_m, int num_n, int& mb, int& nb) {
    const int per_group = GROUP_M * num_n, first = (t / per_group) * GROUP_M;
    const int size = min(num_m - first, GROUP_M), r = t % per_group;
    mb = first + r % size;
    nb = r / size;
}

template <class T> __device__ __forceinline__ void store2(T* p, float a, float b);
template <> __device__ __forceinline__ void store2(__nv_bfloat16* p, float a, float b) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
template <> __device__ __forceinline__ void store2(__half* p, float a, float b) {
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}
template <> __device__ __forceinline__ void store2(float* p, float a, float b) {
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
// FP8 output: a and b already scaled; saturating (inf -> max, NaN stays NaN) as TE's casts.
template <> __device__ __forceinline__ void store2(__nv_fp8_e4m3* p, float a, float b) {
    *reinterpret_cast<__nv_fp8x2_storage_t*>(p) =
        __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}
template <> __device__ __forceinline__ void store2(__nv_fp8_e5m2* p, float a, float b) {
    *reinterpret_cast<__nv_fp8x2_storage_t*>(p) =
        __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E5M2);
}
template <class T> constexpr bool is_fp8 = false;
template <> constexpr bool is_fp8<__nv_fp8_e4m3> = true;
template <> constexpr bool is_fp8<__nv_fp8_e5m2> = true;

// amax of the unscaled output (NaN ignored by fmaxf, as TE): warp max, then one atomicMax on
// the bits per warp (non-negative floats order as their unsigned bits).
__device__ __forceinline__ void amax_atomic(float* amax_out, float v) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x % 32 == 0) atomicMax(reinterpret_cast<unsigned*>(amax_out), __float_as_uint(v));
}

// gelu's tanh form from cuda/act_math.cuh, the maths of act.cu's float32 gelu. noinline:
// inlined 128 times, tanhf makes the epilogue too big to unroll, and the accumulator would
// move to local memory.
__device__ __noinline__ float gelu(float x) { return Gelu::f<false>(x); }

template <class T> __device__ __forceinline__ float2 load2(const T* p);
template <> __device__ __forceinline__ float2 load2(const __nv_bfloat16* p) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
template <> __device__ __forceinline__ float2 load2(const __half* p) {
    return __half22float2(*reinterpret_cast<const __half2*>(p));
}
template <> __device__ __forceinline__ float2 load2(const float* p) {
    return *reinterpret_cast<const float2*>(p);
}

// v as T holds it (the rounding of a 16-bit output), back in float
template <class T> __device__ __forceinline__ float round_to(float v) { return v; }
template <> __device__ __forceinline__ float round_to<__nv_bfloat16>(float v) {
    return __bfloat162float(__float2bfloat16_rn(v));
}
template <> __device__ __forceinline__ float round_to<__half>(float v) {
    return __half2float(__float2half_rn(v));
}

// The bias is read in the output's type where D is 16-bit (bf16 or half: exact in float, so
// the sums are those of a float32 copy, without the per-call copy a caller would make); a
// float32 or FP8 D reads a float bias. One bias type per TOut: no more instantiations.
// Loaded one element at a time: a bias view may be only 2-byte aligned.
template <class TOut> struct BiasOf { using type = float; };
template <> struct BiasOf<__nv_bfloat16> { using type = __nv_bfloat16; };
template <> struct BiasOf<__half> { using type = __half; };
template <class TOut> using bias_t = typename BiasOf<TOut>::type;
__device__ __forceinline__ float bias_at(const float* p, int c) { return __ldg(p + c); }
__device__ __forceinline__ float bias_at(const __nv_bfloat16* p, int c) {
    return __bfloat162float(__ldg(p + c));
}
__device__ __forceinline__ float bias_at(const __half* p, int c) {
    return __half2float(__ldg(p + c));
}

// What the epilogue needs besides the fragment. EPI: 0 none, 1 + bias, 2 gelu(+ bias) with
// the value before gelu stored in aux (backward needs it), 3 gelu's backward: D = that *
// gelu'(aux + bias), aux the forward's value before gelu (Transformer Engine's DGELU
// epilogue: the dgrad of fc2 leaves as fc1's dy, with no [M, ffn] array between them),
// 4 the residual add (D = T(T(acc) + aux)), 5 the same with the bias (T(acc + bias)); 6, 7
// as 4, 5 without the L2 prefetch of aux.
template <class TOut>
struct Epilogue {
    const bias_t<TOut>* bias;
    TOut* d;
    TOut* aux;
    float alpha, out_scale;
    int M, N;
};

// Epilogue of one warpgroup's 64 x BN fragment: thread (warp w, lane l) holds rows 16w + l/4
// and + 8, columns 8j + 2(l % 4) + {0, 1} (the wgmma accumulator layout). FP8 output: the
// values are multiplied by out_scale before the cast and their amax gathered.
template <int BN, class TOut, int EPI, bool ACCUM>
__device__ __forceinline__ void epilogue(const float (&acc)[BN / 2], const Epilogue<TOut>& e,
                                         int row0, int col0, float& amax) {
    static_assert(EPI < 2 || !is_fp8<TOut>, "gelu's aux output needs a high-precision D");
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const int r0 = row0 + 16 * warp + lane / 4;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const int c = col0 + 8 * j + 2 * (lane % 4);
        if (c >= e.N) continue;  // N is even, so c < N means c + 1 < N too
        float b0 = 0.f, b1 = 0.f;
        if (EPI >= 1) { b0 = bias_at(e.bias, c); b1 = bias_at(e.bias, c + 1); }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = r0 + 8 * h;
            if (r >= e.M) continue;
            const long long at = (long long)r * e.N + c;
            float v0 = fmaf(e.alpha, acc[4 * j + 2 * h], b0);
            float v1 = fmaf(e.alpha, acc[4 * j + 2 * h + 1], b1);
            if (ACCUM) {
                const float2 o = *reinterpret_cast<const float2*>(e.d + at);
                v0 += o.x;
                v1 += o.y;
            }
            if constexpr (EPI == 2) {
                store2(e.aux + at, v0, v1);
                v0 = gelu(v0);
                v1 = gelu(v1);
            }
            if constexpr (is_fp8<TOut>) {
                amax = fmaxf(amax, fmaxf(fabsf(v0), fabsf(v1)));
                v0 *= e.out_scale;
                v1 *= e.out_scale;
            }
            store2(e.d + at, v0, v1);
        }
    }
}

// The aux pairs of one chunk of CH column groups of a thread's fragment rows, all loads
// issued before any is used: x[j][h] = aux[r0 + 8h, c0 + 8j + {0, 1}] (0 past M or N),
// c0 = the chunk's first column of this thread (EPI 3's and the residual's loads).
template <int CH, class TOut>
__device__ __forceinline__ void load_aux_chunk(float2 (&x)[CH][2], const Epilogue<TOut>& e,
                                               int r0, int c0) {
#pragma unroll
    for (int j = 0; j < CH; ++j) {
        const int c = c0 + 8 * j;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = r0 + 8 * h;
            x[j][h] = c < e.N && r < e.M ? load2(e.aux + (long long)r * e.N + c)
                                         : make_float2(0.f, 0.f);
        }
    }
}

// EPI 3, gelu's backward: D = T(alpha acc) * gelu'(aux + bias), gelu' as act.cu's act_bwd
// computes it for 16-bit results (the fast sigmoid, inlined: a few instructions), the
// product rounded to T first as fc2's dgrad output was. The aux values of a chunk of 8
// column groups are loaded before any is used: 16 loads in flight per thread (one load per
// element, each waited on, made this GEMM 3.5x slower at 4096 x 8192 x 2048 on an H100).
// D may be aux itself (in place): each element is read, then written, by one thread.
template <int BN, class TOut>
__device__ __forceinline__ void epilogue_dgelu(const float (&acc)[BN / 2],
                                               const Epilogue<TOut>& e, int row0, int col0) {
    constexpr int CH = 8;
    static_assert((BN / 8) % CH == 0, "BN a multiple of 64");
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const int r0 = row0 + 16 * warp + lane / 4;
#pragma unroll
    for (int j0 = 0; j0 < BN / 8; j0 += CH) {
        float2 x[CH][2];
        load_aux_chunk<CH>(x, e, r0, col0 + 8 * j0 + 2 * (lane % 4));
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            const int c = col0 + 8 * (j0 + j) + 2 * (lane % 4);
            if (c >= e.N) continue;  // N is even, so c < N means c + 1 < N too
            const float b0 = bias_at(e.bias, c), b1 = bias_at(e.bias, c + 1);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = r0 + 8 * h, i = 4 * (j0 + j) + 2 * h;
                if (r >= e.M) continue;
                store2(e.d + (long long)r * e.N + c,
                       round_to<TOut>(e.alpha * acc[i]) * Gelu::df<true>(x[j][h].x + b0),
                       round_to<TOut>(e.alpha * acc[i + 1]) * Gelu::df<true>(x[j][h].y + b1));
            }
        }
    }
}

// 16-bit outputs without gelu's aux or accumulation leave through shared memory and TMA
// stores, so the math warpgroups go back to their MMAs while the stores drain; the
// residual epilogues (4, 5: aux read, like EPI 3) too.
template <class TOut, int EPI, bool ACCUM, int BN>
constexpr bool kTmaStore =
    sizeof(TOut) == 2 && (EPI < 2 || EPI >= 4) && !ACCUM && BN % 64 == 0;

// EPI 4, 5, the residual add: the staged tile is T(T(alpha acc (+ bias)) + aux), aux the
// residual [M, N] in D's type, loaded a chunk of 8 column groups ahead as EPI 3 loads it.
// Two roundings, not one: the unfused path rounds the GEMM's output to T, then the add
// kernel adds two T values in float and rounds again; so the fused result is that one bit
// for bit (fused or not, a layer's outputs and gradients do not change). alpha acc + bias
// is one FMA here as in every epilogue, written out (fmaf): left to ptxas's contraction,
// two instantiations of one expression may round differently (PERFLOG.md, session 30).
// Staging layout as epilogue_tma's (below).
template <int BN, class TOut, int EPI>
__device__ __forceinline__ void residual_to_stage(const float (&acc)[BN / 2],
                                                  const Epilogue<TOut>& e, uint8_t* stage,
                                                  int row0, int col0) {
    constexpr int CH = 8;
    static_assert((BN / 8) % CH == 0, "BN a multiple of 64");
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
#pragma unroll
    for (int j0 = 0; j0 < BN / 8; j0 += CH) {
        float2 x[CH][2];
        load_aux_chunk<CH>(x, e, row0 + 16 * warp + lane / 4, col0 + 8 * j0 + 2 * (lane % 4));
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            const int c = 8 * (j0 + j) + 2 * (lane % 4);  // column in the tile
            float b0 = 0.f, b1 = 0.f;
            if (EPI % 2 == 1 && col0 + c < e.N) {
                b0 = bias_at(e.bias, col0 + c);
                b1 = bias_at(e.bias, col0 + c + 1);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 16 * warp + lane / 4 + 8 * h, i = 4 * (j0 + j) + 2 * h;
                const int unit = ((c % 64) / 8) ^ (r % 8);
                uint8_t* p = stage + (c / 64) * 64 * 128 + r * 128 + unit * 16 + (c % 8) * 2;
                store2(reinterpret_cast<TOut*>(p),
                       round_to<TOut>(fmaf(e.alpha, acc[i], b0)) + x[j][h].x,
                       round_to<TOut>(fmaf(e.alpha, acc[i + 1], b1)) + x[j][h].y);
            }
        }
    }
}

// The staging buffer of one math warpgroup holds its 64 x BN tile as BN / 64 boxes of 64 rows
// x 128 bytes, 128B-swizzled as the store descriptor expects (16-byte unit u of row r sits at
// u ^ (r % 8)), which also spreads each warp's 4-byte stores over all 32 banks.
template <int BN, class TOut, int EPI>
__device__ __forceinline__ void epilogue_tma(const float (&acc)[BN / 2], const Epilogue<TOut>& e,
                                             uint8_t* stage, const cute::TmaDescriptor* tma_d,
                                             int row0, int col0) {
    const int lt = threadIdx.x % 128, lane = lt % 32, warp = lt / 32;
    const int bar = 2 + threadIdx.x / 128;  // named barriers 3, 4: one per math warpgroup
    if (lt == 0) cute::tma_store_wait<0>();  // the previous tile's stores have read it
    cutlass::arch::NamedBarrier::sync(128, bar);
    if constexpr (EPI >= 4) {
        residual_to_stage<BN, TOut, EPI>(acc, e, stage, row0, col0);
    } else {
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const int c = 8 * j + 2 * (lane % 4);  // column in the tile
        float b0 = 0.f, b1 = 0.f;
        if (EPI == 1 && col0 + c < e.N) {
            b0 = bias_at(e.bias, col0 + c);
            b1 = bias_at(e.bias, col0 + c + 1);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = 16 * warp + lane / 4 + 8 * h;
            const int unit = ((c % 64) / 8) ^ (r % 8);
            uint8_t* p = stage + (c / 64) * 64 * 128 + r * 128 + unit * 16 + (c % 8) * 2;
            store2(reinterpret_cast<TOut*>(p), fmaf(e.alpha, acc[4 * j + 2 * h], b0),
                   fmaf(e.alpha, acc[4 * j + 2 * h + 1], b1));
        }
    }
    }
    cutlass::arch::fence_view_async_shared();  // make the stores visible to the TMA unit
    cutlass::arch::NamedBarrier::sync(128, bar);
    if (lt == 0) {
        for (int b = 0; b < BN / 64; ++b)  // rows and columns past D are clipped by TMA
            cute::SM90_TMA_STORE_2D::copy(tma_d, stage + b * 64 * 128, col0 + b * 64, row0);
        cute::tma_store_arrive();
    }
}

// Tiles are handed out per cluster: the CLUSTER CTAs of a cluster take neighbouring column
// blocks of one row block (num_n % CLUSTER == 0), so they share the A tile. rot: the row
// blocks start at block rot and wrap around (fp8_gemm_tn_wait: this rank's chunk first).
template <int CLUSTER>
__device__ __forceinline__ bool next_tile(int& u, int num_m, int num_n, int& mb, int& nb,
                                          int rot = 0) {
    u = u < 0 ? blockIdx.x / CLUSTER : u + gridDim.x / CLUSTER;
    if (u >= num_m * (num_n / CLUSTER)) return false;
    tile_coords(u, num_m, num_n / CLUSTER, mb, nb);
    nb = nb * CLUSTER + (CLUSTER > 1 ? int(cute::block_rank_in_cluster()) : 0);
    if (rot) mb = mb + rot < num_m ? mb + rot : mb + rot - num_m;
    return true;
}

// Chunk waits (fp8_gemm_tn_wait: an all-gather's chunks of A landing while the GEMM runs,
// pushed by peers' copy engines, which need no SM). A's rows come in chunks of `rows` rows
// (a multiple of BM); ready[c] != 0 once chunk c is in memory (written after the chunk's
// copy, by the copy's stream; the caller resets the flags after the GEMM). The producer
// waits for a tile's chunk before loading its A rows; the math warps only wait on the
// stages as always. Tiles start at row block `rot` (the caller's own chunk, present at the
// launch). A chunk not ready after limit_ns traps (the launch fails with an error: a peer
// that died must not hang this GPU).
struct Chunks {
    const unsigned* ready;
    int rows, rot;
    unsigned long long limit_ns;
};

__device__ __forceinline__ unsigned long long globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

// `seen`: a bit per chunk already found ready (no poll per tile after that).
__device__ __forceinline__ void wait_chunk(const Chunks& ch, int mb, unsigned& seen) {
    const int c = mb * BM / ch.rows;
    if (seen >> c & 1u) return;
    const unsigned long long t0 = globaltimer();
    for (unsigned v;;) {  // acquire at system scope: another GPU's copy engine wrote it
        asm volatile("ld.acquire.sys.global.u32 %0, [%1];"
                     : "=r"(v) : "l"(ch.ready + c) : "memory");
        if (v) break;
        if (globaltimer() - t0 > ch.limit_ns) __trap();
        __nanosleep(256);
    }
    // the TMA (the async proxy) reads what the generic proxy's acquire made visible
    asm volatile("fence.proxy.async.global;" ::: "memory");
    seen |= 1u << c;
}

// With CLUSTER > 1, rank 0 loads the A tile once for the whole cluster (TMA multicast: it
// lands in every CTA's stage s and counts on every CTA's full[s]); each CTA loads its own B.
// Block scaling with 1x128 B (SCALE 1): the tile's BN column factors of each k-block come
// with its stage, by a bulk copy (16-byte aligned: N % 8 == 0; clipped at N).
// PF (the residual epilogues): a 16-bit [M, N] array pf the epilogue will read; after each
// k-block's loads the producer asks L2 for its share of the tile's rows of pf (BM / nk rows
// per k-block, min(BN, N - col0) columns each: 16-byte multiples as N % 8 == 0), so they
// arrive during the tile's mainloop and the epilogue's loads hit L2. A hint: skipped where
// pf is not 16-byte aligned.
template <bool PF>
__device__ __forceinline__ void prefetch_rows(const uint8_t* pf, int M, int N, int BNc, int mb,
                                              int nb, int kb, int nk) {
    if constexpr (PF) {
        if (reinterpret_cast<uintptr_t>(pf) % 16) return;
        const int lo = kb * BM / nk, hi = (kb + 1) * BM / nk, c0 = nb * BNc;
        const int bytes = min(BNc, N - c0) * 2;
        for (int r = mb * BM + lo; r < min(mb * BM + hi, M); ++r)
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(
                             pf + (size_t(r) * N + c0) * 2), "r"(bytes) : "memory");
    }
}

// The pipelined block kernel's B-factor tables (128x128 B): each tile's B factors of every
// k-block, the rows of scale_b [ceil(N / 128), nk4] its columns fall in (at most 2 for
// BN <= 256), copied by the producer thread with one bulk copy per row (16-byte aligned:
// rows of nk4 = nk rounded up to 4 floats, padded by the caller where nk % 4 != 0). Two
// buffers, tile t in buffer t % 2: full[b] counts the copies' bytes, empty[b] completes
// once the 8 math warps are done with it. The producer's wait on empty[b] never stalls it
// where nk >= STAGES: it reaches tile t + 2 only after the math warps have released stages
// of tile t + 1. The math warps wait for the table and release it inside mainloop_smem:
// the same wait and release around its call measured 0-4% slower at BN = 256 (the loop's
// SASS unchanged). (Filled by the math warpgroups themselves at each tile's start, an L2
// round trip and two syncs per tile, they cost 2-5%; by the producer warpgroup's idle second
// warp, which then spins on empty[b] beside the math warps, nothing was gained: PERFLOG,
// session 29.)
struct Tables {
    float* t;  // 2 buffers x 2 rows x nk4 floats
    uint64_t* full;
    uint64_t* empty;
    int nk4;
};

template <int BN>
__device__ __forceinline__ void copy_table(const Tables& tb, const float* scale_b, int N,
                                           int nb, int t) {
    // (a tile starts at a multiple of BN: with BN = 160 or 224 its columns could span 3)
    static_assert(BN == 64 || BN == 128 || BN == 192 || BN == 256,
                  "a tile's columns span at most 2 rows of 128x128 B factors");
    const int b = t & 1, last = (N - 1) / 128, first = nb * BN / 128;
    const int rows = min((nb * BN + BN - 1) / 128, last) - first + 1;
    Barrier::wait(&tb.empty[b], ((t >> 1) & 1) ^ 1);
    Barrier::arrive_and_expect_tx(&tb.full[b], rows * tb.nk4 * int(sizeof(float)));
    for (int j = 0; j < rows; ++j)
        cute::SM90_BULK_COPY_G2S::copy(scale_b + size_t(first + j) * tb.nk4, &tb.full[b],
                                       tb.t + (2 * b + j) * tb.nk4,
                                       tb.nk4 * int(sizeof(float)));
}

// AF (fp8_block_gemm_pipe_tn): the tile's BM A factors of each k-block (scale_a [nk, M],
// M % 4 == 0: 16-byte rows) come with the stage into sa_stage, by a bulk copy clipped at M;
// with SCALE 2 the tile's B factors into a table first (copy_table).
template <int BN, int STAGES, int CLUSTER, int SCALE, bool PF = false, bool AF = false,
          bool WAIT = false>
__device__ __forceinline__ void producer(const cute::TmaDescriptor* ta,
                                         const cute::TmaDescriptor* tb, uint8_t* sa,
                                         uint8_t* sb, uint64_t* full, uint64_t* empty,
                                         int num_m, int num_n, int nk, const float* scale_b,
                                         float* sb_stage, int N, const uint8_t* pf = nullptr,
                                         int M = 0, const float* scale_a = nullptr,
                                         float* sa_stage = nullptr, Chunks ch = {},
                                         Tables tables = {}) {
    const uint64_t hint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
    int s = 0, phase = 0, mb, nb, t = 0;
    unsigned seen = 0;
    for (int u = -1; next_tile<CLUSTER>(u, num_m, num_n, mb, nb, WAIT ? ch.rot : 0); ++t) {
        if constexpr (WAIT) wait_chunk(ch, mb, seen);
        if constexpr (AF && SCALE == 2) copy_table<BN>(tables, scale_b, N, nb, t);
        for (int kb = 0; kb < nk; ++kb) {
            Barrier::wait(&empty[s], phase ^ 1);
            const int b_bytes = SCALE == 1 ? min(BN, N - nb * BN) * int(sizeof(float)) : 0;
            const int a_bytes = AF ? min(BM, M - mb * BM) * int(sizeof(float)) : 0;
            Barrier::arrive_and_expect_tx(&full[s], (BM + BN) * BK + b_bytes + a_bytes);
            if constexpr (SCALE == 1)
                cute::SM90_BULK_COPY_G2S::copy(scale_b + size_t(kb) * N + nb * BN, &full[s],
                                               sb_stage + s * BN, b_bytes);
            if constexpr (AF)
                cute::SM90_BULK_COPY_G2S::copy(scale_a + size_t(kb) * M + mb * BM, &full[s],
                                               sa_stage + s * BM, a_bytes);
            if constexpr (CLUSTER == 1)
                cute::SM90_TMA_LOAD_2D::copy(ta, &full[s], hint, sa + s * BM * BK, kb * BK,
                                             mb * BM);
            else if (cute::block_rank_in_cluster() == 0)
                cute::SM90_TMA_LOAD_MULTICAST_2D::copy(ta, &full[s], (1 << CLUSTER) - 1, hint,
                                                       sa + s * BM * BK, kb * BK, mb * BM);
            cute::SM90_TMA_LOAD_2D::copy(tb, &full[s], hint, sb + s * BN * BK, kb * BK, nb * BN);
            prefetch_rows<PF>(pf, M, N, BN, mb, nb, kb, nk);
            if (++s == STAGES) { s = 0; phase ^= 1; }
        }
    }
}

// Issue the BK / 32 wgmma of one k-block (da: descriptor of this warpgroup's 64 rows of the
// A stage, db: of the B stage) as one batch into frag, restarting it from zero when
// !accumulate.
template <class MMA, int N>
__device__ __forceinline__ void mma_block(uint64_t da, uint64_t db, float (&frag)[N],
                                          bool accumulate) {
    fence(frag);
    cute::warpgroup_arrive();
#pragma unroll
    for (int k = 0; k < BK / 32; ++k)
        wgmma<MMA>(desc_at(da, 32 * k), desc_at(db, 32 * k), frag, accumulate || k > 0);
    cute::warpgroup_commit_batch();
}

// A stage is free once the math warps of every CTA in the cluster are done with it (the
// A multicast writes all of them): lane 0 of each warp arrives on empty[s] of each CTA.
template <int CLUSTER>
__device__ __forceinline__ void release(uint64_t* empty) {
    if (threadIdx.x % 32 != 0) return;
    if constexpr (CLUSTER == 1) {
        Barrier::arrive(empty);
    } else {
#pragma unroll
        for (int c = 0; c < CLUSTER; ++c) Barrier::arrive(empty, c, 1);
    }
}

__device__ __forceinline__ void advance(int& s, int& phase, int stages) {
    if (++s == stages) { s = 0; phase ^= 1; }
}

// Fast accumulation: wgmma accumulates in place; one batch stays in flight, so a stage is
// released once the batch after it has been issued (wait<1>).
template <int BN, int STAGES, int CLUSTER, class MMA>
__device__ __forceinline__ void mainloop_fast(uint64_t da, uint64_t db,
                                              uint64_t* full, uint64_t* empty, int nk,
                                              int& s, int& phase, float (&acc)[BN / 2]) {
    static_assert(mma_n<MMA>() == BN, "fast accumulation takes a full-width wgmma atom");
    int prev = 0;
    for (int kb = 0; kb < nk; ++kb) {
        Barrier::wait(&full[s], phase);
        mma_block<MMA>(desc_at(da, s * BM * BK), desc_at(db, s * BN * BK), acc, kb > 0);
        cute::warpgroup_wait<1>();
        if (kb > 0) release<CLUSTER>(&empty[prev]);
        prev = s;
        advance(s, phase, STAGES);
    }
    cute::warpgroup_wait<0>();
    fence(acc);
    release<CLUSTER>(&empty[prev]);
}

// The factors of one k-block's promotion for this thread, f(i) that of accumulator element
// i (row half (i / 2) % 2, column 8 (i / 4) + 2 (lane % 4) + i % 2 of the tile). SCALE 0
// (per tensor) has none: the promotion is a plain add and alpha comes in the epilogue.
template <int BN, int SCALE> struct Factors {
    static constexpr bool scaled() { return false; }
};
template <int BN> struct Factors<BN, 1> {  // sa per row, sb per column (in shared memory)
    static constexpr bool scaled() { return true; }
    float a[2];
    const float* b;  // this stage's BN column factors + 2 (lane % 4)
    __device__ __forceinline__ float operator()(int i) const {
        return a[(i >> 1) & 1] * b[8 * (i >> 2) + (i & 1)];
    }
};
template <int BN> struct Factors<BN, 2> {  // sa per row, sb per 64 columns (128x128 blocks)
    static constexpr bool scaled() { return true; }
    float a[2], b[BN / 64];
    __device__ __forceinline__ float operator()(int i) const {
        return a[(i >> 1) & 1] * b[i >> 5];
    }
};

// Where a tile's block factors are: the scale_inv arrays (layouts in the header), this
// thread's two rows of A (clamped into M: rows past it are computed, never stored) and the
// tile's first column; sb_stage: SCALE 1's per-stage copies of B's.
struct BlockScales {
    const float* a;
    const float* b;
    const float* sb_stage;
    int M, N, nk, r0, col0;
};

// The factors of k-block kb in stage s. Loaded a k-block ahead of their use, so that the
// global loads (L2 hits: every CTA of a row block reads the same sa) hide behind a wgmma.
template <int BN, int SCALE>
__device__ __forceinline__ Factors<BN, SCALE> factors(const BlockScales& bs, int kb, int s) {
    Factors<BN, SCALE> f;
    if constexpr (SCALE != 0) {
        const float* a = bs.a + size_t(kb) * bs.M;
        f.a[0] = __ldg(a + min(bs.r0, bs.M - 1));
        f.a[1] = __ldg(a + min(bs.r0 + 8, bs.M - 1));
    }
    if constexpr (SCALE == 1)
        f.b = bs.sb_stage + s * BN + 2 * (threadIdx.x % 4);
    if constexpr (SCALE == 2) {
        const int last = (bs.N - 1) / 128;  // the tile's last 64 columns may lie past N
#pragma unroll
        for (int c = 0; c < BN / 64; ++c)
            f.b[c] = __ldg(bs.b + size_t(min((bs.col0 + 64 * c) / 128, last)) * bs.nk + kb);
    }
    return f;
}

// acc[H * NP + i] += part[i] (times its factor under block scaling): sub-tile H of the
// accumulator (constant indices: registers).
template <int H, int NP, int N, class F>
__device__ __forceinline__ void promote(float (&acc)[N], float (&part)[NP], const F& f) {
    fence(part);
#pragma unroll
    for (int i = 0; i < NP; ++i) {
        if constexpr (F::scaled())
            acc[H * NP + i] = fmaf(part[i], f(H * NP + i), acc[H * NP + i]);
        else
            acc[H * NP + i] += part[i];
    }
}

// Issue and wait for the column sub-tiles H.. of one k-block, promoting all but the last
// (recursion unrolls it): once it returns, the stage has been read.
template <int H, int BN, class MMA, class F>
__device__ __forceinline__ void split_block(uint64_t da, uint64_t db,
                                            float (&acc)[BN / 2],
                                            float (&part)[mma_n<MMA>() / 2], const F& f) {
    mma_block<MMA>(da, desc_at(db, H * mma_n<MMA>() * BK), part, false);
    cute::warpgroup_wait<0>();
    if constexpr ((H + 1) * mma_n<MMA>() < BN) {
        promote<H>(acc, part, f);
        split_block<H + 1, BN, MMA>(da, db, acc, part, f);
    }
}

// Split accumulator: each k-block accumulates into part from zero, waits for it and adds it
// into acc (the other math warpgroup keeps the tensor cores busy meanwhile). acc starts at
// zero rather than taking the first part by a select: 20-40% faster on an H200. Two
// alternating fragments (adds overlapping the next k-block) measured slower. When the wgmma
// atom is narrower than the tile (BN = 256 with a 128-wide atom: acc and a full-width part
// would not fit in 232 registers), the k-block runs one column sub-tile at a time.
// Block scaling: each promotion multiplies by the k-block's factors (Factors), and with
// 1x128 B (SCALE 1) the stage is released after the last one, which reads its B factors.
template <int BN, int STAGES, int CLUSTER, class MMA, int SCALE>
__device__ __forceinline__ void mainloop_split(uint64_t da, uint64_t db,
                                               uint64_t* full, uint64_t* empty, int nk,
                                               int& s, int& phase, float (&acc)[BN / 2],
                                               const BlockScales& bs) {
    float part[mma_n<MMA>() / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
    Factors<BN, SCALE> f = factors<BN, SCALE>(bs, 0, s);
    for (int kb = 0; kb < nk; ++kb) {
        const Factors<BN, SCALE> next =
            factors<BN, SCALE>(bs, min(kb + 1, nk - 1), s + 1 == STAGES ? 0 : s + 1);
        Barrier::wait(&full[s], phase);
        split_block<0, BN, MMA>(desc_at(da, s * BM * BK), desc_at(db, s * BN * BK), acc,
                                part, f);
        if constexpr (SCALE != 1)
            release<CLUSTER>(&empty[s]);  // before the last promote: the refill starts sooner
        promote<BN / mma_n<MMA>() - 1>(acc, part, f);
        if constexpr (SCALE == 1) release<CLUSTER>(&empty[s]);
        advance(s, phase, STAGES);
        f = next;
    }
}

// Block scaling with 128x128 B, every factor from shared memory (fp8_block_gemm_pipe_tn,
// kernels/fp8_gemm.py's BLOCK_PIPELINE; 1x128 B: mainloop_smem below). mainloop_split
// loads k-block kb + 1's factors from global memory during kb, and ptxas makes kb's wgmma
// wait (WARPGROUP.DEPBAR) also wait for them: B's are the same for every thread, kept in
// uniform registers, and their copy (R2UR) sits just before the wait; A's copy (f = next)
// too, or a scoreboard shared with them (SASS of fp8_block_gemm_tn<192, 4, ..., 2>; loading
// two k-blocks ahead, or unrolling by 2 into alternating factor sets, moved the wait, not
// the dependence). So an L2 round trip issued beside the k-block's first wgmma bounds the
// k-block from below. Here no global load is left in the loop, as in DeepGEMM's sm90
// kernel: the producer copies the tile's 128 A factors of each k-block into its stage
// (sa_stage, by a bulk copy counted on full[s]: M % 4 == 0), and each tile's B factors,
// every k-block's, into a table (Tables, above). A k-block reads its factors by LDS once its
// stage is full, before the wgmma (after its first batch is issued: 8-25% slower, session
// 29). Two alternating fragments with wait<1> (a promotion overlapping the next wgmma of the
// same warpgroup) make ptxas serialize every wgmma (C7514, NVRTC 13.0): not used.

// The pipelined block kernel's mainloop (SCALE 2: the table above; SCALE 1, 1x128 B: B's
// factors come with each stage as in mainloop_split, A's too by the producer's AF copy, so
// no global load is left in the loop either). With 1x128 B the stage is released after the
// last promotion, which reads its B factors.
template <int BN, int STAGES, int CLUSTER, class MMA, int SCALE>
__device__ __forceinline__ void mainloop_smem(uint64_t da, uint64_t db,
                                              uint64_t* full, uint64_t* empty, int nk,
                                              int& s, int& phase, float (&acc)[BN / 2],
                                              const BlockScales& bs, const float* sa_stage,
                                              const Tables& tables, int& t) {
    const int b = t & 1;  // (this tile's table, with SCALE 2)
    int row[BN / 64];     // where the factors of the tile's 64 columns c.. are in the table
    if constexpr (SCALE == 2) {
        Barrier::wait(&tables.full[b], (t >> 1) & 1);
#pragma unroll
        for (int c = 0; c < BN / 64; ++c)
            row[c] = (2 * b + min(bs.col0 + 64 * c, bs.N - 1) / 128 - bs.col0 / 128)
                     * tables.nk4;
    }
    const float* tb = tables.t;
    const int r = bs.r0 % BM;  // this thread's first row in the tile (and r + 8)
    float part[mma_n<MMA>() / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
    for (int kb = 0; kb < nk; ++kb) {
        Barrier::wait(&full[s], phase);
        Factors<BN, SCALE> f;  // (rows past M: stale words past the copy; never stored)
        f.a[0] = sa_stage[s * BM + r];
        f.a[1] = sa_stage[s * BM + r + 8];
        if constexpr (SCALE == 2) {
#pragma unroll  // (BN % 128 == 0: 64-column pairs c, c + 1 share a row; one load, one product)
            for (int c = 0; c < BN / 64; ++c)
                f.b[c] = BN % 128 == 0 && c % 2 ? f.b[c - 1] : tb[row[c] + kb];
        } else {
            f.b = bs.sb_stage + s * BN + 2 * (threadIdx.x % 4);
        }
        split_block<0, BN, MMA>(desc_at(da, s * BM * BK), desc_at(db, s * BN * BK), acc,
                                part, f);
        if constexpr (SCALE == 2)
            release<CLUSTER>(&empty[s]);  // before the last promote: the refill starts sooner
        promote<BN / mma_n<MMA>() - 1>(acc, part, f);
        if constexpr (SCALE == 1) release<CLUSTER>(&empty[s]);
        advance(s, phase, STAGES);
    }
    if constexpr (SCALE == 2) {  // this warp's reads of the table are done
        __syncwarp();
        if (threadIdx.x % 32 == 0) Barrier::arrive(&tables.empty[b]);
    }
    ++t;
}

// The math warpgroups' part: every tile of this CTA, then the amax of an FP8 output.
template <int BN, int STAGES, int CLUSTER, class MMA, class TOut, int EPI, bool ACCUM,
          bool PROMOTE, int SCALE, bool PIPE = false>
__device__ __forceinline__ void math(const float* scale_inv_a, const float* scale_inv_b,
                                     const float* scale_out, float* amax_out, Epilogue<TOut> e,
                                     int nk, const uint8_t* sa, const uint8_t* sb,
                                     uint64_t* full, uint64_t* empty, uint8_t* staging,
                                     const float* sb_stage, const cute::TmaDescriptor* tma_d,
                                     const float* sa_stage = nullptr, int rot = 0,
                                     Tables tables = {}) {
    static_assert(SCALE == 0 || PROMOTE, "block scales apply at the promotions");
    constexpr bool tma_store = kTmaStore<TOut, EPI, ACCUM, BN>;
    static_assert(EPI < 4 || tma_store, "the residual epilogues: 16-bit D, staged, no ACCUM");
    uint8_t* stage = staging + (threadIdx.x / 128 - 1) * 64 * BN * 2;
    e.alpha = SCALE ? 1.f : __ldg(scale_inv_a) * __ldg(scale_inv_b);
    e.out_scale = is_fp8<TOut> ? __ldg(scale_out) : 1.f;
    const int row_off = (threadIdx.x / 128 - 1) * 64, M = e.M, N = e.N;
    const uint64_t da = smem_desc(sa + row_off * BK), db = smem_desc(sb);  // stage 0's tiles
    const int r0 = row_off + 16 * ((threadIdx.x / 32) % 4) + threadIdx.x % 32 / 4;
    float amax = 0.f;
    int s = 0, phase = 0, mb, nb, t = 0;  // t: the pipelined kernel's tiles so far
    for (int u = -1; next_tile<CLUSTER>(u, (M + BM - 1) / BM, (N + BN - 1) / BN, mb, nb, rot);) {
        float acc[BN / 2];
        const BlockScales bs{scale_inv_a, scale_inv_b, sb_stage, M, N, nk, mb * BM + r0,
                             nb * BN};
        if constexpr (PIPE)
            mainloop_smem<BN, STAGES, CLUSTER, MMA, SCALE>(da, db, full, empty, nk, s, phase,
                                                           acc, bs, sa_stage, tables, t);
        else if constexpr (PROMOTE)
            mainloop_split<BN, STAGES, CLUSTER, MMA, SCALE>(da, db, full, empty, nk, s,
                                                            phase, acc, bs);
        else
            mainloop_fast<BN, STAGES, CLUSTER, MMA>(da, db, full, empty, nk, s,
                                                    phase, acc);
        if constexpr (tma_store)
            epilogue_tma<BN, TOut, EPI>(acc, e, stage, tma_d, mb * BM + row_off, nb * BN);
        else if constexpr (EPI == 3)
            epilogue_dgelu<BN, TOut>(acc, e, mb * BM + row_off, nb * BN);
        else
            epilogue<BN, TOut, EPI, ACCUM>(acc, e, mb * BM + row_off, nb * BN, amax);
    }
    if (tma_store && threadIdx.x % 128 == 0) cute::tma_store_wait<0>();  // before smem goes
    if constexpr (is_fp8<TOut>) amax_atomic(amax_out, amax);
}

// The kernel body; the entries below differ only in their cluster attribute.
template <int BN, int STAGES, int CLUSTER, class MMA, class TOut, int EPI, bool ACCUM,
          bool PROMOTE, int SCALE, bool PIPE = false, bool WAIT = false>
__device__ __forceinline__ void gemm(const float* scale_inv_a, const float* scale_inv_b,
                                     const bias_t<TOut>* bias, const float* scale_out,
                                     float* amax_out,
                                     TOut* d, TOut* aux, int M, int N, int K,
                                     const cute::TmaDescriptor& tma_a,
                                     const cute::TmaDescriptor& tma_b,
                                     const cute::TmaDescriptor& tma_d, Chunks chunks = {}) {
    // shared memory: STAGES x A tile, STAGES x B tile, [2 x 64 x BN x 2 staging],
    // [SCALE 1: STAGES x BN float B factors], barriers, [PIPE: STAGES x BM float A
    // factors (sa_stage), then with SCALE 2 the tables of B factors (2 x 2 x nk4 floats)
    // and their 4 barriers]
    extern __shared__ __align__(1024) uint8_t smem[];
    uint8_t* sa = smem;
    uint8_t* sb = smem + STAGES * BM * BK;
    uint8_t* staging = sb + STAGES * BN * BK;
    constexpr int kStaging = kTmaStore<TOut, EPI, ACCUM, BN> ? 2 * 64 * BN * 2 : 0;
    constexpr int kFactors = SCALE == 1 ? STAGES * BN * int(sizeof(float)) : 0;
    float* sb_stage = reinterpret_cast<float*>(staging + kStaging);
    uint64_t* full = reinterpret_cast<uint64_t*>(staging + kStaging + kFactors);
    uint64_t* empty = full + STAGES;
    float* sa_stage = reinterpret_cast<float*>(empty + STAGES);  // 16-byte aligned
    const int nk = (K + BK - 1) / BK;
    constexpr bool kTables = PIPE && SCALE == 2;
    Tables tables{sa_stage + STAGES * BM, nullptr, nullptr, (nk + 3) / 4 * 4};
    tables.full = reinterpret_cast<uint64_t*>(tables.t + 4 * tables.nk4);
    tables.empty = tables.full + 2;
    if (threadIdx.x == 0) {
        cute::prefetch_tma_descriptor(&tma_a);
        cute::prefetch_tma_descriptor(&tma_b);
        if (kStaging) cute::prefetch_tma_descriptor(&tma_d);
        for (int s = 0; s < STAGES; ++s) {
            Barrier::init(&full[s], 1);
            Barrier::init(&empty[s], 8 * CLUSTER);  // each math warp of each CTA
        }
        for (int b = 0; kTables && b < 2; ++b) {
            Barrier::init(&tables.full[b], 1);   // the producer's arrival, and the bytes
            Barrier::init(&tables.empty[b], 8);  // each math warp
        }
        cutlass::arch::fence_barrier_init();
    }
    if constexpr (CLUSTER > 1) cute::cluster_sync(); else __syncthreads();
    // Programmatic dependent launch: nothing above touched global memory, so this grid's
    // launch and set-up overlapped the previous grid's tail; A, B, the scales, bias, aux and
    // D are only read or written from here on (a no-op when launched without PDL). The
    // next grid may launch at once: our CTAs hold their SMs' registers until they leave (it
    // takes only SMs we free) and it waits for our completion before its own first access.
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    if (threadIdx.x == 0) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    if (threadIdx.x < 128) {
        cutlass::arch::warpgroup_reg_dealloc<40>();
        if (threadIdx.x == 0)
            producer<BN, STAGES, CLUSTER, SCALE, EPI == 4 || EPI == 5, PIPE, WAIT>(
                &tma_a, &tma_b, sa, sb, full, empty, (M + BM - 1) / BM, (N + BN - 1) / BN, nk,
                scale_inv_b, sb_stage, N, reinterpret_cast<const uint8_t*>(aux), M,
                scale_inv_a, sa_stage, chunks, tables);
    } else {
        cutlass::arch::warpgroup_reg_alloc<232>();
        math<BN, STAGES, CLUSTER, MMA, TOut, EPI, ACCUM, PROMOTE, SCALE, PIPE>(
            scale_inv_a, scale_inv_b, scale_out, amax_out, {bias, d, aux, 1.f, 1.f, M, N}, nk,
            sa, sb, full, empty, staging, sb_stage, &tma_d, sa_stage, WAIT ? chunks.rot : 0,
            tables);
    }
    // No CTA may leave while a peer can still multicast into it or arrive on its barriers.
    if constexpr (CLUSTER > 1) cute::cluster_sync();
}

// d and aux may alias (EPI 3 in place), so neither is __restrict__
#define TC_GEMM_PARAMS                                                                       \
    const float* __restrict__ scale_inv_a, const float* __restrict__ scale_inv_b,            \
        const bias_t<TOut>* __restrict__ bias, const float* __restrict__ scale_out,          \
        float* __restrict__ amax_out, TOut* d, TOut* aux, int M,                           \
        int N, int K, const __grid_constant__ cute::TmaDescriptor tma_a,                     \
        const __grid_constant__ cute::TmaDescriptor tma_b,                                   \
        const __grid_constant__ cute::TmaDescriptor tma_d
#define TC_GEMM_ARGS \
    scale_inv_a, scale_inv_b, bias, scale_out, amax_out, d, aux, M, N, K, tma_a, tma_b, tma_d

// Single CTAs get no cluster attribute at all (a cluster of 1 is still a cluster launch).
template <int BN, int STAGES, class MMA, class TOut, int EPI, bool ACCUM, bool PROMOTE>
__global__ void __launch_bounds__(THREADS, 1) fp8_gemm_tn(TC_GEMM_PARAMS) {
    gemm<BN, STAGES, 1, MMA, TOut, EPI, ACCUM, PROMOTE, 0>(TC_GEMM_ARGS);
}

template <int BN, int STAGES, class MMA, class TOut, int EPI, bool ACCUM, bool PROMOTE>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(THREADS, 1)
fp8_gemm_tn_cluster2(TC_GEMM_PARAMS) {
    gemm<BN, STAGES, 2, MMA, TOut, EPI, ACCUM, PROMOTE, 0>(TC_GEMM_ARGS);
}

// A's rows arriving in chunks while it runs (Chunks above): the all-gather before a
// sequence-parallel column GEMM, overlapped (distributed/). Per-tensor, no cluster.
template <int BN, int STAGES, class MMA, class TOut, int EPI, bool ACCUM, bool PROMOTE>
__global__ void __launch_bounds__(THREADS, 1) fp8_gemm_tn_wait(TC_GEMM_PARAMS,
                                                              const Chunks chunks) {
    gemm<BN, STAGES, 1, MMA, TOut, EPI, ACCUM, PROMOTE, 0, false, true>(TC_GEMM_ARGS, chunks);
}

// Block scaling (header): scale_inv_a is A's [ceil(K / 128), M] factors, scale_inv_b B's
// in SCALE's layout (1: 1x128 blocks, 2: 128x128); split accumulation, no cluster.
template <int BN, int STAGES, class MMA, class TOut, int EPI, bool ACCUM, int SCALE>
__global__ void __launch_bounds__(THREADS, 1) fp8_block_gemm_tn(TC_GEMM_PARAMS) {
    static_assert(SCALE == 1 || SCALE == 2, "SCALE: 1 (1x128 B) or 2 (128x128 B)");
    gemm<BN, STAGES, 1, MMA, TOut, EPI, ACCUM, true, SCALE>(TC_GEMM_ARGS);
}

// The same with every factor in shared memory (mainloop_smem; kernels/fp8_gemm.py's
// BLOCK_PIPELINE).
template <int BN, int STAGES, class MMA, class TOut, int EPI, bool ACCUM, int SCALE>
__global__ void __launch_bounds__(THREADS, 1) fp8_block_gemm_pipe_tn(TC_GEMM_PARAMS) {
    static_assert(SCALE == 1 || SCALE == 2, "SCALE: 1 (1x128 B) or 2 (128x128 B)");
    gemm<BN, STAGES, 1, MMA, TOut, EPI, ACCUM, true, SCALE, true>(TC_GEMM_ARGS);
}

}  // namespace tc
