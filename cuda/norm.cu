// norm.cu — LayerNorm and RMSNorm over the last axis, forward and backward.
//
// Forward, per row of x [rows, hidden] (RMS = false / true):
//   LayerNorm: mu = mean(x), rs = rsqrt(mean((x - mu)^2) + eps), y = (x - mu) rs g + beta
//   RMSNorm:   rs = rsqrt(mean(x^2) + eps),                      y = x rs g
//   g = gamma (+1 with zero_centered_gamma). mu, rsigma [rows] float are saved. With an FP8
//   OUT type, y is written as FP8 codes of y * scale and amax[0] gets max |y| (the input of
//   the next FP8 GEMM, cast in the same pass).
// Backward, per row: xhat = (x - mu) rs, dxhat = dy g,
//   dx = rs (dxhat - mean(dxhat) - xhat mean(dxhat xhat))   (no mean(dxhat) term for RMS)
//   dgamma = sum_rows dy xhat, dbeta = sum_rows dy.
// Launch: a grid-stride over rows, a few blocks per SM. Thread t owns the VEC-wide chunks
// c = t + k blockDim (k < CHUNKS) of every row, in registers, so inputs are read once; the
// next row's chunks are loaded (packed) before this row's reductions, to keep memory busy.
// The backward sums dgamma/dbeta of its rows in registers and writes one partial row per
// block [2 hidden]; norm_bwd_reduce adds the partials up. norm_bwd_ring (the default
// backward for 16-byte rows) streams the next rows through shared memory instead, and its
// partials go through norm_bwd_reduce_vec. Forward kernels: norm_fwd (a block per row, long
// rows), norm_fwd_warp (a warp per row, rows of up to 16 chunks per lane) and, on Hopper for
// rows of 4 KB and more, norm_fwd_stream (G warps per row, rows streamed by bulk copies).
#include "bulk.cuh"
#include "common.cuh"

#define OWNED(k, i) \
    for (int k = 0, i = threadIdx.x * VEC; k < CHUNKS; ++k, i += blockDim.x * VEC)

template <typename T, int VEC, int CHUNKS>
__device__ __forceinline__ void load_row(Vec<T, VEC> (&r)[CHUNKS], const T* p, int hidden) {
#pragma unroll
    OWNED(k, i) if (i < hidden) r[k] = load_vec<VEC>(p + i);
}

// The shift of the one-pass moments: the mean of a row's first chunk (VEC elements). Any
// value near the row's mean keeps E[d^2] - E[d]^2 free of cancellation; one element alone
// may sit 4 sigma out, and then the variance lost 4 bits (float32 rows failed the test).
template <typename T, int VEC> __device__ __forceinline__ float shift_of(const Vec<T, VEC> a) {
    float f[VEC], s = 0.f;  // a by value: one 16-byte (shared) load, not VEC 2-byte ones
    unpack(a, f);
#pragma unroll
    for (int j = 0; j < VEC; ++j) s += f[j];
    return s * (1.f / VEC);
}

// sum += sum of (a - x0), sq += sum of (a - x0)^2 over one chunk, the chunk summed first so
// a thread's running sums stay short (a long sequential float sum lost digits at 3000 wide).
template <typename T, int VEC>
__device__ __forceinline__ void add_moments(const Vec<T, VEC> a, float x0, float& sum,
                                            float& sq) {  // a by value: one 16-byte load
    float f[VEC], cs = 0.f, cq = 0.f;
    unpack(a, f);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        const float d = f[j] - x0;
        cs += d;
        cq += d * d;
    }
    sum += cs;
    sq += cq;
}

// ---- forward ---------------------------------------------------------------------------
template <typename T, int VEC, int CHUNKS, bool RMS, typename OUT>
__global__ void __launch_bounds__(512)
norm_fwd(const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta,
         OUT* __restrict__ y, float* __restrict__ mu, float* __restrict__ rsigma,
         long long rows, int hidden, float eps, int zero_centered,
         const float* __restrict__ scale, float* __restrict__ amax,
         unsigned* __restrict__ slot) {
    PDL_WAIT();
    const float zc = zero_centered ? 1.f : 0.f;
    const float sc = Out<OUT>::fp8 ? scale[0] : 1.f;
    float m = 0.f;
    Vec<T, VEC> nxt[CHUNKS];
    if (blockIdx.x < rows) load_row(nxt, x + blockIdx.x * (long long)hidden, hidden);
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        // One reduction for both moments, on data shifted (shift_of).
        const float x0 = RMS ? 0.f : shift_of<T, VEC>(load_vec<VEC>(x + row * hidden));
        float v[CHUNKS][VEC];
        float sum = 0.f, sq = 0.f;
#pragma unroll
        OWNED(k, i) if (i < hidden) {
            float cs = 0.f, cq = 0.f;  // per chunk first: a thread's running sums stay short
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                v[k][j] = to_float(nxt[k].v[j]);
                const float d = v[k][j] - x0;
                cs += d;
                cq += d * d;
            }
            sum += cs;
            sq += cq;
        }
        if (row + gridDim.x < rows) load_row(nxt, x + (row + gridDim.x) * hidden, hidden);
        const float2 s = block_sum2(sum, sq);
        const float dmean = s.x / hidden, mean = RMS ? 0.f : x0 + dmean;
        const float var = RMS ? s.y / hidden : fmaxf(s.y / hidden - dmean * dmean, 0.f);
        const float rs = rsqrtf(var + eps);
