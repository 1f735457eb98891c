// attention_sm90.cu — fused attention forward on Hopper (sm_90a only): TMA loads, wgmma,
// warp specialization (FlashAttention-3's scheme). Semantics, layouts and outputs are those
// of attention_fwd in attention.cu (see there), without dropout (that case runs there).
//
//   attention_fwd_sm90  grid (ceil(sq / 128), h, b), 384 threads. Warpgroup 0 produces:
//                       one thread issues the TMA loads of the Q tile and of the K and V
//                       tiles (128 rows) into a ring of STAGES buffers. Warpgroups 1 and 2
//                       each own 64 query rows: S = Q K^T (wgmma, both operands in shared
//                       memory), the online softmax in registers, O += P V (wgmma with P
//                       from registers: the accumulator layout of S is the A-fragment
//                       layout of the next wgmma, so P never goes through shared memory).
//
// Shared tiles are TMA boxes of 64 columns (128 bytes) x 128 rows with the 128-byte swizzle,
// one box ("panel") per 64 columns of d: row r of a panel lies at r * 128 bytes with its
// 16-byte chunk c at c ^ (r % 8). wgmma reads Q and K from them as K-major operands and V
// as an MN-major (transposed) B operand. Every panel starts 1024-byte aligned.
#include "attention_common.cuh"

struct alignas(64) TmaDesc {  // a CUtensorMap, encoded on the host (NVRTC lacks the type)
    unsigned long long w[16];
};

// ---- mbarrier and TMA --------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
                 "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done = 0;
    while (!done)
        asm volatile("{\n.reg .pred p;\n"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}
// box at coordinates (c0 innermost .. c3) of the tensor `d` describes -> shared `dst`;
// completes `bytes` of the transaction on `bar`
__device__ __forceinline__ void tma_load_4d(unsigned dst, const TmaDesc& d, unsigned bar,
                                            int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
                 ::"r"(dst), "l"(&d), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}

