// attention_sm90.cu — fused attention on Hopper (sm_90a only): TMA loads, wgmma, warp
// specialization (FlashAttention-3's scheme). Semantics, layouts and outputs are those of
// attention_fwd / attention_bwd in attention.cu (see there), without dropout (that case runs
// there).
//
//   attention_fwd_sm90       grid (ceil(sq / 128), h, b), 384 threads. Warpgroup 0 produces:
//                            one thread issues the TMA loads of the Q tile and of the K and
//                            V tiles (BN rows: 176, or 128 when causal) into a ring of
//                            STAGES buffers. Warpgroups 1 and 2 each own 64 query rows:
//                            S = Q K^T (wgmma, both operands in shared memory), the online
//                            softmax in registers, O += P V (wgmma with P from registers:
//                            the accumulator layout of S is the A-fragment layout of the next
//                            wgmma, so P never goes through shared memory).
//   attention_bwd_prep_sm90  lse2 = lse log2(e), delta = rowsum(dO O), padded rows; zeroes
//                            the turn counters of the deterministic dQ.
//   attention_bwd_sm90       grid (ceil(skv / 128), hk, b): 128 keys per block, steps of 64
//                            queries; see the kernel. dQ added into dq_acc by TMA reductions
//                            from shared memory; DET: in a fixed order (attention_common.cuh),
//                            the causal grid backwards.
//
// Shared tiles are TMA boxes of 64 columns (128 bytes) x rows with the 128-byte swizzle, one
// box ("panel") per 64 columns of d: row r of a panel lies at r * 128 bytes with its 16-byte
// chunk c at c ^ (r % 8). wgmma reads Q and K from them as K-major operands and V (dO, Q in
// the backward) as MN-major (transposed) B operands. Every panel starts 1024-byte aligned.
#include "attention_common.cuh"
#include "bulk.cuh"

struct alignas(64) TmaDesc {  // a CUtensorMap, encoded on the host (NVRTC lacks the type)
    unsigned long long w[16];
};

// ---- TMA ------------------------------------------------------------------------------
// box at coordinates (c0 innermost .. c3) of the tensor `d` describes -> shared `dst`;
// completes `bytes` of the transaction on `bar`
__device__ __forceinline__ void tma_load_4d(unsigned dst, const TmaDesc& d, unsigned bar,
                                            int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
                 ::"r"(dst), "l"(&d), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}