#pragma unroll
        OWNED(k, i) if (i < hidden) {
            const Vec<T, VEC> g = load_vec<VEC>(gamma + i);
            Vec<T, VEC> b;
            float o[VEC];
            if (!RMS) b = load_vec<VEC>(beta + i);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                o[j] = (v[k][j] - mean) * rs * (to_float(g.v[j]) + zc);
                if (!RMS) o[j] += to_float(b.v[j]);
                if (Out<OUT>::fp8) m = fmaxf(m, fabsf(o[j]));
            }
            store_vec<VEC>(y + row * hidden + i, make_out<OUT, VEC>(o, sc));
        }
        if (threadIdx.x == 0) {
            if (!RMS) mu[row] = mean;
            rsigma[row] = rs;
        }
    }
    if (Out<OUT>::fp8) grid_amax(m, amax, slot);
}

// One warp per row, four rows per block: the reductions are warp shuffles only (no block
// barrier), and with the row packed in registers many rows stay in flight per SM.
// Lane l owns chunks c = l + 32 k, k < CHUNKS.
template <typename T, int VEC, int CHUNKS, bool RMS, typename OUT>
__global__ void __launch_bounds__(128)
norm_fwd_warp(const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta,
              OUT* __restrict__ y, float* __restrict__ mu, float* __restrict__ rsigma,
              long long rows, int hidden, float eps, int zero_centered,
              const float* __restrict__ scale, float* __restrict__ amax,
              unsigned* __restrict__ slot) {
    PDL_WAIT();
    const int lane = threadIdx.x & 31;
    const float zc = zero_centered ? 1.f : 0.f;
    const float sc = Out<OUT>::fp8 ? scale[0] : 1.f;
    float m = 0.f;
    for (long long row = blockIdx.x * 4LL + (threadIdx.x >> 5); row < rows;
         row += gridDim.x * 4LL) {
        const T* xr = x + row * hidden;
        Vec<T, VEC> a[CHUNKS];
#pragma unroll
        for (int k = 0; k < CHUNKS; ++k) {
            const int i = (lane + 32 * k) * VEC;
            if (i < hidden) a[k] = load_vec<VEC>(xr + i);
        }
        const float x0 = RMS ? 0.f : shift_of<T, VEC>(load_vec<VEC>(xr));
        float sum = 0.f, sq = 0.f;
#pragma unroll
        for (int k = 0; k < CHUNKS; ++k)
            if ((lane + 32 * k) * VEC < hidden) add_moments(a[k], x0, sum, sq);
        sum = warp_sum(sum);
        sq = warp_sum(sq);
        const float dmean = sum / hidden, mean = RMS ? 0.f : x0 + dmean;
        const float var = RMS ? sq / hidden : fmaxf(sq / hidden - dmean * dmean, 0.f);
        const float rs = rsqrtf(var + eps);
#pragma unroll
        for (int k = 0; k < CHUNKS; ++k) {
            const int i = (lane + 32 * k) * VEC;
            if (i < hidden) {
                const Vec<T, VEC> g = load_vec<VEC>(gamma + i);
                Vec<T, VEC> b;
                float o[VEC];
                if (!RMS) b = load_vec<VEC>(beta + i);
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    o[j] = (to_float(a[k].v[j]) - mean) * rs * (to_float(g.v[j]) + zc);
                    if (!RMS) o[j] += to_float(b.v[j]);
                    if (Out<OUT>::fp8) m = fmaxf(m, fabsf(o[j]));
                }
                store_vec<VEC>(y + row * hidden + i, make_out<OUT, VEC>(o, sc));
            }
        }
        if (lane == 0) {
            if (!RMS) mu[row] = mean;
            rsigma[row] = rs;
        }
    }
    if (Out<OUT>::fp8) grid_amax(m, amax, slot);
}

