// attention_common.cuh — what the attention kernels share (attention.cu on mma.sync,
// attention_sm90.cu on wgmma): the online softmax and the output store, both over the
// accumulator layout of mma.sync m16n8 and of wgmma m64nN (per warp: 16 rows, a thread
// holds rows lane / 4 and lane / 4 + 8, columns 8 n + 2 (lane % 4) + {0, 1}), the packing
// of float pairs to 16-bit, the dropout mask, the turns of the deterministic dQ.
#pragma once
#include "common.cuh"

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx: exp2(-inf) = 0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// c[16x8] += a[16x16] b[16x8] (row.col): a, b as ldmatrix gives them, c float32
template <typename T> struct Mma;
// One specialization per 16-bit type: its PTX type name and its float-pair packing.
#define TECUPY_MMA(T, PTX, T2, PACK)                                                          \
    template <> struct Mma<T> {                                                               \
        __device__ static void run(float c[4], const unsigned a[4], unsigned b0,              \
                                   unsigned b1) {                                             \
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX ".f32 "         \
                         "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"             \
                         : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                     \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));     \
        }                                                                                     \
        __device__ static unsigned pack(float lo, float hi) {                                 \
            T2 v = PACK(lo, hi);                                                              \
            return *reinterpret_cast<unsigned*>(&v);                                          \
        }                                                                                     \
    };
TECUPY_MMA(__nv_bfloat16, "bf16", __nv_bfloat162, __floats2bfloat162_rn)
TECUPY_MMA(__half, "f16", __half2, __floats2half2_rn)
#undef TECUPY_MMA

// Philox keep flag of element `index` of the flat [b, h, sq, skv] score array
__device__ __forceinline__ bool dropout_keep(unsigned long long index, uint2 key, float p) {
    const unsigned long long g = index >> 2;
    const uint4 w = philox4x32_10(make_uint4((unsigned)g, (unsigned)(g >> 32), 0u, 0u), key);
    const unsigned s = index & 3;
    return keep_word(s == 0 ? w.x : s == 1 ? w.y : s == 2 ? w.z : w.w, p);
}

struct Dropout {
    uint2 key;
    float p, factor;
};

// Online softmax over one 16-row tile: s (raw scores) becomes P (dropped out), m and l
// (base 2) are updated, corr is the factor O's rows take (rescale). row: this thread's
// first query row; col0: first key.
// The scale goes into the exponent's multiply-add: the maximum is taken over the raw
// scores, which needs scale > 0.
template <int BN, bool CAUSAL, bool DROPOUT>
__device__ __forceinline__ void fwd_softmax(float s[][4], float m[2], float l[2],
                                            float corr[2], int row, int col0, int kv_len,
                                            bool masked, float scale_log2,
                                            unsigned long long index0, int skv,
                                            const Dropout& dr) {
    constexpr int NP = 4;  // partial maxima and sums: short dependency chains
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        float mp[NP] = {-kInf, -kInf, -kInf, -kInf};
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int c = col0 + 8 * nt + 2 * t + e;
                if (masked && (c >= kv_len || (CAUSAL && c > row + 8 * i)))
                    s[nt][2 * i + e] = -kInf;
                mp[nt % NP] = fmaxf(mp[nt % NP], s[nt][2 * i + e]);
            }
        float mx = fmaxf(fmaxf(mp[0], mp[1]), fmaxf(mp[2], mp[3]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[i], mx * scale_log2), m_use = m_new == -kInf ? 0.f : m_new;
        corr[i] = fast_exp2(m[i] - m_use);
        m[i] = m_new;
        float sp[NP] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float pe = fast_exp2(fmaf(s[nt][2 * i + e], scale_log2, -m_use));
                sp[nt % NP] += pe;
                if (DROPOUT) {
                    const int c = col0 + 8 * nt + 2 * t + e;
                    const unsigned long long idx = index0 + (unsigned long long)(8 * i) * skv + c;
                    pe = dropout_keep(idx, dr.key, dr.p) ? pe * dr.factor : 0.f;
                }
                s[nt][2 * i + e] = pe;
            }
        l[i] = l[i] * corr[i] + ((sp[0] + sp[1]) + (sp[2] + sp[3]));
    }
}

// acc (O of the thread's two rows) *= the softmax's correction of each row
template <int D> __device__ __forceinline__ void rescale(float acc[][4], const float corr[2]) {
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
        acc[dt][0] *= corr[0];
        acc[dt][1] *= corr[0];
        acc[dt][2] *= corr[1];
        acc[dt][3] *= corr[1];
    }
}

// Write one 16-row tile of O (acc / l, or 0) and its lse.
template <typename T, int D>
__device__ __forceinline__ void fwd_store(T* ob, float* lseb, const float acc[][4],
                                          const float m[2], const float l[2], int row, int sq,
                                          int q_len, long long stride) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = row + 8 * i;
        float li = l[i];
        li += __shfl_xor_sync(0xffffffffu, li, 1);
        li += __shfl_xor_sync(0xffffffffu, li, 2);
        const bool ok = r < q_len && li > 0.f;
        const float inv = ok ? 1.f / li : 0.f;
        if (r >= sq) continue;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt)
            *reinterpret_cast<unsigned*>(ob + r * stride + 8 * dt + 2 * t) =
                Mma<T>::pack(acc[dt][2 * i] * inv, acc[dt][2 * i + 1] * inv);
        if (t == 0) lseb[r] = ok ? m[i] * kLn2 + logf(li) : kInf;
    }
}