// shared `src` (one box, laid out as a load of `d` would leave it) added element-wise into
// the tensor at (c0 .. c3) by the TMA; one bulk group per thread's commit. Rows past the
// tensor's bounds are dropped.
__device__ __forceinline__ void tma_reduce_add_4d(const TmaDesc& d, unsigned src, int c0,
                                                  int c1, int c2, int c3) {
    asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group"
                 " [%0, {%2, %3, %4, %5}], [%1];\n"
                 ::"l"(&d), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// this thread's bulk groups have read their shared sources (the writes may be in flight)
__device__ __forceinline__ void bulk_wait_read0() {
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// ... and are complete
__device__ __forceinline__ void bulk_wait0() {
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
// DET with TMA dQ: this thread's reductions are complete; count one adder in (release)
__device__ __forceinline__ void bulk_turn_release(int* counter) {
    bulk_wait0();
    asm volatile("fence.proxy.async.global;\n" ::: "memory");  // (their writes, then the add)
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(counter) : "memory");
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
__device__ __forceinline__ void wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
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
#define ACC16(d) ACC4(d, 0), ACC4(d, 1), ACC4(d, 2), ACC4(d, 3)
#define ACC32(d) ACC16(d), ACC4(d, 4), ACC4(d, 5), ACC4(d, 6), ACC4(d, 7)
#define ACC64(d) ACC32(d), ACC4(d, 8), ACC4(d, 9), ACC4(d, 10), ACC4(d, 11), ACC4(d, 12), \
                 ACC4(d, 13), ACC4(d, 14), ACC4(d, 15)
#define REGS16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define REGS32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, " \
               "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define ACC88(d) ACC64(d), ACC4(d, 16), ACC4(d, 17), ACC4(d, 18), ACC4(d, 19), ACC4(d, 20), \
                 ACC4(d, 21)
#define REGS88 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, " \
               "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, " \
               "%47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, " \
               "%62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, " \
               "%77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}"
#define REGS64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, " \
               "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, " \
               "%47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, " \
               "%62, %63}"

// d[64 x N] (+)= A[64 x 16] B[16 x N] for one warpgroup, float32 accumulate (acc = 0: d =).
//   ss<TA, TB>: A and B in shared memory (descriptors); TA / TB = 1: A / B MN-major.
//   rs: A from registers (a[4]: the thread's fragment), B MN-major in shared memory.
// The operand numbers after the N / 2 accumulators are spelled out per shape.
#define WGMMA_SHAPE(TY, N, REGS, ACC, SS_OPS, SS_P, RS_OPS, RS_P)                           \
    template <int TA, int TB>                                                                \
    __device__ static void ss(float (&d)[N / 8][4], unsigned long long a,                    \
                              unsigned long long b, int acc) {                               \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SS_P ", 0;\n"                       \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS    \
                     ", " SS_OPS ";\n}\n"                                                    \
                     : ACC(d) : "l"(a), "l"(b), "r"(acc), "n"(TA), "n"(TB));                 \
    }                                                                                        \
    __device__ static void rs(float (&d)[N / 8][4], const unsigned a[4],                     \
                              unsigned long long b, int acc) {                               \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " RS_P ", 0;\n"                       \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS    \
                     ", " RS_OPS ";\n}\n"                                                    \
                     : ACC(d)                                                                \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));        \
    }
#define DEFINE_WGMMA(T, TY)                                                                  \
    template <> struct Wgmma<T> {                                                            \
        WGMMA_SHAPE(TY, 176, REGS88, ACC88, "%88, %89, p, 1, 1, %91, %92", "%90",            \
                    "{%88, %89, %90, %91}, %92, p, 1, 1, 1", "%93")                          \
        WGMMA_SHAPE(TY, 128, REGS64, ACC64, "%64, %65, p, 1, 1, %67, %68", "%66",            \
                    "{%64, %65, %66, %67}, %68, p, 1, 1, 1", "%69")                          \
        WGMMA_SHAPE(TY, 64, REGS32, ACC32, "%32, %33, p, 1, 1, %35, %36", "%34",             \
                    "{%32, %33, %34, %35}, %36, p, 1, 1, 1", "%37")                          \
        WGMMA_SHAPE(TY, 32, REGS16, ACC16, "%16, %17, p, 1, 1, %19, %20", "%18",             \
                    "{%16, %17, %18, %19}, %20, p, 1, 1, 1", "%21")                          \
    };
template <typename T> struct Wgmma;
DEFINE_WGMMA(__nv_bfloat16, "bf16")
DEFINE_WGMMA(__half, "f16")

// ---- forward -----------------------------------------------------------------------------
constexpr int kSm90BM = 128;             // query rows per block (keys per tile: BN)
constexpr unsigned kPanel = 128 * 128;   // bytes of a 64-column box of 128 rows
constexpr int kSchedBar = 1;                 // named barriers 1, 2: the consumers' turns
template <bool B> struct Bool {
    static constexpr bool value = B;
};

// Shared memory (bytes from a 1024-aligned base): Q, the K and V rings (tiles of BN rows,
// panels of PANEL bytes), the barriers (q_full, k_full[STAGES], v_full[STAGES],
// k_empty[STAGES], v_empty[STAGES]).
template <int D, int BN, int STAGES> struct Sm90Smem {
    static constexpr unsigned PANEL = BN * 128, TILE = (D / 64) * PANEL, Q = 0,
                              K = (D / 64) * kPanel, V = K + STAGES * TILE,
                              BAR = V + STAGES * TILE,
                              BYTES = BAR + 8 * (1 + 4 * STAGES) + 1024;  // + alignment slack
    // barrier addresses from the base
    static constexpr unsigned QF = BAR, KF = QF + 8, VF = KF + 8 * STAGES,
                              KE = VF + 8 * STAGES, VE = KE + 8 * STAGES;
};

// The producer thread: Q once, then K and V tile j into buffer j % STAGES once the
// consumers have released that buffer's K (V). Out-of-range rows arrive as zeros.
template <int D, int BN, int STAGES>
__device__ __forceinline__ void fwd_produce(const TmaDesc& tq, const TmaDesc& tk,
                                            const TmaDesc& tv, unsigned base, int m0,
                                            int head, int kvh, int b, int n_tiles) {
    using S = Sm90Smem<D, BN, STAGES>;
    mbar_expect_tx(base + S::QF, S::K);  // the Q tile ends where K starts
#pragma unroll
    for (int p = 0; p < D / 64; ++p)
        tma_load_4d(base + S::Q + p * kPanel, tq, base + S::QF, 64 * p, head, m0, b);
    for (int j = 0; j < n_tiles; ++j) {
        const int s = j % STAGES;
        const unsigned use = (j / STAGES - 1) & 1;  // phase of the buffer's last release
#pragma unroll
        for (int m = 0; m < 2; ++m) {  // K, then V
            const unsigned full = base + (m ? S::VF : S::KF) + 8 * s,
                           tile = base + (m ? S::V : S::K) + s * S::TILE;
            if (j >= STAGES) mbar_wait(base + (m ? S::VE : S::KE) + 8 * s, use);
            mbar_expect_tx(full, S::TILE);
#pragma unroll
            for (int p = 0; p < D / 64; ++p)
                tma_load_4d(tile + p * S::PANEL, m ? tv : tk, full, 64 * p, kvh, j * BN, b);
        }
    }
}

__device__ __forceinline__ void bar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
// one arrival per warp on an mbarrier, once the warp's wgmma reads are complete
__device__ __forceinline__ void warp_release(unsigned bar) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(bar);
}

// S = Q K^T for a warpgroup's 64 rows: 16 columns of d per step (panel kk / 4, 32 bytes in)
template <typename T, int D, int BN>
__device__ __forceinline__ void fwd_qk(float (&sc)[BN / 8][4], unsigned q_tile,
                                       unsigned k_tile) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const unsigned col = (kk % 4) * 32;
        Wgmma<T>::template ss<0, 0>(sc, smem_desc(q_tile + (kk / 4) * kPanel + col, 16, 1024),
                                    smem_desc(k_tile + (kk / 4) * BN * 128 + col, 16, 1024),
                                    kk > 0);
    }
}
// O += P V: P from registers, V MN-major; 16 keys per step (2 groups of 8 rows of a panel)
template <typename T, int D, int BN>
__device__ __forceinline__ void fwd_pv(float (&acc)[D / 8][4], const unsigned (&pa)[BN / 16][4],
                                       unsigned v_tile) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
        Wgmma<T>::rs(acc, pa[kk], smem_desc(v_tile + kk * 16 * 128, BN * 128, 1024), 1);
}
// P (float accumulators of N columns) -> A fragments of 16 columns each
template <typename T, int N>
__device__ __forceinline__ void to_a(unsigned (&pa)[N / 16][4], const float (&sc)[N / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
        pa[kk][0] = Mma<T>::pack(sc[2 * kk][0], sc[2 * kk][1]);
        pa[kk][1] = Mma<T>::pack(sc[2 * kk][2], sc[2 * kk][3]);
        pa[kk][2] = Mma<T>::pack(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
        pa[kk][3] = Mma<T>::pack(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
    }
}

// grid (ceil(sq / 128), h, b), 384 threads; see the top of the file. Each consumer
// warpgroup issues S_j = Q K_j^T together with O += P_{j-1} V_{j-1}, and computes the
// softmax of S_j while the second product runs; the two warpgroups take turns to issue
// (named barriers), so one's softmax overlaps the other's products.
template <typename T, int D, int BN, bool CAUSAL, int STAGES>
__global__ void __launch_bounds__(384, 1)
attention_fwd_sm90(const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk,
                   const __grid_constant__ TmaDesc tv, T* __restrict__ o,
                   float* __restrict__ lse, const int* __restrict__ seqlens_q,
                   const int* __restrict__ seqlens_kv, int sq, int skv, int h, int hk,
                   float scale_log2, long long o_b, long long o_s) {
    constexpr int BM = kSm90BM;
    using S = Sm90Smem<D, BN, STAGES>;
    extern __shared__ unsigned char smem_raw[];
    const unsigned base = (smem_u32(smem_raw) + 1023) & ~1023u;
    // causal: the last query blocks have the most keys; they start first
    const BlockPlace at = fwd_place<CAUSAL>();
    const int m0 = (CAUSAL ? gridDim.x - 1 - at.rank : at.rank) * BM;
    const int head = at.y, b = at.z, kvh = head / (h / hk);
    const int q_len = seqlens_q ? seqlens_q[b] : sq, kv_len = seqlens_kv ? seqlens_kv[b] : skv;
    const int n_end = CAUSAL ? min(kv_len, m0 + BM) : kv_len;
    const int n = m0 < q_len ? (n_end + BN - 1) / BN : 0;  // K/V tiles
    if (threadIdx.x == 0) {
        mbar_init(base + S::QF, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(base + S::KF + 8 * s, 1);
            mbar_init(base + S::VF + 8 * s, 1);
            mbar_init(base + S::KE + 8 * s, 8);  // one arrival per consumer warp
            mbar_init(base + S::VE + 8 * s, 8);
        }
        mbar_init_fence();
    }
    __syncthreads();
    const int wg = threadIdx.x / 128;
    if (wg == 0) {  // producer: few registers, one thread at work
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (threadIdx.x == 0 && n > 0)
            fwd_produce<D, BN, STAGES>(tq, tk, tv, base, m0, head, kvh, b, n);
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    const int c = wg - 1, row0 = m0 + 64 * c;  // this warpgroup's rows
    const int row = row0 + 16 * ((threadIdx.x >> 5) & 3) + ((threadIdx.x & 31) >> 2);
    const unsigned q_tile = base + S::Q + c * 64 * 128;
    float acc[D / 8][4] = {}, m[2] = {-kInf, -kInf}, l[2] = {0.f, 0.f}, corr[2];
    unsigned pa[BN / 16][4];
    // step j: S_j (and, when PV, O += P_{j-1} V_{j-1}) issued in this warpgroup's turn, the
    // softmax of S_j while the second product runs. The first step is peeled (PV false):
    // a wgmma behind a runtime condition makes ptxas serialize them all (C7520).
    auto step = [&](int j, auto pv) {
        constexpr bool PV = decltype(pv)::value;
        const int s = j % STAGES, sp = (j + STAGES - 1) % STAGES;  // buffers of j, j - 1
        float sc[BN / 8][4];
        mbar_wait(base + S::KF + 8 * s, (j / STAGES) & 1);
        if (PV) mbar_wait(base + S::VF + 8 * sp, ((j - 1) / STAGES) & 1);
        bar_sync(kSchedBar + c, 256);  // this warpgroup's turn
        wg_fence();
        fwd_qk<T, D, BN>(sc, q_tile, base + S::K + s * S::TILE);
        wg_commit();
        if constexpr (PV) fwd_pv<T, D, BN>(acc, pa, base + S::V + sp * S::TILE);
        wg_commit();
        if (c == 0 || j + 1 < n) bar_arrive(kSchedBar + 1 - c, 256);  // the other's turn
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // S_j is done
        reg_fence(sc);
        warp_release(base + S::KE + 8 * s);
        const bool masked = (j + 1) * BN > kv_len || (CAUSAL && (j + 1) * BN - 1 > row0);
        fwd_softmax<BN, CAUSAL, false>(sc, m, l, corr, row, j * BN, kv_len, masked,
                                       scale_log2, 0, skv, Dropout{});
        wg_wait0();  // O += P_{j-1} V_{j-1} is done
        reg_fence(acc);
        if constexpr (PV) warp_release(base + S::VE + 8 * sp);
        rescale<D>(acc, corr);
        to_a<T, BN>(pa, sc);
    };
    if (n > 0) {
        mbar_wait(base + S::QF, 0);
        if (c == 1) bar_arrive(kSchedBar, 256);  // the first warpgroup issues first
        step(0, Bool<false>());
        for (int j = 1; j < n; ++j) step(j, Bool<true>());
        const int sp = (n - 1) % STAGES;  // the last tile's P V
        mbar_wait(base + S::VF + 8 * sp, ((n - 1) / STAGES) & 1);
        wg_fence();
        fwd_pv<T, D, BN>(acc, pa, base + S::V + sp * S::TILE);
        wg_commit();
        wg_wait0();
        reg_fence(acc);
    }
    fwd_store<T, D>(o + b * o_b + head * D, lse + (long long)(b * h + head) * sq, acc, m, l,
                    row, sq, q_len, o_s);
}

// ---- backward ----------------------------------------------------------------------------
constexpr int kBwdSm90BM = 64, kBwdSm90BN = 128;  // query rows per step, keys per block
// lse2 = lse log2(e) and delta = rowsum(dO * O), both [b h, sq_pad] float32 (rows past q_len
// and sq: +inf and 0, so they drop out of P and dS); a warp per row, 8 rows per block.
// Padded rows let the backward fetch 64 of each per query block in one aligned bulk copy.
// dq_sem (null unless deterministic): [b h, sq_pad / 64] turn counters, zeroed here.
// dq_acc: the backward's float32 dQ sums [b, sq, h, D] (strides dqa_b, dqa_s), zeroed here
// (every row below sq: the convert reads them all), which saves a memset launch.
template <typename T, int D>
__global__ void attention_bwd_prep_sm90(const T* __restrict__ dout, const T* __restrict__ out,
                                        const float* __restrict__ lse,
                                        float* __restrict__ lse2, float* __restrict__ delta,
                                        int* __restrict__ dq_sem,
                                        const int* __restrict__ seqlens_q, int sq, int sq_pad,
                                        int h, long long rows, long long do_b, long long do_s,
                                        long long o_b, long long o_s,
                                        float* __restrict__ dq_acc, long long dqa_b,
                                        long long dqa_s) {
    constexpr int V = D / 32;
    const long long r = blockIdx.x * 8LL + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int lane = threadIdx.x & 31, i = r % sq_pad;
    const long long bh = r / sq_pad, b = bh / h;
    const int head = bh % h, q_len = min(seqlens_q ? seqlens_q[b] : sq, sq);
    if (i < sq) store_vec<V>(dq_acc + b * dqa_b + i * dqa_s + head * D + lane * V, Vec<float, V>{});
    float s = 0.f;
    if (i < q_len) {
        const Vec<T, V> a = load_vec<V>(dout + b * do_b + i * do_s + head * D + lane * V);
        const Vec<T, V> c = load_vec<V>(out + b * o_b + i * o_s + head * D + lane * V);
#pragma unroll
        for (int j = 0; j < V; ++j) s += to_float(a.v[j]) * to_float(c.v[j]);
        s = warp_sum(s);
    }
    if (lane == 0) {
        delta[r] = s;
        lse2[r] = i < q_len ? lse[bh * sq + i] * kLog2e : kInf;
        if (dq_sem && i % kBwdSm90BM == 0) dq_sem[r / kBwdSm90BM] = 0;
    }
}

__device__ __forceinline__ float2 lds_f2(unsigned addr) {  // 8-byte aligned shared load
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
    return v;
}
__device__ __forceinline__ void red_add4(float* p, float a, float b, float c, float d) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(a), "f"(b),
                 "f"(c), "f"(d) : "memory");
}

// dQ by TMA reductions (FlashAttention-3's): each step's dQ goes from the accumulators to a
// float32 staging tile in shared memory, from which the TMA adds it into dq_acc while dK's
// product runs, instead of float vector reductions from registers once both products are
// done. Not in the deterministic backward (its turns order each thread's reductions).
// ATTN_DQ_TMA=0 compiles the old path (to time it; the kernel then takes no tdq).
#ifndef ATTN_DQ_TMA
#define ATTN_DQ_TMA 1
#endif
constexpr int kDsBar = 1;  // named barrier: both consumer warpgroups wrote dS^T
// (kDqBar, kDqBox: enumerators, and BwdSm90SmemDq a type of its own, as with
// -default-device every namespace-scope constant and static member of an instantiated
// struct is a __device__ variable in the cubin: the other kernels' cubins stay as they were)
enum : int { kDqBar = 2 };  // named barriers 2, 3: a warpgroup's dQ is staged (TMA dQ)
enum : unsigned { kDqBox = 64 * 128 };  // bytes of a dq_acc box: 64 rows x 32 floats

// Shared memory (bytes from a 1024-aligned base): K and V of the block (128 rows), rings of
// 2 Q and dO tiles (64 rows), 2 dS^T tiles ([128 keys][64 queries], one panel), 2 x 64
// lse2 and delta, the barriers (kv_full, q_full[2], empty[2]).
template <int D> struct BwdSm90Smem {
    static constexpr unsigned TKV = (D / 64) * kPanel, TQ = TKV / 2, TDS = 128 * 128,
                              K = 0, V = TKV, Q = 2 * TKV, DO = Q + 2 * TQ, DS = DO + 2 * TQ,
                              LSE = DS + 2 * TDS, DELTA = LSE + 2 * 256, BAR = DELTA + 2 * 256,
                              BYTES = BAR + 5 * 8 + 1024;
};
// TMA dQ: 2 dQ staging tiles after the dS^T tiles (one per warpgroup: its D / 2 columns as
// D / 64 boxes of dq_acc), then lse2, delta and the barriers as above.
template <int D> struct BwdSm90SmemDq : BwdSm90Smem<D> {
    using B = BwdSm90Smem<D>;
    static constexpr unsigned TDQ = (D / 64) * kDqBox, DQ = B::DS + 2 * B::TDS,
                              LSE = DQ + 2 * TDQ, DELTA = LSE + 2 * 256, BAR = DELTA + 2 * 256,
                              BYTES = BAR + 5 * 8 + 1024;
};
template <int D, bool TMA_DQ> struct BwdSm90Layout {  // the backward's layout, by its dQ path
    using type = BwdSm90Smem<D>;
};
template <int D> struct BwdSm90Layout<D, true> {
    using type = BwdSm90SmemDq<D>;
};

// The query blocks this KV block meets: the group's heads x blocks qb0 .. qb1 - 1.
struct BwdWork {
    int group, qb0, nqb, total;
    __device__ BwdWork(int n0, int q_len, int kv_len, int h, int hk, bool causal) {
        group = h / hk;
        qb0 = causal ? n0 / kBwdSm90BM : 0;
        nqb = n0 < kv_len ? max((q_len + kBwdSm90BM - 1) / kBwdSm90BM - qb0, 0) : 0;
        total = group * nqb;
    }
};

template <int D, typename S>  // S: the shared memory's layout
__device__ __forceinline__ void bwd_produce(const TmaDesc& tq, const TmaDesc& tk,
                                            const TmaDesc& tv, const TmaDesc& tdo,
                                            const float* lse2, const float* delta,
                                            unsigned base, int n0, int kvh, int b, int h,
                                            int sq_pad, const BwdWork& w) {
    const unsigned bar_kv = base + S::BAR, bar_q = bar_kv + 8, bar_e = bar_q + 16;
    mbar_expect_tx(bar_kv, 2 * S::TKV);
#pragma unroll
    for (int p = 0; p < D / 64; ++p) {
        tma_load_4d(base + S::K + p * kPanel, tk, bar_kv, 64 * p, kvh, n0, b);
        tma_load_4d(base + S::V + p * kPanel, tv, bar_kv, 64 * p, kvh, n0, b);
    }
    for (int it = 0; it < w.total; ++it) {
        const int s = it & 1, hh = kvh * w.group + it / w.nqb;
        const int q0 = (w.qb0 + it % w.nqb) * kBwdSm90BM;
        if (it >= 2) mbar_wait(bar_e + 8 * s, (it / 2 - 1) & 1);
        const unsigned bq = bar_q + 8 * s;
        mbar_expect_tx(bq, 2 * S::TQ + 2 * 256);
#pragma unroll
        for (int p = 0; p < D / 64; ++p) {
            tma_load_4d(base + S::Q + s * S::TQ + p * kPanel / 2, tq, bq, 64 * p, hh, q0, b);
            tma_load_4d(base + S::DO + s * S::TQ + p * kPanel / 2, tdo, bq, 64 * p, hh, q0, b);
        }
        const long long row = (long long)(b * h + hh) * sq_pad + q0;
        bulk_load(base + S::LSE + s * 256, lse2 + row, 256, bq);
        bulk_load(base + S::DELTA + s * 256, delta + row, 256, bq);
    }
}

// S^T (or dP^T) = K (V) Q^T (dO^T) for a warpgroup's 64 keys: both K-major, 16 columns of
// d per step
template <typename T, int D>
__device__ __forceinline__ void bwd_scores(float (&acc)[8][4], unsigned keys, unsigned queries) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {  // panels of 128 key rows, of 64 query rows
        const unsigned col = (kk % 4) * 32;
        Wgmma<T>::template ss<0, 0>(acc, smem_desc(keys + (kk / 4) * kPanel + col, 16, 1024),
                                    smem_desc(queries + (kk / 4) * kPanel / 2 + col, 16, 1024),
                                    kk > 0);
    }
}
// dV (dK) += P^T (dS^T) dO (Q): A fragments from registers, dO (Q) MN-major, 16 queries a step
template <typename T, int D>
__device__ __forceinline__ void bwd_rs(float (&acc)[D / 8][4], const unsigned (&a)[4][4],
                                       unsigned queries) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
        Wgmma<T>::rs(acc, a[kk], smem_desc(queries + kk * 16 * 128, kPanel / 2, 1024), 1);
}
// dS^T fragments (rows r, r + 8 of the tile) -> shared [128 keys][64 queries], 128B-swizzled
__device__ __forceinline__ void store_ds(unsigned tile, const unsigned (&da)[4][4], int r,
                                         int t) {
#pragma unroll
    for (int i = 0; i < 2; ++i, r += 8)
#pragma unroll
        for (int chunk = 0; chunk < 8; ++chunk)  // 8 queries each
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(tile + r * 128 +
                                                          ((chunk ^ (r & 7)) << 4) + 4 * t),
                         "r"(da[chunk / 2][2 * (chunk & 1) + i]));
}
// dQ [64 queries x D / 2 columns] = dS K: A = dS^T (MN-major), B = K's rows at `cols`
// (MN-major), 16 keys per step
template <typename T, int D>
__device__ __forceinline__ void bwd_dq(float (&dq)[D / 16][4], unsigned ds, unsigned cols) {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
        Wgmma<T>::template ss<1, 1>(dq, smem_desc(ds + kk * 16 * 128, 16, 1024),
                                    smem_desc(cols + kk * 16 * 128, 16, 1024), kk > 0);
}