// ---- wgmma -------------------------------------------------------------------------------
// Shared-memory matrix descriptor of a 128B-swizzled operand: start address, leading and
// stride byte offsets (K-major: stride = 1024, the 8-row group; MN-major: leading = the
// next 64 columns, stride = the next 8 rows of K).
__device__ __forceinline__ unsigned long long smem_desc(unsigned addr, unsigned lead,
                                                        unsigned stride) {
    return ((addr & 0x3FFFF) >> 4) | ((unsigned long long)(lead >> 4) << 16) |
           ((unsigned long long)(stride >> 4) << 32) | (1ULL << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_wait0() {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// After a wait: the accumulators are read only from here on (the compiler does not know
// that wgmma writes them asynchronously).
template <int N> __device__ __forceinline__ void reg_fence(float (&d)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

#define ACC4(d, n) "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3])
#define ACC32(d) ACC4(d, 0), ACC4(d, 1), ACC4(d, 2), ACC4(d, 3), ACC4(d, 4), ACC4(d, 5), \
                 ACC4(d, 6), ACC4(d, 7)
#define ACC64(d) ACC32(d), ACC4(d, 8), ACC4(d, 9), ACC4(d, 10), ACC4(d, 11), ACC4(d, 12), \
                 ACC4(d, 13), ACC4(d, 14), ACC4(d, 15)
#define REGS32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, " \
               "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define REGS64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, " \
               "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, " \
               "%47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, " \
               "%62, %63}"

// d[64 x N] (+)= A[64 x 16] B[16 x N] for one warpgroup, float32 accumulate (acc = 0: d =).
//   ss128: A and B K-major in shared memory (descriptors), N = 128.
//   rs<N>: A from registers (a[4]: the thread's A fragment), B MN-major in shared memory.
template <typename T> struct Wgmma;
#define DEFINE_WGMMA(T, TY)                                                                  \
    template <> struct Wgmma<T> {                                                            \
        __device__ static void ss128(float (&d)[16][4], unsigned long long a,                \
                                     unsigned long long b, int acc) {                        \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                        \
                         "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " REGS64 \
                         ", %64, %65, p, 1, 1, 0, 0;\n}\n"                                   \
                         : ACC64(d) : "l"(a), "l"(b), "r"(acc));                             \
        }                                                                                    \
        __device__ static void rs(float (&d)[16][4], const unsigned a[4],                    \
                                  unsigned long long b, int acc) {                           \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                        \
                         "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " REGS64 \
                         ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                     \
                         : ACC64(d)                                                          \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));    \
        }                                                                                    \
        __device__ static void rs(float (&d)[8][4], const unsigned a[4],                     \
                                  unsigned long long b, int acc) {                           \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                        \
                         "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " REGS32  \
                         ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"                     \
                         : ACC32(d)                                                          \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));    \
        }                                                                                    \
    };
DEFINE_WGMMA(__nv_bfloat16, "bf16")
DEFINE_WGMMA(__half, "f16")

// ---- forward -----------------------------------------------------------------------------
constexpr int kSm90BM = 128, kSm90BN = 128;  // query rows per block, keys per tile
constexpr unsigned kPanel = 128 * 128;       // bytes of a 64-column box of 128 rows

// Shared memory (bytes from a 1024-aligned base): Q, the K and V rings, the barriers
// (q_full, k_full[STAGES], v_full[STAGES], empty[STAGES]).
template <int D, int STAGES> struct Sm90Smem {
    static constexpr unsigned TILE = (D / 64) * kPanel, Q = 0, K = TILE,
                              V = K + STAGES * TILE, BAR = V + STAGES * TILE,
                              BYTES = BAR + 8 * (1 + 3 * STAGES) + 1024;  // + alignment slack
};

// The producer thread: Q once, then K and V tile j into buffer j % STAGES once the
// consumers have released it. Out-of-range rows arrive as zeros (TMA fills them).
template <int D, int STAGES>
__device__ __forceinline__ void fwd_produce(const TmaDesc& tq, const TmaDesc& tk,
                                            const TmaDesc& tv, unsigned base, int m0,
                                            int head, int kvh, int b, int n_tiles) {
    using S = Sm90Smem<D, STAGES>;
    const unsigned bar_q = base + S::BAR, bar_k = bar_q + 8, bar_v = bar_k + 8 * STAGES,
                   bar_e = bar_v + 8 * STAGES;
    mbar_expect_tx(bar_q, S::TILE);
#pragma unroll
    for (int p = 0; p < D / 64; ++p) tma_load_4d(base + S::Q + p * kPanel, tq, bar_q, 64 * p, head, m0, b);
    for (int j = 0; j < n_tiles; ++j) {
        const int s = j % STAGES;
        if (j >= STAGES) mbar_wait(bar_e + 8 * s, (j / STAGES - 1) & 1);
        mbar_expect_tx(bar_k + 8 * s, S::TILE);
#pragma unroll
        for (int p = 0; p < D / 64; ++p)
            tma_load_4d(base + S::K + s * S::TILE + p * kPanel, tk, bar_k + 8 * s, 64 * p, kvh,
                        j * kSm90BN, b);
        mbar_expect_tx(bar_v + 8 * s, S::TILE);
#pragma unroll
        for (int p = 0; p < D / 64; ++p)
            tma_load_4d(base + S::V + s * S::TILE + p * kPanel, tv, bar_v + 8 * s, 64 * p, kvh,
                        j * kSm90BN, b);
    }
}

template <typename T, int D, bool CAUSAL>
__global__ void __launch_bounds__(384, 1)
attention_fwd_sm90(const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk,
                   const __grid_constant__ TmaDesc tv, T* __restrict__ o,
                   float* __restrict__ lse, const int* __restrict__ seqlens_q,
                   const int* __restrict__ seqlens_kv, int sq, int skv, int h, int hk,
                   float scale_log2, long long o_b, long long o_s) {
    constexpr int STAGES = 2, BM = kSm90BM, BN = kSm90BN;
    using S = Sm90Smem<D, STAGES>;
    extern __shared__ unsigned char smem_raw[];
    const unsigned base = (smem_u32(smem_raw) + 1023) & ~1023u;
    const unsigned bar_q = base + S::BAR, bar_k = bar_q + 8, bar_v = bar_k + 8 * STAGES,
                   bar_e = bar_v + 8 * STAGES;
    // causal: the last query blocks have the most keys; they start first
    const int m0 = (CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BM;
    const int head = blockIdx.y, b = blockIdx.z, kvh = head / (h / hk);
    const int q_len = seqlens_q ? seqlens_q[b] : sq, kv_len = seqlens_kv ? seqlens_kv[b] : skv;
    const int n_end = CAUSAL ? min(kv_len, m0 + BM) : kv_len;
    const int n_tiles = m0 < q_len ? (n_end + BN - 1) / BN : 0;
    if (threadIdx.x == 0) {
        mbar_init(bar_q, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bar_k + 8 * s, 1);
            mbar_init(bar_v + 8 * s, 1);
            mbar_init(bar_e + 8 * s, 8);  // one arrival per consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int wg = threadIdx.x / 128;
    if (wg == 0) {  // producer: few registers, one thread at work
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (threadIdx.x == 0 && n_tiles > 0)
            fwd_produce<D, STAGES>(tq, tk, tv, base, m0, head, kvh, b, n_tiles);
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    const int lane = threadIdx.x & 31, row0 = m0 + 64 * (wg - 1);  // this warpgroup's rows
    const int row = row0 + 16 * ((threadIdx.x >> 5) & 3) + (lane >> 2);
    const unsigned q_tile = base + S::Q + (wg - 1) * 64 * 128;
    float acc[D / 8][4] = {}, m[2] = {-kInf, -kInf}, l[2] = {0.f, 0.f};
    if (n_tiles > 0) mbar_wait(bar_q, 0);
    for (int j = 0; j < n_tiles; ++j) {
        const int s = j % STAGES;
        const unsigned ph = (j / STAGES) & 1, k_tile = base + S::K + s * S::TILE,
                       v_tile = base + S::V + s * S::TILE;
        float sc[BN / 8][4];
        mbar_wait(bar_k + 8 * s, ph);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {  // 16 columns of d: panel kk / 4, 32 bytes in
            const unsigned off = (kk / 4) * kPanel + (kk % 4) * 32;
            Wgmma<T>::ss128(sc, smem_desc(q_tile + off, 16, 1024),
                            smem_desc(k_tile + off, 16, 1024), kk > 0);
        }
        wg_commit();
        wg_wait0();
        reg_fence(sc);
        const bool masked = (j + 1) * BN > kv_len || (CAUSAL && (j + 1) * BN - 1 > row0);
        fwd_softmax<D, BN, CAUSAL, false>(sc, m, l, acc, row, j * BN, kv_len, masked,
                                          scale_log2, 0, skv, Dropout{});
        unsigned pa[BN / 16][4];
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            pa[kk][0] = Mma<T>::pack(sc[2 * kk][0], sc[2 * kk][1]);
            pa[kk][1] = Mma<T>::pack(sc[2 * kk][2], sc[2 * kk][3]);
            pa[kk][2] = Mma<T>::pack(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
            pa[kk][3] = Mma<T>::pack(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
        }
        mbar_wait(bar_v + 8 * s, ph);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)  // 16 keys: 2 groups of 8 rows of every panel
            Wgmma<T>::rs(acc, pa[kk], smem_desc(v_tile + kk * 16 * 128, kPanel, 1024), 1);
        wg_commit();
        wg_wait0();
        reg_fence(acc);
        __syncwarp();
        if (lane == 0) mbar_arrive(bar_e + 8 * s);  // this warp is done with K and V of j
    }
    fwd_store<T, D>(o + b * o_b + head * D, lse + (long long)(b * h + head) * sq, acc, m, l,
                    row, sq, q_len, o_s);
}