// Hopper: G warps per row (a "group"), rows streamed through per-warp WarpRings by bulk
// copies (rows of 16-byte multiples), so many rows per SM are loading at once whatever the
// row length, and no row is held in registers: a warp reads its slot twice (the moments,
// then y). Warp m of a group owns the contiguous chunks [m per, (m + 1) per) of every row
// (per = ceil(chunks / G)) and streams only those; the group meets once per row, to merge
// its moments through shared memory (named barrier 1 + group). gamma + (1 if zero-centered)
// and beta are copied once per block, as float, into shared memory after the rings: L1
// loads of them per row stalled every warp, and converting them per row cost more
// instructions than the norm itself (P = float; P = T keeps them as they are: half the
// shared-memory reads per element, which ncu found saturated, for an unpack each; only
// without zero-centered gamma, as g + 1 is not a T). Each group's later rows come from
// RowTaker (bulk.cuh). The launch fixes `slots` and the dynamic shared memory (rings,
// gamma, beta, scratch, takes) and passes the row counters (null: the fixed split).
template <typename T, int VEC, bool RMS, typename OUT, int G, typename P>
__global__ void __launch_bounds__(512)
norm_fwd_stream(const T* __restrict__ x, const T* __restrict__ gamma,
                const T* __restrict__ beta, OUT* __restrict__ y, float* __restrict__ mu,
                float* __restrict__ rsigma, long long rows, int hidden, float eps,
                int zero_centered, const float* __restrict__ scale, float* __restrict__ amax,
                unsigned* __restrict__ slot, unsigned* __restrict__ counters, int slots) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) unsigned char smem[];
    PDL_WAIT();
    using V = Vec<T, VEC>;
    using F = Vec<P, VEC>;  // P = float: gamma + zc as float; P = T: as they are
    // chunks unrolled per loop: an FP8 output runs 16 warps per SM (4 KB of a row per warp),
    // so each warp needs more loads in flight (H200: +1-4 points over 4; PERFLOG.md)
    constexpr int UNROLL = Out<OUT>::fp8 ? 8 : 4;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int group = warp / G, n = hidden / VEC;
    const Portion part(n, G, warp % G, 1);
    const int lo = part.lo, cnt = part.cnt;
    const unsigned bytes = part.per * sizeof(V);  // slot size: the largest portion
    const long long step = gridDim.x * (long long)(warps / G);
    const long long first = blockIdx.x * (long long)(warps / G) + group;
    const float zc = zero_centered ? 1.f : 0.f;
    const float sc = Out<OUT>::fp8 ? scale[0] : 1.f;
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
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        const V g = load_vec<VEC>(gamma + c * VEC);
        V b;
        if (!RMS) b = load_vec<VEC>(beta + c * VEC);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            gb[c].v[j] = from_float<P>(to_float(g.v[j]) + (sizeof(P) == 4 ? zc : 0.f));
            if (!RMS) gb[n + c].v[j] = from_float<P>(to_float(b.v[j]));
        }
    }
    __syncthreads();
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
        // this warp's moments, shifted by its portion's first chunk (shift_of)
        const float x0 = (RMS || cnt == 0) ? 0.f : shift_of<T, VEC>(v[lo]);
        float sum = 0.f, sq = 0.f;
#pragma unroll UNROLL
        for (int c = lo + lane; c < lo + cnt; c += 32) add_moments(v[c], x0, sum, sq);
        sum = warp_sum(sum);
        sq = warp_sum(sq);
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

// ---- backward --------------------------------------------------------------------------
// Each iteration takes ROWS rows at once (rows r, r + 1, ...): their loads are in flight
// together and one barrier pair reduces all their sums. Registers hold the dgamma/dbeta
// sums and the packed x, dy; xhat and dxhat are recomputed in the second pass and gamma
// re-read (an L1 hit), which keeps the kernel free of spills at CHUNKS * VEC = 16.
#define SLOT(i, j) ((j) * (hidden / VEC) + (i) / VEC)