// Strides (elements) of the backward's outputs: batch and sequence of dq_acc and of dk (dv
// is laid out as dk).
struct BwdSm90Strides {
    long long dq_b, dq_s, dk_b, dk_s;
};

// This warpgroup's dQ [64 queries x D / 2 columns] into dq_acc (dqb: the thread's first
// float, rows >= q_len skipped: ok = false): lane pairs swap halves so that each thread adds
// 4 consecutive floats of one row (even t: row g, odd t: row g + 8) in one vector reduction.
template <int D>
__device__ __forceinline__ void bwd_add_dq(float* dqb, const float (&dq)[D / 16][4], bool odd,
                                           bool ok) {
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
        const float r0 = __shfl_xor_sync(0xffffffffu, odd ? dq[n][0] : dq[n][2], 1);
        const float r1 = __shfl_xor_sync(0xffffffffu, odd ? dq[n][1] : dq[n][3], 1);
        if (ok)
            red_add4(dqb + 8 * n, odd ? r0 : dq[n][0], odd ? r1 : dq[n][1],
                     odd ? dq[n][2] : r0, odd ? dq[n][3] : r1);
    }
}
// TMA dQ: this warpgroup's dQ [64 queries x D / 2 columns] (the thread's rows r, r + 8 of the
// tile) -> its staging tile, as the TMA loads dq_acc's boxes (64 rows x 32 floats, 128
// bytes a row): the 16-byte chunk c of row r at c ^ (r % 8). 8-byte stores: a warp's 8 rows
// x 32 bytes fall on each bank twice, the least for 256 bytes.
template <int D>
__device__ __forceinline__ void stage_dq(unsigned tile, const float (&dq)[D / 16][4], int r,
                                         int t) {
#pragma unroll
    for (int i = 0; i < 2; ++i, r += 8)
#pragma unroll
        for (int n = 0; n < D / 16; ++n) {  // columns 8 n + 2 t, + 1: box n / 4, chunk below
            const int chunk = 2 * (n % 4) + (t >> 1);
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n"
                         ::"r"(tile + (n / 4) * kDqBox + r * 128 + ((chunk ^ (r & 7)) << 4) +
                               8 * (t & 1)),
                         "f"(dq[n][2 * i]), "f"(dq[n][2 * i + 1]));
        }
}

