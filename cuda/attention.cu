// attention.cu — fused scaled dot-product attention, forward and backward (FlashAttention-2
// scheme on mma.sync m16n8k16, bf16/fp16 in, float32 accumulate; sm_80 and newer).
//
// Layout bshd: q [b, sq, h, d], k and v [b, skv, hk, d], h % hk == 0 (query head i reads KV
// head i / (h / hk)). Each operand has its own batch and sequence strides (elements; heads
// D apart, d contiguous), so sbhd tensors and the q/k/v views of a packed projection are
// read in place: a bshd tensor has strides (s h D, h D), an sbhd one (h D, b h D).
// S = scale Q K^T; keep (i, j) iff j < kv_len and (not CAUSAL or
// j <= i) (top-left); query rows i >= q_len give o = 0, lse = +inf (q_len, kv_len =
// seqlens_q[b], seqlens_kv[b] where those pointers are not null, else sq, skv); a row with
// nothing kept gives o = 0, lse = +inf too. P = softmax(S) over the kept entries;
// lse = log sum exp S (float32 [b, h, sq]); O = (P * Z) V with Z = keep / (1 - p) drawn
// from Philox over the flat index ((b h + head) sq + i) skv + j of [b, h, sq, skv], word
// (index % 4) of philox(counter = (index / 4, 0), key = seed), as reference/dropout.py.
//
//   attention_fwd       grid (ceil(sq / 128), h, b): 128 query rows per block, warps of
//                       MW tiles of 16 rows (MW = 2: 4 warps, Q fragments re-read from
//                       shared memory, two blocks per SM; MW = 1: 8 warps, Q fragments in
//                       registers); K/V tiles of BN rows double-buffered by cp.async;
//                       online softmax in base 2 (scale log2 e folded into exp2's
//                       multiply-add, so scale > 0). Shared memory (128 + 4 BN) d * 2 bytes.
//   attention_bwd_dot   delta = rowsum(dO * O) [b, h, sq] float32; a warp per row; zeroes
//                       the turn counters of the deterministic dQ.
//   attention_bwd       grid (ceil(skv / BN), hk, b), NW warps x 16 KV rows (BN = 16 NW);
//                       dK, dV in registers over the GQA group's heads and all query
//                       blocks of 64 rows: S^T = K Q^T, dP^T = V dO^T, P = exp(S - lse),
//                       dS = P (dP Z - delta) scale, dV += (P Z)^T dO, dK += dS^T Q; dS^T
//                       goes to shared memory and dQ = dS K (warp tiles 32 x 2 D / NW) is
//                       added into dq_acc (float32, laid out as dq; red.global.add.v4.f32
//                       on sm_90, scalar atomics before). DET: the KV blocks add in turns
//                       (attention_common.cuh), the causal grid runs backwards.
//   attention_convert   dq_acc -> dq in T (same layout, elementwise).
//
// Shared tiles are [rows][width] with the 16-byte chunk c of row r stored at c ^ (r & 7),
// so ldmatrix (8 rows, one chunk column) and cp.async rows hit distinct banks.
#include "attention_common.cuh"

// ---- PTX helpers -------------------------------------------------------------------------
// 16 (or 4) bytes global -> shared; zero-filled when !pred (src is then not read)
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool pred) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(unsigned dst, const void* src, bool pred) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
                 "r"(pred ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}