template <typename T, int VEC, int CHUNKS, bool RMS, bool ACC_SMEM, int ROWS>
__global__ void __launch_bounds__(512)
norm_bwd(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mu,
         const float* __restrict__ rsigma, const T* __restrict__ gamma, T* __restrict__ dx,
         float* __restrict__ part, long long rows, int hidden, int zero_centered) {
    PDL_WAIT();
    static_assert(ROWS == 1 || ROWS == 2, "one reduction takes the sums of at most 2 rows");
    // dgamma/dbeta sums of this block's rows: registers, or (ACC_SMEM) shared memory
    // [2 hidden], which frees registers for more resident rows. Each thread owns its columns;
    // in shared memory column i + j sits at j * (hidden / VEC) + i / VEC, so the lanes of a
    // warp touch consecutive words (no bank conflicts).
    extern __shared__ float acc[];
    float dg[ACC_SMEM ? 1 : CHUNKS][VEC], db[ACC_SMEM ? 1 : CHUNKS][VEC];
    const float zc = zero_centered ? 1.f : 0.f;
#pragma unroll
    OWNED(k, i)
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            if (ACC_SMEM && i < hidden) acc[SLOT(i, j)] = acc[hidden + SLOT(i, j)] = 0.f;
            if (!ACC_SMEM) dg[k][j] = db[k][j] = 0.f;
        }
    for (long long row0 = blockIdx.x * (long long)ROWS; row0 < rows;
         row0 += (long long)gridDim.x * ROWS) {
        Vec<T, VEC> cx[ROWS][CHUNKS], cd[ROWS][CHUNKS];
        float m[ROWS], rs[ROWS], s1[ROWS], s2[ROWS];  // s1 = sum dxhat, s2 = sum dxhat xhat
#pragma unroll
        for (int q = 0; q < ROWS; ++q) {
            const bool ok = row0 + q < rows;
            m[q] = (RMS || !ok) ? 0.f : mu[row0 + q];
            rs[q] = ok ? rsigma[row0 + q] : 0.f;
            s1[q] = s2[q] = 0.f;
            if (ok) {
                load_row(cx[q], x + (row0 + q) * hidden, hidden);
                load_row(cd[q], dy + (row0 + q) * hidden, hidden);
            }
        }
#pragma unroll
        OWNED(k, i) if (i < hidden) {
            const Vec<T, VEC> gv = load_vec<VEC>(gamma + i);
#pragma unroll
            for (int q = 0; q < ROWS; ++q) {
                if (row0 + q >= rows) continue;
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const float dyf = to_float(cd[q][k].v[j]);
                    const float xh = (to_float(cx[q][k].v[j]) - m[q]) * rs[q];
                    const float dxh = dyf * (to_float(gv.v[j]) + zc);
                    s1[q] += dxh;
                    s2[q] += dxh * xh;
                    if (ACC_SMEM) {
                        acc[SLOT(i, j)] += dyf * xh;
                        acc[hidden + SLOT(i, j)] += dyf;
                    } else {
                        dg[k][j] += dyf * xh;
                        db[k][j] += dyf;
                    }
                }
            }
        }
        float mean1[ROWS], mean2[ROWS];
        if (ROWS == 1) {
            const float2 s = block_sum2(s1[0], s2[0]);
            mean1[0] = s.x / hidden;
            mean2[0] = s.y / hidden;
        } else {
            const float4 s = block_sum4(s1[0], s2[0], s1[ROWS - 1], s2[ROWS - 1]);
            mean1[0] = s.x / hidden;
            mean2[0] = s.y / hidden;
            mean1[ROWS - 1] = s.z / hidden;
            mean2[ROWS - 1] = s.w / hidden;
        }
#pragma unroll
        OWNED(k, i) if (i < hidden) {
            const Vec<T, VEC> gv = load_vec<VEC>(gamma + i);
#pragma unroll
            for (int q = 0; q < ROWS; ++q) {
                if (row0 + q >= rows) continue;
                Vec<T, VEC> out;
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const float xh = (to_float(cx[q][k].v[j]) - m[q]) * rs[q];
                    const float dxh = to_float(cd[q][k].v[j]) * (to_float(gv.v[j]) + zc);
                    out.v[j] = from_float<T>(rs[q] * (dxh - (RMS ? 0.f : mean1[q])
                                                      - xh * mean2[q]));
                }
                store_vec<VEC>(dx + (row0 + q) * hidden + i, out);
            }
        }
    }
    float* p = part + (long long)blockIdx.x * 2 * hidden;
#pragma unroll
    OWNED(k, i) if (i < hidden)
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            p[i + j] = ACC_SMEM ? acc[SLOT(i, j)] : dg[k][j];
            p[hidden + i + j] = ACC_SMEM ? acc[hidden + SLOT(i, j)] : db[k][j];
        }
}