// grid (ceil(skv / 128), hk, b), 384 threads: warpgroup 0 produces (K and V once, then Q, dO,
// lse2, delta per query block of 64 rows into a ring of 2); warpgroups 1 and 2 each own 64
// keys: S^T = K Q^T and dP^T = V dO^T (wgmma, shared operands), P^T = exp2(S^T scale log2 e
// - lse2), dS^T = P^T (dP^T - delta) scale, dV += P^T dO and dK += dS^T Q (wgmma with P^T and
// dS^T from registers); dS^T goes to shared memory and each warpgroup computes half of the
// columns of dQ = dS K, added into dq_acc by float32 reductions: TMA reductions from a
// staging tile in shared memory (ATTN_DQ_TMA; tdq: dq_acc's float32 TMA descriptor, boxes of
// 32 columns x 64 rows), else vector reductions from registers. DET: in turns (dq_sem: [b h,
// sq_pad / 64] counters; attention_common.cuh). With the TMA, each warpgroup's issuing thread
// waits for the turn before issuing its reductions and counts itself in (kAdders = 2 a
// block) at the next step, once they are complete; from registers, each warp reads its
// turn's counter at the step's start (again while dQ = dS K runs if it was not its turn
// yet), waits before adding, and counts itself in once the next step's dK product is issued
// (its reductions have landed by then: the fence is cheap).
template <typename T, int D, bool CAUSAL, bool DET>
__global__ void __launch_bounds__(384, 1)
attention_bwd_sm90(const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk,
                   const __grid_constant__ TmaDesc tv, const __grid_constant__ TmaDesc tdo,
                   const float* __restrict__ lse2, const float* __restrict__ delta,
                   float* __restrict__ dq_acc, int* __restrict__ dq_sem, T* __restrict__ dk,
                   T* __restrict__ dv, const int* __restrict__ seqlens_q,
                   const int* __restrict__ seqlens_kv, int sq, int sq_pad, int skv, int h,
                   int hk, float scale, const BwdSm90Strides st
#if ATTN_DQ_TMA
                   , const __grid_constant__ TmaDesc tdq
#endif
                   ) {
    constexpr bool kTmaDq = ATTN_DQ_TMA;
    constexpr int kAdders = kTmaDq ? 2 : 8;  // DET: who adds a block's dQ (issuers or warps)
    using S = typename BwdSm90Layout<D, kTmaDq>::type;
    extern __shared__ unsigned char smem_raw[];
    const unsigned base = (smem_u32(smem_raw) + 1023) & ~1023u;
    const unsigned bar_kv = base + S::BAR, bar_q = bar_kv + 8, bar_e = bar_q + 16;
    const BlockPlace at = bwd_place<CAUSAL, DET>();  // (DET: see there)
    const int nb = at.rank;
    const int n0 = nb * kBwdSm90BN, kvh = at.y, b = at.z;
    // lengths past the sequence (not checked on the GPU) are clamped: no row out of bounds,
    // no turn (DET) that no block takes
    const int q_len = min(seqlens_q ? seqlens_q[b] : sq, sq);
    const int kv_len = min(seqlens_kv ? seqlens_kv[b] : skv, skv);
    const BwdWork w(n0, q_len, kv_len, h, hk, CAUSAL);
    if (threadIdx.x == 0) {
        mbar_init(bar_kv, 1);
        for (int s = 0; s < 2; ++s) {
            mbar_init(bar_q + 8 * s, 1);
            mbar_init(bar_e + 8 * s, 8);  // one arrival per consumer warp
        }
        mbar_init_fence();
    }
    __syncthreads();
    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (threadIdx.x == 0 && w.total > 0)
            bwd_produce<D, S>(tq, tk, tv, tdo, lse2, delta, base, n0, kvh, b, h, sq_pad, w);
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    const int c = wg - 1, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3, kv_row = n0 + 64 * c + 16 * warp + g;
    const float scale_log2 = scale * kLog2e;
    float dkr[D / 8][4] = {}, dvr[D / 8][4] = {};
    int *counter = nullptr, *last = nullptr, want = 0, seen = 0;  // DET: turn, last step's
    if (w.total > 0) mbar_wait(bar_kv, 0);
    for (int it = 0; it < w.total; ++it) {
        const int s = it & 1, hh = kvh * w.group + it / w.nqb, qb = w.qb0 + it % w.nqb;
        const int q0 = qb * kBwdSm90BM;
        const unsigned q_t = base + S::Q + s * S::TQ, do_t = base + S::DO + s * S::TQ,
                       ds_t = base + S::DS + s * S::TDS;
        const unsigned sl = base + S::LSE + s * 256, sd = base + S::DELTA + s * 256;
        mbar_wait(bar_q + 8 * s, (it >> 1) & 1);
        if (DET) {  // read the turn's counter now: by the adds its latency is long past
            last = counter;
            counter = dq_sem + (long long)(b * h + hh) * (sq_pad / kBwdSm90BM) + qb;
            want = kAdders * dq_turn<kBwdSm90BM, kBwdSm90BN, CAUSAL>(nb, qb, kv_len);
            seen = ld_relaxed(counter);
        }
        float st_[8][4], dp[8][4];  // S^T and dP^T: this warpgroup's 64 keys x 64 queries
        unsigned pa[4][4], da[4][4];  // P^T, dS^T as A fragments (16 queries each)
        wg_fence();
        bwd_scores<T, D>(st_, base + S::K + c * 64 * 128, q_t);
        wg_commit();
        bwd_scores<T, D>(dp, base + S::V + c * 64 * 128, do_t);
        wg_commit();
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // S^T is done
        reg_fence(st_);
        const bool masked = n0 + kBwdSm90BN > kv_len || (CAUSAL && n0 + kBwdSm90BN - 1 > q0);
#pragma unroll
        for (int n = 0; n < 8; ++n) {  // P^T while dP^T runs
            const float2 L = lds_f2(sl + 4 * (8 * n + 2 * t));  // lse2 of the 2 queries
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = 8 * n + 2 * t + (e & 1), r = kv_row + 8 * (e >> 1);
                float p = fast_exp2(fmaf(st_[n][e], scale_log2, -(e & 1 ? L.y : L.x)));
                st_[n][e] = masked && (r >= kv_len || (CAUSAL && r > q0 + col)) ? 0.f : p;
            }
        }
        to_a<T, 64>(pa, st_);
        wg_fence();
        bwd_rs<T, D>(dvr, pa, do_t);  // dV += P^T dO
        wg_commit();
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // dP^T is done
        reg_fence(dp);
#pragma unroll
        for (int n = 0; n < 8; ++n) {  // dS^T while dV's product runs
            const float2 dl = lds_f2(sd + 4 * (8 * n + 2 * t));
#pragma unroll
            for (int e = 0; e < 4; ++e)
                dp[n][e] = st_[n][e] * (dp[n][e] - (e & 1 ? dl.y : dl.x)) * scale;
        }
        to_a<T, 64>(da, dp);
#if ATTN_DQ_TMA
        if constexpr (kTmaDq) {
            // FlashAttention-3's order: dQ's product, then dK's; dQ is staged while dK's
            // runs, then added into dq_acc by the TMA, off this warpgroup's path
            const bool issuer = warp == 0 && lane == 0;  // this warpgroup's bulk groups
            const unsigned dq_t = base + S::DQ + c * S::TDQ;
            store_ds(ds_t, da, 64 * c + 16 * warp + g, t);
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            if (issuer && !DET) bulk_wait_read0();  // the last step's reductions read dq_t
            if (issuer && DET && it > 0) bulk_turn_release(last);  // ... and are complete
            bar_sync(kDsBar, 256);  // both warpgroups' dS^T written, dq_t free to write
            float dq[D / 16][4];
            wg_fence();
            bwd_dq<T, D>(dq, ds_t, base + S::K + c * (D == 128 ? kPanel : 64));
            wg_commit();
            bwd_rs<T, D>(dkr, da, q_t);  // dK += dS^T Q
            wg_commit();
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // dQ is done
            reg_fence(dq);
            stage_dq<D>(dq_t, dq, 16 * warp + g, t);
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // for the TMA
            // the issuing warp waits for the warpgroup's stores, the others go on (to dK)
            if (warp == 0) {
                bar_sync(kDqBar + c, 128);
                if (issuer) {
                    if (DET) {  // this block's turn at the query block's counter
                        turn_wait(counter, want, seen);
                        asm volatile("fence.proxy.async.global;\n" ::: "memory");
                    }
#pragma unroll
                    for (int p = 0; p < D / 64; ++p)  // this warpgroup's columns, 32 a box
                        tma_reduce_add_4d(tdq, dq_t + p * kDqBox, c * (D / 2) + 32 * p, hh,
                                          q0, b);
                    bulk_commit();
                }
            } else {
                bar_arrive(kDqBar + c, 128);
            }
            wg_wait0();
            reg_fence(dvr);
            reg_fence(dkr);
            warp_release(bar_e + 8 * s);  // this warp is done with Q, dO of `it`
            continue;  // (below: the other paths' dK, dQ and reductions from registers)
        }
#endif
        wg_fence();
        bwd_rs<T, D>(dkr, da, q_t);  // dK += dS^T Q
        wg_commit();
        if (DET && it > 0) turn_release(last);  // the last step's adds
        store_ds(ds_t, da, 64 * c + 16 * warp + g, t);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        bar_sync(kDsBar, 256);  // both warpgroups' dS^T written
        if (DET && seen != want) seen = ld_relaxed(counter);  // again, while dQ = dS K runs
        float dq[D / 16][4];
        bwd_dq<T, D>(dq, ds_t, base + S::K + c * (D == 128 ? kPanel : 64));
        wg_commit();
        wg_wait0();
        reg_fence(dq);
        reg_fence(dvr);
        reg_fence(dkr);
        warp_release(bar_e + 8 * s);  // this warp is done with Q, dO of `it`
        if (DET) turn_wait(counter, want, seen);
        const bool odd = t & 1;
        const int qr = q0 + 16 * warp + g + (odd ? 8 : 0);
        bwd_add_dq<D>(dq_acc + b * st.dq_b + qr * st.dq_s + hh * D + c * (D / 2) + 4 * (t >> 1),
                      dq, odd, qr < q_len);
    }
    store_dkv<T, D>(dk, dv, dkr, dvr, b * st.dk_b + kvh * D, kv_row, skv, st.dk_s);
    if (!kTmaDq && DET && w.total > 0) turn_release(counter);  // (its fence waits for dK, dV)
    if (kTmaDq && threadIdx.x % 128 == 0) {  // the TMA dQ's last reductions
        if (DET && w.total > 0) bulk_turn_release(counter);
        else bulk_wait0();
    }
}
