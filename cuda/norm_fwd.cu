// norm_fwd.cu — LayerNorm and RMSNorm forward (maths, shapes and the kernels: norm.cuh).
//
// x [rows, hidden] of T -> y [rows, hidden] of OUT (T, or FP8 codes of y * scale[0] with
// max |y| into amax: grid_amax, and 1 / scale[0] into scale_inv where it is not null:
// write_scale_inv), mu [rows] (LayerNorm) and rsigma [rows] float. Launches
// (tecupy/kernels/norm.py): norm_fwd_stream, blocks of up to 16 warps in groups of G warps
// per row, rings and gamma/beta in dynamic shared memory (Hopper, 16-byte rows of >= 4
// KB); elsewhere norm_fwd_warp, 4 rows per block of 128 threads, or for rows of more than
// 16 chunks per lane norm_fwd, a block of up to 512 threads per row. All grid-stride over
// rows.
#include "bulk.cuh"
#include "norm.cuh"

// ---- a block per row ---------------------------------------------------------------------
// Thread t owns the chunks OWNED(k, i) of every row, in registers, so x is read once; the
// next row's chunks are loaded (packed) before this row's reduction, to keep memory busy.
template <typename T, int VEC, int CHUNKS, bool RMS, typename OUT>
__global__ void __launch_bounds__(512)
norm_fwd(const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta,
         OUT* __restrict__ y, float* __restrict__ mu, float* __restrict__ rsigma,
         long long rows, int hidden, float eps, int zero_centered,
         const float* __restrict__ scale, float* __restrict__ amax,
         unsigned* __restrict__ slot, float* __restrict__ scale_inv) {
    PDL_WAIT();
    const float zc = zero_centered ? 1.f : 0.f;
    const float sc = Out<OUT>::fp8 ? scale[0] : 1.f;
    if (Out<OUT>::fp8) write_scale_inv(scale_inv, sc, blockIdx.x);
    float m = 0.f;
    Vec<T, VEC> nxt[CHUNKS];
    if (blockIdx.x < rows) load_row(nxt, x + blockIdx.x * (long long)hidden, hidden);
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const float x0 = RMS ? 0.f : shift_of<T, VEC>(load_vec<VEC>(x + row * hidden));
        float v[CHUNKS][VEC];
        float sum = 0.f, sq = 0.f;
#pragma unroll
        OWNED(k, i) if (i < hidden)  // (v: the row as floats, for y)
            add_moments<VEC>([&](int j) { return v[k][j] = to_float(nxt[k].v[j]); }, x0, sum,
                             sq);
        if (row + gridDim.x < rows) load_row(nxt, x + (row + gridDim.x) * hidden, hidden);
        const float2 s = block_sum2(sum, sq);
        const float2 st = row_stats<RMS>(s.x, s.y, x0, hidden, eps);  // (mean, rs)
#pragma unroll
        OWNED(k, i) if (i < hidden) store_y<T, VEC, RMS>(
            y + row * hidden, [&](int j) { return v[k][j]; }, gamma, beta, i, st, zc, sc, m);
        if (threadIdx.x == 0) {
            if (!RMS) mu[row] = st.x;
            rsigma[row] = st.y;
        }
    }
    if (Out<OUT>::fp8) grid_amax(m, amax, slot);
}

// ---- a warp per row ----------------------------------------------------------------------
// Four rows per block: the reductions are warp shuffles only (no block barrier), and with
// the row packed in registers many rows stay in flight per SM. Lane l owns the chunks
// c = l + 32 k, k < CHUNKS: LANE_CHUNK(k, i) runs its body for those within the row.
#define LANE_CHUNK(k, i) \
    for (int k = 0; k < CHUNKS; ++k) if (const int i = (lane + 32 * k) * VEC; i < hidden)

template <typename T, int VEC, int CHUNKS, bool RMS, typename OUT>
__global__ void __launch_bounds__(128)
norm_fwd_warp(const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta,
              OUT* __restrict__ y, float* __restrict__ mu, float* __restrict__ rsigma,
              long long rows, int hidden, float eps, int zero_centered,
              const float* __restrict__ scale, float* __restrict__ amax,
              unsigned* __restrict__ slot, float* __restrict__ scale_inv) {
    PDL_WAIT();
    const int lane = threadIdx.x & 31;
    const float zc = zero_centered ? 1.f : 0.f;
    const float sc = Out<OUT>::fp8 ? scale[0] : 1.f;
    if (Out<OUT>::fp8) write_scale_inv(scale_inv, sc, blockIdx.x);
    float m = 0.f;
    for (long long row = blockIdx.x * 4LL + (threadIdx.x >> 5); row < rows;
         row += gridDim.x * 4LL) {
        const T* xr = x + row * hidden;
        Vec<T, VEC> a[CHUNKS];
#pragma unroll
        LANE_CHUNK(k, i) a[k] = load_vec<VEC>(xr + i);
        const float x0 = RMS ? 0.f : shift_of<T, VEC>(load_vec<VEC>(xr));
        float sum = 0.f, sq = 0.f;
#pragma unroll
        LANE_CHUNK(k, i) add_moments(a[k], x0, sum, sq);
        sum = warp_sum(sum);
        sq = warp_sum(sq);
        const float2 st = row_stats<RMS>(sum, sq, x0, hidden, eps);
#pragma unroll
        LANE_CHUNK(k, i) store_y<T, VEC, RMS>(
            y + row * hidden, [&](int j) { return to_float(a[k].v[j]); }, gamma, beta, i, st,
            zc, sc, m);
        if (lane == 0) {
            if (!RMS) mu[row] = st.x;
            rsigma[row] = st.y;
        }
    }
    if (Out<OUT>::fp8) grid_amax(m, amax, slot);
}