// dgamma[c] = sum_b part[b, c], dbeta[c] = sum_b part[b, hidden + c]. Launch: blocks of
// (32, 8) threads, one block per 32 of the 2 hidden columns; the 8 rows of threads split the
// partials and meet in shared memory (one thread per column alone would leave most SMs idle).
template <typename T>
__global__ void norm_bwd_reduce(const float* __restrict__ part, int nparts, int hidden,
                                T* __restrict__ dgamma, T* __restrict__ dbeta, int has_beta) {
    PDL_WAIT();
    __shared__ float acc[8][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    float a = 0.f;
    if (c < 2 * hidden)
        for (int k = threadIdx.y; k < nparts; k += 8) a += part[(long long)k * 2 * hidden + c];
    acc[threadIdx.y][threadIdx.x] = a;
    __syncthreads();
    if (threadIdx.y == 0 && c < 2 * hidden) {
        float t = 0.f;
#pragma unroll
        for (int y = 0; y < 8; ++y) t += acc[y][threadIdx.x];
        if (c < hidden) dgamma[c] = from_float<T>(t);
        else if (has_beta) dbeta[c - hidden] = from_float<T>(t);
    }
}

// ---- backward with rows streamed through a shared-memory ring (issue 3) ---------------
// norm_bwd keeps at most one or two rows per block in flight, so an SM waits on load
// latency between rows. Here each thread copies its own chunks of the next STAGES - 1 rows
// into shared memory with cp.async (16-byte copies, sm_80+) while it works on the current
// row from registers: bytes in flight no longer cost registers. A thread reads back only
// the slots it filled itself, so the ring needs no barrier: cp.async.wait_group makes a
// thread's own finished copies visible to it. Slot (stage, tensor, k) of thread t is
// ring[((stage NT + tensor) CHUNKS + k) blockDim + t]: a warp reads 512 consecutive bytes.
// Needs VEC * sizeof(T) == 16.

// Start copying this thread's chunks of row `row` of src into its slots at `slot`.
template <typename T, int VEC, int CHUNKS>
__device__ __forceinline__ void ring_issue(Vec<T, VEC>* slot, const T* src, long long row,
                                           long long rows, int hidden) {
    if (row >= rows) return;
#pragma unroll
    OWNED(k, i) if (i < hidden)
        cp_async_16b(slot + k * blockDim.x + threadIdx.x, src + row * hidden + i);
}

template <typename T, int VEC, int CHUNKS>
__device__ __forceinline__ void ring_read(Vec<T, VEC> (&r)[CHUNKS], const Vec<T, VEC>* slot,
                                          int hidden) {
#pragma unroll
    OWNED(k, i) if (i < hidden) r[k] = slot[k * blockDim.x + threadIdx.x];
}

// Backward, one block per row, grid-stride; the maths of norm_bwd (ROWS = 1), with x and dy
// streamed through the ring (NT = 2 tensors per stage). Dynamic shared memory:
// STAGES * 2 * CHUNKS * blockDim * 16 bytes. The partial row goes out in 16-byte stores.
template <typename T, int VEC, int CHUNKS, bool RMS, int STAGES>
__global__ void __launch_bounds__(512)
norm_bwd_ring(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mu,
              const float* __restrict__ rsigma, const T* __restrict__ gamma,
              T* __restrict__ dx, float* __restrict__ part, long long rows, int hidden,
              int zero_centered) {
    PDL_WAIT();
    extern __shared__ __align__(16) unsigned char ring_bytes[];
    Vec<T, VEC>* ring = reinterpret_cast<Vec<T, VEC>*>(ring_bytes);
    const int tensor_size = CHUNKS * blockDim.x;
    const float zc = zero_centered ? 1.f : 0.f;
    const long long step = gridDim.x;
    // dgamma/dbeta sums, and gamma (+1) of this thread's columns as float: read once, not
    // loaded and converted per row
    float dg[CHUNKS][VEC], db[CHUNKS][VEC], gz[CHUNKS][VEC];
#pragma unroll
    OWNED(k, i) {
        Vec<T, VEC> gv;
        if (i < hidden) gv = load_vec<VEC>(gamma + i);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            dg[k][j] = db[k][j] = 0.f;
            gz[k][j] = i < hidden ? to_float(gv.v[j]) + zc : 0.f;
        }
    }
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        const long long r = blockIdx.x + s * step;
        ring_issue<T, VEC, CHUNKS>(ring + (2 * s) * tensor_size, x, r, rows, hidden);
        ring_issue<T, VEC, CHUNKS>(ring + (2 * s + 1) * tensor_size, dy, r, rows, hidden);
        cp_async_commit_group();
    }
    int stage = 0;
    // mu and rsigma one row ahead: loaded where the row is needed, their DRAM latency
    // stalled every row
    float m_next = 0.f, rs_next = 0.f;
    if (blockIdx.x < rows) {
        m_next = RMS ? 0.f : mu[blockIdx.x];
        rs_next = rsigma[blockIdx.x];
    }
    for (long long row = blockIdx.x; row < rows; row += step) {
        const int refill = stage == 0 ? STAGES - 1 : stage - 1;  // read last iteration
        const long long ahead = row + (STAGES - 1) * step;
        ring_issue<T, VEC, CHUNKS>(ring + (2 * refill) * tensor_size, x, ahead, rows, hidden);
        ring_issue<T, VEC, CHUNKS>(ring + (2 * refill + 1) * tensor_size, dy, ahead, rows,
                                   hidden);
        cp_async_commit_group();
        const float m = m_next, rs = rs_next;
        if (row + step < rows) {
            m_next = RMS ? 0.f : mu[row + step];
            rs_next = rsigma[row + step];
        }
        cp_async_wait_group<STAGES - 1>();
        Vec<T, VEC> cx[CHUNKS], cd[CHUNKS];
        ring_read(cx, ring + (2 * stage) * tensor_size, hidden);
        ring_read(cd, ring + (2 * stage + 1) * tensor_size, hidden);
        stage = stage == STAGES - 1 ? 0 : stage + 1;
        float s1 = 0.f, s2 = 0.f;  // sum dxhat, sum dxhat xhat
#pragma unroll
        OWNED(k, i) if (i < hidden) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const float dyf = to_float(cd[k].v[j]);
                const float xh = (to_float(cx[k].v[j]) - m) * rs;
                const float dxh = dyf * gz[k][j];
                s1 += dxh;
                s2 += dxh * xh;
                dg[k][j] += dyf * xh;
                db[k][j] += dyf;
            }
        }
        const float2 s = block_sum2(s1, s2);
        const float mean1 = RMS ? 0.f : s.x / hidden, mean2 = s.y / hidden;