__device__ __forceinline__ void ldsm4(unsigned r[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm4_t(unsigned r[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// p[0..3] += (a, b, c, d) in float32, one vector reduction on sm_90 (p 16-byte aligned)
__device__ __forceinline__ void red_add4(float* p, float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(a), "f"(b),
                 "f"(c), "f"(d) : "memory");
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
    atomicAdd(p + 2, c);
    atomicAdd(p + 3, d);
#endif
}
// ---- shared tiles ----------------------------------------------------------------------
// element offset of (r, c) in a swizzled tile of W elements per row (W >= 64)
template <int W> __device__ __forceinline__ int swz(int r, int c) {
    return r * W + ((((c >> 3) ^ (r & 7)) << 3) | (c & 7));
}

// rows row0 .. row0 + R - 1 of a [rows, W] matrix (row stride `stride`) into a tile;
// rows >= limit are zero-filled. NT threads.
template <int R, int W, int NT, typename T>
__device__ __forceinline__ void load_tile(T* tile, const T* g, long long stride, int row0,
                                          int limit) {
    constexpr int CPR = W / 8, N = R * CPR;
    static_assert(N % NT == 0, "tile chunks must split evenly over the threads");
#pragma unroll
    for (int it = 0; it < N / NT; ++it) {
        const int i = threadIdx.x + it * NT, r = i / CPR, c = (i % CPR) * 8;
        const bool ok = row0 + r < limit;
        cp_async16(smem_u32(tile + swz<W>(r, c)), ok ? g + (row0 + r) * stride + c : g, ok);
    }
}

// A fragment (16 x 16 at rows m0, cols k0) of a row-major tile
template <int W, typename T> __device__ __forceinline__ void frag_a(unsigned a[4], const T* t,
                                                                    int m0, int k0) {
    const int l = threadIdx.x & 31;
    ldsm4(a, smem_u32(t + swz<W>(m0 + (l & 7) + ((l >> 3) & 1) * 8, k0 + (l >> 4) * 8)));
}
// A fragment (16 x 16, m0, k0) of a tile stored transposed, [k][m]
template <int W, typename T> __device__ __forceinline__ void frag_a_t(unsigned a[4], const T* t,
                                                                      int m0, int k0) {
    const int l = threadIdx.x & 31;
    ldsm4_t(a, smem_u32(t + swz<W>(k0 + (l & 7) + (l >> 4) * 8, m0 + ((l >> 3) & 1) * 8)));
}
// B fragments of two n8 tiles (n0, n0 + 8) x k16 from a tile stored [n][k]
template <int W, typename T> __device__ __forceinline__ void frag_b(unsigned b[4], const T* t,
                                                                    int n0, int k0) {
    const int l = threadIdx.x & 31;
    ldsm4(b, smem_u32(t + swz<W>(n0 + (l & 7) + (l >> 4) * 8, k0 + ((l >> 3) & 1) * 8)));
}
// the same from a tile stored [k][n]
template <int W, typename T> __device__ __forceinline__ void frag_b_t(unsigned b[4], const T* t,
                                                                      int n0, int k0) {
    const int l = threadIdx.x & 31;
    ldsm4_t(b, smem_u32(t + swz<W>(k0 + (l & 7) + ((l >> 3) & 1) * 8, n0 + (l >> 4) * 8)));
}

// acc[16 x 8 NB] += A (16 x 16 KB, fragments a[KB]) B; B from a tile (stored [n][k] when
// !TRANS_B, [k][n] when TRANS_B), columns n0.., rows k0..
template <typename T, int W, int KB, int NB, bool TRANS_B>
__device__ __forceinline__ void mma_rows(float acc[][4], const unsigned a[][4], const T* tb,
                                         int n0, int k0) {
#pragma unroll
    for (int kk = 0; kk < KB; ++kk) {
#pragma unroll
        for (int nn = 0; nn < NB / 2; ++nn) {
            unsigned b[4];
            if (TRANS_B) frag_b_t<W>(b, tb, n0 + 16 * nn, k0 + 16 * kk);
            else frag_b<W>(b, tb, n0 + 16 * nn, k0 + 16 * kk);
            Mma<T>::run(acc[2 * nn], a[kk], b[0], b[1]);
            Mma<T>::run(acc[2 * nn + 1], a[kk], b[2], b[3]);
        }
    }
}

// C fragments of a 16 x 16 KB block (float) -> A fragments in T
template <typename T, int KB>
__device__ __forceinline__ void c_to_a(unsigned a[][4], const float c[][4]) {
#pragma unroll
    for (int kk = 0; kk < KB; ++kk) {
        a[kk][0] = Mma<T>::pack(c[2 * kk][0], c[2 * kk][1]);
        a[kk][1] = Mma<T>::pack(c[2 * kk][2], c[2 * kk][3]);
        a[kk][2] = Mma<T>::pack(c[2 * kk + 1][0], c[2 * kk + 1][1]);
        a[kk][3] = Mma<T>::pack(c[2 * kk + 1][2], c[2 * kk + 1][3]);
    }
}

// ---- forward -----------------------------------------------------------------------------
constexpr int kFwdBM = 128;

// s[mt] = Q K^T for the warp's MW row tiles of 16 (rows qrow + 16 mt of the Q tile): Q
// fragments from registers (qf, QREG) or from the shared tile. MW = 2 reuses each K
// fragment for two row tiles, which halves the shared-memory reads of K.
template <typename T, int D, int BN, int MW, bool QREG>
__device__ __forceinline__ void fwd_scores(float s[][BN / 8][4], const unsigned qf[][4],
                                           const T* sq, int qrow, const T* sk) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        unsigned a[MW][4];
#pragma unroll
        for (int mt = 0; mt < MW; ++mt)
            if (QREG)
#pragma unroll
                for (int x = 0; x < 4; ++x) a[mt][x] = qf[kk][x];
            else
                frag_a<D>(a[mt], sq, qrow + 16 * mt, 16 * kk);
#pragma unroll
        for (int nn = 0; nn < BN / 16; ++nn) {
            unsigned b[4];
            frag_b<D>(b, sk, 16 * nn, 16 * kk);
#pragma unroll
            for (int mt = 0; mt < MW; ++mt) {
                Mma<T>::run(s[mt][2 * nn], a[mt], b[0], b[1]);
                Mma<T>::run(s[mt][2 * nn + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// acc[mt] += P[mt] V for the warp's MW row tiles
template <typename T, int D, int BN, int MW>
__device__ __forceinline__ void fwd_pv(float acc[][D / 8][4], const float s[][BN / 8][4],
                                       const T* sv) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        unsigned a[MW][1][4];
#pragma unroll
        for (int mt = 0; mt < MW; ++mt) c_to_a<T, 1>(a[mt], s[mt] + 2 * kk);
#pragma unroll
        for (int dn = 0; dn < D / 16; ++dn) {
            unsigned b[4];
            frag_b_t<D>(b, sv, 16 * dn, 16 * kk);
#pragma unroll
            for (int mt = 0; mt < MW; ++mt) {
                Mma<T>::run(acc[mt][2 * dn], a[mt][0], b[0], b[1]);
                Mma<T>::run(acc[mt][2 * dn + 1], a[mt][0], b[2], b[3]);
            }
        }
    }
}

// MW row tiles of 16 per warp, 128 / (16 MW) warps, K/V tiles of BN rows; Q fragments in
// registers (QREG, one block per SM) or re-read from shared memory (two blocks per SM).
template <typename T, int D, int BN, int MW, bool QREG, bool CAUSAL, bool DROPOUT>
__global__ void __launch_bounds__(256 / MW, QREG ? 1 : 2)
attention_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
              T* __restrict__ o, float* __restrict__ lse, const int* __restrict__ seqlens_q,
              const int* __restrict__ seqlens_kv, int sq, int skv, int h, int hk,
              float scale_log2, float p_drop, float factor, unsigned long long seed,
              const unsigned long long* __restrict__ seed_ptr,
              long long q_b, long long q_s, long long k_b, long long k_s, long long v_b,
              long long v_s, long long o_b, long long o_s) {
    constexpr int BM = kFwdBM, NT = 256 / MW;
    extern __shared__ __align__(128) unsigned char smem[];
    T* sQ = reinterpret_cast<T*>(smem);
    T* sK = sQ + BM * D;   // [2][BN][D]
    T* sV = sK + 2 * BN * D;
    // causal: the last query blocks have the most keys; they start first
    const BlockPlace at = fwd_place<CAUSAL>();
    const int m0 = (CAUSAL ? gridDim.x - 1 - at.rank : at.rank) * BM;
    const int head = at.y, b = at.z, kvh = head / (h / hk);
    const int q_len = seqlens_q ? seqlens_q[b] : sq, kv_len = seqlens_kv ? seqlens_kv[b] : skv;
    const T* kb = k + b * k_b + kvh * D;
    const T* vb = v + b * v_b + kvh * D;
    const int n_end = CAUSAL ? min(kv_len, m0 + BM) : kv_len;
    const int n_tiles = m0 < q_len ? (n_end + BN - 1) / BN : 0;
    load_tile<BM, D, NT>(sQ, q + b * q_b + head * D, q_s, m0, sq);
    if (n_tiles > 0) {
        load_tile<BN, D, NT>(sK, kb, k_s, 0, kv_len);
        load_tile<BN, D, NT>(sV, vb, v_s, 0, kv_len);
    }
    cp_async_commit();
    const int qrow = 16 * MW * (threadIdx.x >> 5), row = m0 + qrow + ((threadIdx.x & 31) >> 2);
    const Dropout dr{philox_key(seed, seed_ptr), p_drop, factor};
    const unsigned long long index0 = ((unsigned long long)(b * h + head) * sq + row) * skv;
    float acc[MW][D / 8][4] = {}, m[MW][2], l[MW][2];
#pragma unroll
    for (int mt = 0; mt < MW; ++mt) m[mt][0] = m[mt][1] = -kInf, l[mt][0] = l[mt][1] = 0.f;
    static_assert(!QREG || MW == 1, "Q fragments stay in registers for one row tile only");
    unsigned qf[QREG ? D / 16 : 1][4];
    for (int j = 0; j < n_tiles; ++j) {
        cp_async_wait_all();
        __syncthreads();
        if (QREG && j == 0)
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) frag_a<D>(qf[kk], sQ, qrow, 16 * kk);
        if (j + 1 < n_tiles) {
            const int nb = ((j + 1) & 1) * BN * D;
            load_tile<BN, D, NT>(sK + nb, kb, k_s, (j + 1) * BN, kv_len);
            load_tile<BN, D, NT>(sV + nb, vb, v_s, (j + 1) * BN, kv_len);
        }
        cp_async_commit();
        const bool masked = (j + 1) * BN > kv_len || (CAUSAL && (j + 1) * BN - 1 > m0);
        float s[MW][BN / 8][4] = {};
        fwd_scores<T, D, BN, MW, QREG>(s, qf, sQ, qrow, sK + (j & 1) * BN * D);
#pragma unroll
        for (int mt = 0; mt < MW; ++mt) {
            float corr[2];
            fwd_softmax<BN, CAUSAL, DROPOUT>(s[mt], m[mt], l[mt], corr, row + 16 * mt, j * BN,
                                             kv_len, masked, scale_log2,
                                             index0 + 16ULL * mt * skv, skv, dr);
            rescale<D>(acc[mt], corr);
        }
        fwd_pv<T, D, BN, MW>(acc, s, sV + (j & 1) * BN * D);
    }
    cp_async_wait_all();  // nothing may be in flight at exit (n_tiles = 0)
#pragma unroll
    for (int mt = 0; mt < MW; ++mt)
        fwd_store<T, D>(o + b * o_b + head * D, lse + (long long)(b * h + head) * sq,
                        acc[mt], m[mt], l[mt], row + 16 * mt, sq, q_len, o_s);
}

// ---- backward ----------------------------------------------------------------------------
constexpr int kBwdBM = 64;

// delta[b, h, i] = sum_d dO[b, i, h, d] O[b, i, h, d]; a warp per (b, i, h) row, 8 per block.
// dq_sem (null unless deterministic): [b, h, ceil(sq / 64)] turn counters, zeroed here.
template <typename T, int D>
__global__ void attention_bwd_dot(const T* __restrict__ dout, const T* __restrict__ out,
                                  float* __restrict__ delta, int* __restrict__ dq_sem,
                                  long long rows, int sq, int h, long long do_b, long long do_s,
                                  long long o_b, long long o_s) {
    constexpr int V = D / 32;
    const long long r = blockIdx.x * 8LL + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int lane = threadIdx.x & 31;
    const long long bi = r / h;  // b * sq + i
    const long long b = bi / sq, i = bi % sq;
    const int head = r % h;
    const Vec<T, V> a = load_vec<V>(dout + b * do_b + i * do_s + head * D + lane * V);
    const Vec<T, V> c = load_vec<V>(out + b * o_b + i * o_s + head * D + lane * V);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j) s += to_float(a.v[j]) * to_float(c.v[j]);
    s = warp_sum(s);
    if (lane == 0) delta[(b * h + head) * sq + i] = s;
    if (dq_sem && lane == 0 && i % kBwdBM == 0)
        dq_sem[(b * h + head) * ((sq + kBwdBM - 1) / kBwdBM) + i / kBwdBM] = 0;
}

// Strides (elements) of the backward's operands: batch and sequence of each.
struct BwdStrides {
    long long do_b, do_s, q_b, q_s, k_b, k_s, v_b, v_s, dq_b, dq_s, dk_b, dk_s;
};

// Shared memory of the backward kernel, in elements of T (lse and delta are float).
template <int D, int NW> struct BwdSmem {
    static constexpr int BN = 16 * NW, BM = kBwdBM;
    static constexpr int K = 0, V = BN * D, Q = 2 * BN * D, DO = Q + 2 * BM * D,
                         DS = DO + 2 * BM * D, END = DS + BN * BM;
    // then float lse[2][BM], delta[2][BM]
};

// Load query block `it` of the group's heads (Q, dO rows, lse, delta) into buffer `buf`.
template <typename T, int D, int NW>
__device__ __forceinline__ void bwd_load_q(T* sm, float* sf, int buf, const T* q, const T* dout,
                                           const float* lse, const float* delta, int hh,
                                           int q0, int b, int sq, int h, int q_len,
                                           const BwdStrides& st) {
    constexpr int BM = kBwdBM, NT = 32 * NW;
    using S = BwdSmem<D, NW>;
    load_tile<BM, D, NT>(sm + S::Q + buf * BM * D, q + b * st.q_b + hh * D, st.q_s, q0, q_len);
    load_tile<BM, D, NT>(sm + S::DO + buf * BM * D, dout + b * st.do_b + hh * D, st.do_s, q0,
                         q_len);
    const int i = threadIdx.x;
    const long long row = (long long)(b * h + hh) * sq + q0 + (i & (BM - 1));
    if (i < 2 * BM) {
        const bool ok = q0 + (i & (BM - 1)) < q_len;
        const float* src = i < BM ? lse : delta;
        cp_async4(smem_u32(sf + (i / BM) * 2 * BM + buf * BM + (i & (BM - 1))),
                  ok ? src + row : src, ok);
    }
}

// One query block against this block's KV rows, for this warp's 16 KV rows (kv_row: the
// thread's first): dK, dV accumulate; dS^T (scale folded in) goes to shared memory.
template <typename T, int D, int NW, bool CAUSAL, bool DROPOUT>
__device__ __forceinline__ void bwd_block(float dk[][4], float dv[][4], T* sm, T* sds,
                                          const float* sf, int buf, int kv_row, int q0,
                                          int q_len, int kv_len,
                                          bool masked, float scale, unsigned long long index0,
                                          int skv, const Dropout& dr) {
    constexpr int BM = kBwdBM;
    using S = BwdSmem<D, NW>;
    const int warp = threadIdx.x >> 5, t = threadIdx.x & 3, g = (threadIdx.x & 31) >> 2;
    const T* cq = sm + S::Q + buf * BM * D;
    const T* cdo = sm + S::DO + buf * BM * D;
    const float *L = sf + buf * BM, *Dl = sf + 2 * BM + buf * BM;
    float s[BM / 8][4] = {}, dp[BM / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        unsigned a[1][4];
        frag_a<D>(a[0], sm + S::K, 16 * warp, 16 * kk);
        mma_rows<T, D, 1, BM / 8, false>(s, a, cq, 0, 16 * kk);
        frag_a<D>(a[0], sm + S::V, 16 * warp, 16 * kk);
        mma_rows<T, D, 1, BM / 8, false>(dp, a, cdo, 0, 16 * kk);
    }
    const float scale_log2 = scale * kLog2e;
#pragma unroll
    for (int nt = 0; nt < BM / 8; ++nt) {
        // the two columns' lse and delta in one 8-byte load each
        const float2 lp = *reinterpret_cast<const float2*>(L + 8 * nt + 2 * t);
        const float2 dlp = *reinterpret_cast<const float2*>(Dl + 8 * nt + 2 * t);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int c = 8 * nt + 2 * t + e, qc = q0 + c;
            const float lse2 = (e ? lp.y : lp.x) * kLog2e, dl = e ? dlp.y : dlp.x;
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int r = kv_row + 8 * i;
                float x = fast_exp2(fmaf(s[nt][2 * i + e], scale_log2, -lse2));
                if (masked && (r >= kv_len || qc >= q_len || (CAUSAL && r > qc))) x = 0.f;
                float dpe = dp[nt][2 * i + e], z = 1.f;
                if (DROPOUT) {
                    z = dropout_keep(index0 + (unsigned long long)qc * skv + r, dr.key, dr.p)
                            ? dr.factor : 0.f;
                    dpe *= z;
                }
                dp[nt][2 * i + e] = x * (dpe - dl) * scale;
                s[nt][2 * i + e] = x * z;
            }
        }
    }
    unsigned pa[BM / 16][4];
    c_to_a<T, BM / 16>(pa, s);
    mma_rows<T, D, BM / 16, D / 8, true>(dv, pa, cdo, 0, 0);
    c_to_a<T, BM / 16>(pa, dp);
    mma_rows<T, D, BM / 16, D / 8, true>(dk, pa, cq, 0, 0);
    // dS^T [BN][BM] into sds
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
        for (int x = 0; x < 4; ++x)
            *reinterpret_cast<unsigned*>(sds + swz<BM>(16 * warp + g + 8 * (x & 1),
                                                       16 * kk + 8 * (x >> 1) + 2 * t)) = pa[kk][x];
}