// ---- Hopper: G warps per row, rows streamed through shared memory -------------------------
// Rows stream through per-warp WarpRings (bulk.cuh) by bulk copies, so many rows per SM are
// loading at once whatever the row length, and no row is held in registers: a warp reads its
// slot twice (the moments, then y). Warp m of a group owns the contiguous chunks [m per,
// (m + 1) per) of every row (per = ceil(chunks / G)) and streams only those; the group meets
// once per row, to merge its moments through shared memory (group_share). gamma (+1 if
// zero-centered) and beta are copied once per block into shared memory after the rings: L1
// loads of them per row stalled every warp, and converting them per row cost more
// instructions than the norm itself. P = float keeps them as float; P = T as they are (half
// the shared-memory reads per element, which ncu found saturated, for an unpack each; only
// without zero-centered gamma, as g + 1 is not a T). Each group's later rows come from
// RowTaker (bulk.cuh). The launch fixes `slots` and the dynamic shared memory (rings,
// gamma, beta, scratch, takes) and passes the row counters (null: the fixed split).

// gb [n] = gamma (+ zc where P is float), gb [n, 2n) = beta, as P; then the block's barrier
template <typename T, int VEC, bool RMS, typename P>
__device__ __forceinline__ void stage_gamma_beta(Vec<P, VEC>* gb, const T* gamma,
                                                 const T* beta, int n, float zc) {
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        const Vec<T, VEC> g = load_vec<VEC>(gamma + c * VEC);
        Vec<T, VEC> b;
        if (!RMS) b = load_vec<VEC>(beta + c * VEC);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            gb[c].v[j] = from_float<P>(to_float(g.v[j]) + (sizeof(P) == 4 ? zc : 0.f));
            if (!RMS) gb[n + c].v[j] = from_float<P>(to_float(b.v[j]));
        }
    }
    __syncthreads();
}