#pragma unroll
        OWNED(k, i) if (i < hidden) {
            Vec<T, VEC> out;
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const float xh = (to_float(cx[k].v[j]) - m) * rs;
                const float dxh = to_float(cd[k].v[j]) * gz[k][j];
                out.v[j] = from_float<T>(rs * (dxh - mean1 - xh * mean2));
            }
            store_vec<VEC>(dx + row * hidden + i, out);
        }
    }
    cp_async_wait_group<0>();
    float* p = part + (long long)blockIdx.x * 2 * hidden;
#pragma unroll
    OWNED(k, i) if (i < hidden) {
        Vec<float, VEC> g, b;
#pragma unroll
        for (int j = 0; j < VEC; ++j) g.v[j] = dg[k][j], b.v[j] = db[k][j];
        store_vec<VEC>(p + i, g);
        store_vec<VEC>(p + hidden + i, b);
    }
}

// ---- backward on Hopper: GROUPS rows at a time per block, rows streamed by bulk copies --
// norm_bwd_ring spent half its instructions on per-row overhead (each thread's cp.async
// addresses, two block barriers), and at 16 elements per thread per row it was issue-bound
// (76% of copy at 8192 x 4096). Here the block is GROUPS groups of TPG threads, each group
// taking its own rows through its own ring of STAGES slots: thread 0 of the group loads a
// whole row of x and of dy into a slot with two bulk copies completing on the slot's
// mbarrier; the group sums a row's (s1, s2) behind one named barrier, after which the slot
// of the previous row is free for a refill. The groups merge dgamma/dbeta in shared memory
// at the end, so the partials the reduce reads back are one per block (at 8192 x 4096 one
// per 256 threads were 8% of the bytes).

// (a, b) summed over the TPG threads of a group; valid in all of them. One named barrier
// (1 + group) per call: the scratch alternates halves, so a call cannot overwrite a half
// that the group's previous call is still reading.
__device__ __forceinline__ float2 group_sum2(float a, float b, float2 (*scratch)[32],
                                             int parity, int group, int tpg) {
    a = warp_sum(a);
    b = warp_sum(b);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = tpg >> 5;
    if (lane == 0) scratch[parity][warp] = make_float2(a, b);
    asm volatile("bar.sync %0, %1;\n" ::"r"(1 + group), "r"(tpg) : "memory");
    const float2 p = lane < warps ? scratch[parity][group * warps + lane] : make_float2(0.f, 0.f);
    return make_float2(warp_sum(p.x), warp_sum(p.y));
}

// One 16-byte shared-memory read (a Vec read through a reference was split into 4-byte
// reads once unpack took its words).
template <typename V> __device__ __forceinline__ V lds16(const V* p) {
    static_assert(sizeof(V) == 16, "16-byte vectors");
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    V v;
    memcpy(&v, &u, 16);
    return v;
}