// dQ[q0.., :] += dS K from shared memory; float32 vector reductions into dq (pointing at
// [b, 0, head, 0], row stride dq_s). Warp tiles: MT row tiles of 16 (query rows
// 16 MT (w % (4 / MT))) by D / (NW MT / 4) columns (MT = 2: fewer shared-memory reads).
// DET: the reductions wait for the turn (counter == want; seen: its value read at the step's
// start, read again before the product if it was not the turn yet).
template <typename T, int D, int NW, int MT, bool DET>
__device__ __forceinline__ void bwd_dq(float* dq, const T* sm, const T* sds, int q0, int q_len,
                                       long long dq_s, const int* counter, int want,
                                       int seen) {
    constexpr int BM = kBwdBM, BN = 16 * NW, WQ = 4 / MT, DQC = D / (NW / WQ);
    using S = BwdSmem<D, NW>;
    const int warp = threadIdx.x >> 5, t = threadIdx.x & 3, g = (threadIdx.x & 31) >> 2;
    const int qw = 16 * MT * (warp % WQ), c0 = (warp / WQ) * DQC;
    if (DET && seen != want) seen = ld_relaxed(counter);
    float acc[MT][DQC / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        unsigned a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) frag_a_t<BM>(a[mt], sds, qw + 16 * mt, 16 * kk);
#pragma unroll
        for (int nn = 0; nn < DQC / 16; ++nn) {
            unsigned b[4];
            frag_b_t<D>(b, sm + S::K, c0 + 16 * nn, 16 * kk);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                Mma<T>::run(acc[mt][2 * nn], a[mt], b[0], b[1]);
                Mma<T>::run(acc[mt][2 * nn + 1], a[mt], b[2], b[3]);
            }
        }
    }
    if (DET) turn_wait(counter, want, seen);
    // lanes t, t ^ 1 swap halves so that each adds 4 consecutive floats of one row:
    // even t row g, odd t row g + 8, columns 2 (t & ~1) .. + 3
    const bool odd = t & 1;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int r = q0 + qw + 16 * mt + g + (odd ? 8 : 0);
        float* dst = dq + r * dq_s + c0 + 2 * (t & ~1);