template <typename T, int VEC, bool RMS, typename OUT, int G, typename P>
__global__ void __launch_bounds__(512)
norm_fwd_stream(const T* __restrict__ x, const T* __restrict__ gamma,
                const T* __restrict__ beta, OUT* __restrict__ y, float* __restrict__ mu,
                float* __restrict__ rsigma, long long rows, int hidden, float eps,
                int zero_centered, const float* __restrict__ scale, float* __restrict__ amax,
                unsigned* __restrict__ slot, float* __restrict__ scale_inv,
                unsigned* __restrict__ counters, int slots) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) unsigned char smem[];
    PDL_WAIT();
    using V = Vec<T, VEC>;
    using F = Vec<P, VEC>;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int group = warp / G, n = hidden / VEC;
    const Portion part(n, G, warp % G, 1);
    const int lo = part.lo, cnt = part.cnt;
    const unsigned bytes = part.per * sizeof(V);  // slot size: the largest portion
    const long long step = gridDim.x * (long long)(warps / G);
    const long long first = blockIdx.x * (long long)(warps / G) + group;
    const float zc = zero_centered ? 1.f : 0.f;
    const float sc = Out<OUT>::fp8 ? scale[0] : 1.f;
    if (Out<OUT>::fp8) write_scale_inv(scale_inv, sc, blockIdx.x);
    WarpRing ring(smem, slots, bytes);
    const T* src = x + lo * VEC;  // this warp's portion of row 0
    if (lane == 0) {  // one slot filled; the rest once it has come (WarpRing)
        for (int i = 0; i < slots; ++i) ring.mark(i, min(first + i * step, rows));
        if (cnt > 0 && first < rows) ring.fill(smem, 0, src + first * hidden, cnt * sizeof(V));
    }
    const bool taker = warp % G == 0 && lane == 0;  // later rows: RowTaker
    RowTaker rt(counters, group, warps / G, gridDim.x, rows, slots, taker);
    F* gb = reinterpret_cast<F*>(smem + WarpRing::smem_bytes(warps, slots, bytes));
    float4* scratch = reinterpret_cast<float4*>(gb + (RMS ? n : 2 * n));  // [2][warps]
    unsigned* takes = reinterpret_cast<unsigned*>(scratch + 2 * warps);   // [2][warps]
    stage_gamma_beta<T, VEC, RMS>(gb, gamma, beta, n, zc);
    // chunks unrolled per loop: an FP8 output runs 16 warps per SM (4 KB of a row per warp),
    // so each warp needs more loads in flight (H200: +1-4 points over 4; PERFLOG.md)
    constexpr int UNROLL = Out<OUT>::fp8 ? 8 : 4;
    float m = 0.f;
    int parity = 0;
    for (long long row, it = 0; (row = ring.row()) < rows; parity ^= 1, ++it) {
        // v[c] for the chunks c of this warp's portion (a warp with none never waits)
        const V* v = reinterpret_cast<const V*>(cnt ? ring.at(smem) : smem) - lo;
        if (row == first && lane == 0 && cnt > 0)  // the other slots (WarpRing)
            for (int i = 1; i < slots && row + i * step < rows; ++i)
                ring.fill(smem, i, src + (row + i * step) * hidden, cnt * sizeof(V));
        if (it == 0 && taker) rt.start();
        if (G > 1 && taker && it > 0) takes[parity * warps + warp] = rt.p0;  // (group_share)
        const float x0 = (RMS || cnt == 0) ? 0.f : shift_of<T, VEC>(v[lo]);
        float sum = 0.f, sq = 0.f;
#pragma unroll UNROLL
        for (int c = lo + lane; c < lo + cnt; c += 32) add_moments(v[c], x0, sum, sq);
        sum = warp_sum(sum);
        sq = warp_sum(sq);
        // (row_stats and the output pass are written out here: as inlined helpers they
        // changed this kernel's SASS)
        float mean, var;
        if (G == 1) {
            const float dmean = sum / hidden;
            mean = RMS ? 0.f : x0 + dmean;
            var = RMS ? sq / hidden : fmaxf(sq / hidden - dmean * dmean, 0.f);
        } else {  // merge the warps' (count, mean, M2) (Chan et al.), or sums of squares
            const float k = (float)(cnt * VEC), wm = cnt ? sum / k : 0.f;
            const float4* p =
                group_share<G>(make_float4(k, x0 + wm, sq - sum * wm, sq), scratch, parity);
            float tm = 0.f, m2 = 0.f, ss = 0.f;
#pragma unroll
            for (int i = 0; i < G; ++i) tm += p[i].x * p[i].y, ss += p[i].w;
            tm /= hidden;
#pragma unroll
            for (int i = 0; i < G; ++i) {
                const float d = p[i].y - tm;
                m2 += p[i].z + p[i].x * d * d;
            }
            mean = RMS ? 0.f : tm;
            var = RMS ? ss / hidden : fmaxf(m2 / hidden, 0.f);
        }
        const float rs = rsqrtf(var + eps), nmr = -mean * rs;
#pragma unroll UNROLL
        for (int c = lo + lane; c < lo + cnt; c += 32) {
            const V a = v[c];
            const F g = gb[c];
            F b;
            if (!RMS) b = gb[n + c];
            float o[VEC], xf[VEC], gf[VEC], bf[VEC];
            unpack(a, xf);
            unpack(g, gf);
            if (!RMS) unpack(b, bf);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                // 16-bit x: x rs - mean rs in one FMA (its rounding sits far below x's own)
                const float xh = RMS ? xf[j] * rs
                                 : sizeof(T) == 2 ? fmaf(xf[j], rs, nmr) : (xf[j] - mean) * rs;
                o[j] = RMS ? xh * gf[j] : fmaf(xh, gf[j], bf[j]);
                if (Out<OUT>::fp8) m = fmaxf(m, fabsf(o[j]));
            }
            store_vec<VEC>(y + row * hidden + c * VEC, make_out<OUT, VEC>(o, sc));
        }
        __syncwarp();  // every lane has read the slot: refill it
        if (lane == 0) {
            const unsigned published = G > 1 ? takes[parity * warps + warp - warp % G] : 0u;
            const long long ahead = min(rt.next(row, it, taker, published), rows);
            ring.mark(ring.cur, ahead);
            if (ahead < rows && cnt > 0)
                ring.fill(smem, ring.cur, src + ahead * hidden, cnt * sizeof(V));
            if (warp % G == 0) {
                if (!RMS) mu[row] = mean;
                rsigma[row] = rs;
            }
        }
        ring.next();
        __syncwarp();  // (the mark)
    }
    rt.finish(taker);
    PDL_TRIGGER();
    if (Out<OUT>::fp8) grid_amax(m, amax, slot);
#endif
}