// Dynamic shared memory: GROUPS * STAGES mbarriers padded to 128 bytes (HEAD), then group
// g's slot s at HEAD + (g STAGES + s) 2 hidden sizeof(T): a row of x, then the row of dy.
// Needs rows of 16-byte vectors (VEC * sizeof(T) == 16).
template <typename T, int VEC, int CHUNKS, bool RMS, int STAGES, int GROUPS>
__global__ void __launch_bounds__(CHUNKS == 1 ? 1024 : 512)
norm_bwd_grp(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mu,
             const float* __restrict__ rsigma, const T* __restrict__ gamma,
             T* __restrict__ dx, float* __restrict__ part, long long rows, int hidden,
             int zero_centered) {
#if __CUDA_ARCH__ >= 900
    PDL_WAIT();
    constexpr int HEAD = (8 * GROUPS * STAGES + 127) / 128 * 128;  // the mbarriers
    using V = Vec<T, VEC>;
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ float2 scratch[2][32];
    const int tpg = blockDim.x / GROUPS, group = threadIdx.x / tpg, gt = threadIdx.x % tpg;
    const unsigned row_bytes = hidden * sizeof(T), bar = smem_addr(smem) + 8 * group * STAGES;
    unsigned char* slots = smem + HEAD + group * STAGES * 2 * row_bytes;
    const long long step = (long long)gridDim.x * GROUPS, first = blockIdx.x * GROUPS + group;
    // thread 0 of the group: rows r of x and dy into slot s
    auto fill = [&](int s, long long r) {
        if (r >= rows) return;
        const unsigned dst = smem_addr(slots + s * 2 * row_bytes);
        mbar_expect_tx(bar + 8 * s, 2 * row_bytes);
        bulk_load(dst, x + r * hidden, row_bytes, bar + 8 * s);
        bulk_load(dst + row_bytes, dy + r * hidden, row_bytes, bar + 8 * s);
    };
    if (gt == 0) {
        for (int s = 0; s < STAGES; ++s) mbar_init(bar + 8 * s, 1);
        mbar_init_fence();
        for (int s = 0; s < STAGES; ++s) fill(s, first + s * step);
    }
    const float zc = zero_centered ? 1.f : 0.f;
#define GOWNED(k, i) for (int k = 0, i = gt * VEC; k < CHUNKS; ++k, i += tpg * VEC)
    float dg[CHUNKS][VEC], db[CHUNKS][VEC], gz[CHUNKS][VEC];
#pragma unroll
    GOWNED(k, i) {  // (gz of columns past the row is never read)
        V gv = {};
        if (i < hidden) gv = load_vec<VEC>(gamma + i);
        unpack(gv, gz[k]);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            dg[k][j] = db[k][j] = 0.f;
            gz[k][j] += zc;
        }
    }
    __syncthreads();  // the mbarriers are initialized
    int slot = 0;
    unsigned parity = 0;
    float m_next = 0.f, rs_next = 0.f;  // one row ahead, as norm_bwd_ring
    if (first < rows) {
        m_next = RMS ? 0.f : mu[first];
        rs_next = rsigma[first];
    }
    // Per row, with d = x - mu, xhat = d rs, dxhat = gamma dy (fewest instructions per element):
    //   s1 = sum gamma dy,  s2 = sum gamma dy d,  dgamma += (dy d) rs,  dbeta += dy,
    //   dx = rs (dxhat - s1 / n - xhat rs s2 / n) = dy (gamma rs) - (d c2 + c1),
    //   c1 = rs s1 / n, c2 = rs^3 s2 / n. RMSNorm: mu = 0, no s1, no dbeta.
    const float inv_n = 1.f / hidden;
    for (long long row = first; row < rows; row += step) {
        const float m = m_next, rs = rs_next;
        if (row + step < rows) {
            m_next = RMS ? 0.f : mu[row + step];
            rs_next = rsigma[row + step];
        }
        mbar_wait(bar + 8 * slot, parity);
        const V* cx = reinterpret_cast<const V*>(slots + slot * 2 * row_bytes) + gt;
        const V* cd = reinterpret_cast<const V*>(slots + slot * 2 * row_bytes + row_bytes) + gt;
        float s1 = 0.f, s2 = 0.f;
#pragma unroll
        GOWNED(k, i) if (i < hidden) {
            float xf[VEC], df[VEC];
            unpack(lds16(cx + k * tpg), xf);
            unpack(lds16(cd + k * tpg), df);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const float t = df[j] * (xf[j] - m);
                dg[k][j] = fmaf(t, rs, dg[k][j]);
                s2 = fmaf(gz[k][j], t, s2);
                if (!RMS) {
                    s1 = fmaf(gz[k][j], df[j], s1);
                    db[k][j] += df[j];
                }
            }
        }
        const float2 s = group_sum2(s1, s2, scratch, parity, group, tpg);
        // past the barrier every thread of the group is done with the previous row's slot
        const int prev = slot == 0 ? STAGES - 1 : slot - 1;
        if (gt == 0 && row != first) fill(prev, row - step + STAGES * step);
        const float c1 = RMS ? 0.f : rs * s.x * inv_n, c2 = rs * rs * rs * s.y * inv_n;