#pragma unroll
        for (int nt = 0; nt < DQC / 8; ++nt) {
            const float* c = acc[mt][nt];
            const float y0 = __shfl_xor_sync(0xffffffffu, odd ? c[0] : c[2], 1);
            const float y1 = __shfl_xor_sync(0xffffffffu, odd ? c[1] : c[3], 1);
            if (r < q_len) {
                if (odd) red_add4(dst + 8 * nt, y0, y1, c[2], c[3]);
                else red_add4(dst + 8 * nt, c[0], c[1], y0, y1);
            }
        }
    }
}

// DET: dQ added in turns (dq_sem: [b, h, ceil(sq / 64)] counters; attention_common.cuh);
// each warp counts itself in after the next step's bwd_block (its reductions have landed by
// then, so the fence is cheap).
template <typename T, int D, int NW, bool CAUSAL, bool DROPOUT, bool DET>
__global__ void __launch_bounds__(32 * NW)
attention_bwd(const T* __restrict__ dout, const T* __restrict__ q, const T* __restrict__ k,
              const T* __restrict__ v, const float* __restrict__ lse,
              const float* __restrict__ delta, float* __restrict__ dq_acc,
              int* __restrict__ dq_sem, T* __restrict__ dk,
              T* __restrict__ dv, const int* __restrict__ seqlens_q,
              const int* __restrict__ seqlens_kv, int sq, int skv, int h, int hk, float scale,
              float p_drop, float factor, unsigned long long seed,
              const unsigned long long* __restrict__ seed_ptr, const BwdStrides st) {
    constexpr int BM = kBwdBM, BN = 16 * NW, NT = 32 * NW;
    using S = BwdSmem<D, NW>;
    extern __shared__ __align__(128) unsigned char smem[];
    T* sm = reinterpret_cast<T*>(smem);
    float* sf = reinterpret_cast<float*>(sm + S::END);
    const BlockPlace at = bwd_place<CAUSAL, DET>();  // (DET: see there)
    const int nb = at.rank;
    const int n0 = nb * BN, kvh = at.y, b = at.z, group = h / hk;
    // lengths past the sequence (not checked on the GPU) are clamped: no row out of bounds,
    // no turn (DET) that no block takes
    const int q_len = min(seqlens_q ? seqlens_q[b] : sq, sq);
    const int kv_len = min(seqlens_kv ? seqlens_kv[b] : skv, skv);
    const int qb0 = CAUSAL ? n0 / BM : 0, qb1 = (q_len + BM - 1) / BM;
    const int nqb = n0 < kv_len ? max(qb1 - qb0, 0) : 0, total = group * nqb;
    load_tile<BN, D, NT>(sm + S::K, k + b * st.k_b + kvh * D, st.k_s, n0, kv_len);
    load_tile<BN, D, NT>(sm + S::V, v + b * st.v_b + kvh * D, st.v_s, n0, kv_len);
    if (total > 0)
        bwd_load_q<T, D, NW>(sm, sf, 0, q, dout, lse, delta, kvh * group, qb0 * BM, b, sq, h,
                             q_len, st);
    cp_async_commit();
    const int kv_row = n0 + 16 * (threadIdx.x >> 5) + ((threadIdx.x & 31) >> 2);
    const Dropout dr{philox_key(seed, seed_ptr), p_drop, factor};
    float dkr[D / 8][4] = {}, dvr[D / 8][4] = {};
    float* dqb = dq_acc + b * st.dq_b;
    int *counter = nullptr, *last = nullptr, want = 0, seen = 0;  // DET: turn, last step's
    for (int it = 0; it < total; ++it) {
        const int hh = kvh * group + it / nqb, qb = qb0 + it % nqb, q0 = qb * BM;
        if (DET) {  // read the turn's counter now: by the adds its latency is long past
            last = counter;
            counter = dq_sem + (long long)(b * h + hh) * ((sq + BM - 1) / BM) + qb;
            want = NW * dq_turn<BM, BN, CAUSAL>(nb, qb, kv_len);  // NW warps count in a turn
            seen = ld_relaxed(counter);
        }
        cp_async_wait_all();
        __syncthreads();
        if (it + 1 < total)
            bwd_load_q<T, D, NW>(sm, sf, (it + 1) & 1, q, dout, lse, delta,
                                 kvh * group + (it + 1) / nqb, (qb0 + (it + 1) % nqb) * BM, b,
                                 sq, h, q_len, st);
        cp_async_commit();
        const bool masked = q0 + BM > q_len || n0 + BN > kv_len || (CAUSAL && n0 + BN - 1 > q0);
        bwd_block<T, D, NW, CAUSAL, DROPOUT>(dkr, dvr, sm, sm + S::DS, sf, it & 1, kv_row, q0,
                                             q_len, kv_len, masked, scale,
                                             (unsigned long long)(b * h + hh) * sq * skv, skv,
                                             dr);
        if (DET && it > 0) turn_release(last);  // the last step's adds
        __syncthreads();
        bwd_dq<T, D, NW, 2, DET>(dqb + hh * D, sm, sm + S::DS, q0, q_len, st.dq_s, counter,
                                 want, seen);
    }
    cp_async_wait_all();  // nothing may be in flight at exit (total = 0)
    store_dkv<T, D>(dk, dv, dkr, dvr, b * st.dk_b + kvh * D, kv_row, skv, st.dk_s);
    if (DET && total > 0) turn_release(counter);  // (its fence waits for dK, dV too)
}

// dq = dq_acc in T, 4 elements per thread step (n % 4 == 0): dq_acc is rows of `width`
// values, contiguous; dq's rows are `stride` apart (a slice of a packed qkv gradient).
template <typename T>
__global__ void attention_convert(const float* __restrict__ x, T* __restrict__ y, long long n,
                                  long long width, long long stride) {
    for (long long i = 4 * (blockIdx.x * (long long)blockDim.x + threadIdx.x); i < n;
         i += 4LL * gridDim.x * blockDim.x) {
        const float4 a = *reinterpret_cast<const float4*>(x + i);
        Vec<T, 4> out;
        out.v[0] = from_float<T>(a.x);
        out.v[1] = from_float<T>(a.y);
        out.v[2] = from_float<T>(a.z);
        out.v[3] = from_float<T>(a.w);
        store_vec<4>(y + (i / width) * stride + i % width, out);
    }
}