// Write dK and dV (accumulators of the thread's key rows kv_row, kv_row + 8; rows >= skv are
// skipped) at base + row * stride (dv is laid out as dk).
template <typename T, int D>
__device__ __forceinline__ void store_dkv(T* dk, T* dv, const float dkr[][4],
                                          const float dvr[][4], long long base, int kv_row,
                                          int skv, long long stride) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = kv_row + 8 * i;
        if (r >= skv) continue;
        const long long off = base + r * stride + 2 * t;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
            *reinterpret_cast<unsigned*>(dk + off + 8 * dt) =
                Mma<T>::pack(dkr[dt][2 * i], dkr[dt][2 * i + 1]);
            *reinterpret_cast<unsigned*>(dv + off + 8 * dt) =
                Mma<T>::pack(dvr[dt][2 * i], dvr[dt][2 * i + 1]);
        }
    }
}

// ---- the order of a causal grid's blocks --------------------------------------------------
// Causal blocks differ in work: the forward's last query block meets every KV block, its
// first one block; the backward's first KV block meets every query block. Blocks are
// dispatched in index order (x fastest), so with x the block within one (head, batch) pair
// the longest blocks of the last pairs started late and ran alone at the end. Instead the
// longest first across groups of kLongestFirstPairs pairs: a block's index gives its rank
// (0: the most work) slowest and its pair fastest within the group. Simulated (list
// scheduling on 132 SMs, PERFLOG session 24): medium (16 blocks, 32 pairs) 90 -> 72 steps
// backward, 47 -> 38 forward; quickstart (128 pairs) -5%. Small groups keep the pairs in
// flight at once few, as before, so their K and V (Q and dO) still share L2.
// ATTN_LONGEST_FIRST=0 compiles the old order (to time it).
#ifndef ATTN_LONGEST_FIRST
#define ATTN_LONGEST_FIRST 1
#endif
constexpr int kLongestFirstPairs = 8;
struct BlockPlace {
    int rank, y, z;  // rank: 0 for the pair's longest block; y, z: blockIdx.y, .z's roles
};
__device__ __forceinline__ BlockPlace longest_first() {
    const int nx = gridDim.x, pairs = gridDim.y * gridDim.z;
    const int id = blockIdx.x + nx * (blockIdx.y + gridDim.y * blockIdx.z);
    const int g0 = id / (nx * kLongestFirstPairs) * kLongestFirstPairs;  // group's 1st pair
    const int size = min(kLongestFirstPairs, pairs - g0), r = id - g0 * nx;
    const int p = g0 + r % size;
    return {r / size, p % gridDim.y, p / gridDim.y};
}
// The forward's place: rank 0 is the pair's last query block when causal (it meets every
// KV block).
template <bool CAUSAL> __device__ __forceinline__ BlockPlace fwd_place() {
    if (CAUSAL && ATTN_LONGEST_FIRST) return longest_first();
    return {int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)};
}
// The backward's: rank = the KV block (the first meets every query block when causal).
// DET keeps the index order, backwards when causal: an earlier turn must be a lower index
// (see DET below).
template <bool CAUSAL, bool DET> __device__ __forceinline__ BlockPlace bwd_place() {
    if (CAUSAL && !DET && ATTN_LONGEST_FIRST) return longest_first();
    return {int(DET && CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x), int(blockIdx.y),
            int(blockIdx.z)};
}

// ---- deterministic dQ: KV blocks add in turns ---------------------------------------------
// Both backward kernels run one block per (KV block nb of BN keys, KV head, batch) and add
// its part of dQ into the float32 dq_acc, query block (BM rows) after query block. By
// default with float reductions, whose order (so the sum's rounding) varies between runs.
// DET: one int32 counter per (batch, query head, query block), zeroed by the kernel before
// the backward (prep / dot); the block whose turn at that counter is t waits until it reads
// A t (A: the adders of a block: its warps, or the threads issuing its TMA reductions),
// adds, and each adder counts itself in (a release add) later in the next step, so the adds
// to every element come in the turns' order.
// Turns: the blocks that add into query block qb are nb = 0 .. nc - 1 (blocks at or past
// kv_len add nothing; causal: block nb meets qb iff nb BN <= qb BM). No mask: turn = nb.
// Causal: turn = nc - 1 - nb (the diagonal block first) and the grid runs nb backwards
// (blockIdx.x = last - nb), so that the blocks later in line never wait for long: each
// starts at query block nb BN / BM and so works ahead of all lower nb.
// No deadlock: an earlier turn is always a lower blockIdx.x (same head and batch), and
// blocks are dispatched in index order, so the lowest-index resident block waits only on
// blocks that have finished; it runs to the end and frees its SM for the next.
template <int BM, int BN, bool CAUSAL>
__device__ __forceinline__ int dq_turn(int nb, int qb, int kv_len) {
    static_assert(BN % BM == 0, "a KV block starts at a query block's first row");
    if (!CAUSAL) return nb;
    return min((kv_len + BN - 1) / BN, qb / (BN / BM) + 1) - 1 - nb;
}
__device__ __forceinline__ int ld_relaxed(const int* p) {
    int v;
    asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// Wait for the turn (v: the counter read early), then acquire: the earlier turns' adds
// are ordered before this thread's.
__device__ __forceinline__ void turn_wait(const int* counter, int want, int v) {
    while (v != want) v = ld_relaxed(counter);
    asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
}
// This warp's adds are done: the warp barrier orders every lane's before lane 0's release
// add (cumulative), which counts the warp in. Called well after the adds, so that its fence
// finds them landed.
__device__ __forceinline__ void turn_release(int* counter) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0)
        asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(counter) : "memory");
}