#pragma unroll
        GOWNED(k, i) if (i < hidden) {
            float xf[VEC], df[VEC], o[VEC];
            unpack(lds16(cx + k * tpg), xf);
            unpack(lds16(cd + k * tpg), df);
#pragma unroll
            for (int j = 0; j < VEC; ++j)
                o[j] = fmaf(df[j], gz[k][j] * rs, -fmaf(xf[j] - m, c2, c1));
            store_vec<VEC>(dx + row * hidden + i, make_out<T, VEC>(o, 1.f));
        }
        if (++slot == STAGES) slot = 0, parity ^= 1;
    }
    // groups 1.. leave their sums in the (now idle) slots; group 0 adds them up
    if (GROUPS > 1) {
        Vec<float, VEC>* red = reinterpret_cast<Vec<float, VEC>*>(smem + HEAD);
        __syncthreads();
        if (group > 0) {
#pragma unroll
            GOWNED(k, i) {
                Vec<float, VEC> g, b;
#pragma unroll
                for (int j = 0; j < VEC; ++j) g.v[j] = dg[k][j], b.v[j] = db[k][j];
                red[((group - 1) * 2 * CHUNKS + k) * tpg + gt] = g;
                red[(((group - 1) * 2 + 1) * CHUNKS + k) * tpg + gt] = b;
            }
        }
        __syncthreads();
        if (group > 0) return;
#pragma unroll
        for (int q = 0; q < GROUPS - 1; ++q) {
#pragma unroll
            GOWNED(k, i) {
                const Vec<float, VEC> g = red[(q * 2 * CHUNKS + k) * tpg + gt];
                const Vec<float, VEC> b = red[((q * 2 + 1) * CHUNKS + k) * tpg + gt];
#pragma unroll
                for (int j = 0; j < VEC; ++j) dg[k][j] += g.v[j], db[k][j] += b.v[j];
            }
        }
    }
    float* p = part + (long long)blockIdx.x * 2 * hidden;
#pragma unroll
    GOWNED(k, i) if (i < hidden) {
        Vec<float, VEC> g, b;
#pragma unroll
        for (int j = 0; j < VEC; ++j) g.v[j] = dg[k][j], b.v[j] = db[k][j];
        store_vec<VEC>(p + i, g);
        store_vec<VEC>(p + hidden + i, b);
    }
#undef GOWNED
#endif
}

// norm_bwd_reduce with 16-byte loads and several loads in flight per thread: the partials
// are few rows of many columns, so the sum is latency-bound unless each thread keeps
// several loads outstanding. Launch: blocks of (32, 32), block b sums the 128 columns
// [128 b, 128 b + 128) of the 2 hidden; thread (x, y) takes 4 columns and the partial rows
// y, y + 32, ...; the 32 rows of threads meet in shared memory. hidden % 2 == 0.
template <typename T>
__global__ void __launch_bounds__(1024)
norm_bwd_reduce_vec(const float* __restrict__ part, int nparts, int hidden,
                    T* __restrict__ dgamma, T* __restrict__ dbeta, int has_beta) {
    PDL_WAIT();
    __shared__ float4 acc[32][32];
    const int c = (blockIdx.x * 32 + threadIdx.x) * 4, width = 2 * hidden;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    if (c < width) {
        const float* p = part + c;
        int k = threadIdx.y;
        for (; k + 96 < nparts; k += 128) {  // four independent loads, then the adds
            float4 v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u)
                v[u] = *reinterpret_cast<const float4*>(p + (long long)(k + 32 * u) * width);
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                a.x += v[u].x;
                a.y += v[u].y;
                a.z += v[u].z;
                a.w += v[u].w;
            }
        }
        for (; k < nparts; k += 32) {
            const float4 v = *reinterpret_cast<const float4*>(p + (long long)k * width);
            a.x += v.x;
            a.y += v.y;
            a.z += v.z;
            a.w += v.w;
        }
    }
    acc[threadIdx.y][threadIdx.x] = a;
    __syncthreads();
    if (threadIdx.y != 0 || c >= width) return;
    float t[4] = {0.f, 0.f, 0.f, 0.f};
    for (int y = 0; y < 32; ++y) {
        t[0] += acc[y][threadIdx.x].x;
        t[1] += acc[y][threadIdx.x].y;
        t[2] += acc[y][threadIdx.x].z;
        t[3] += acc[y][threadIdx.x].w;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if (c + j < hidden) dgamma[c + j] = from_float<T>(t[j]);
        else if (has_beta) dbeta[c + j - hidden] = from_float<T>(t[j]);
    }
}
