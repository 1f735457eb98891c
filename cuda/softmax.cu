// softmax.cu — scaled, masked softmax over the last axis and its backward (the unfused
// attention path).
//
// x [rows, sk] viewed as [..., sq, sk]; row r is query i = r % sq. Entry j is excluded when
// mask[r, j] != 0 (HAS_MASK; the mask is materialized to x's shape) or, with causal,
// j > i. y = exp(scale x - m) / sum over kept entries, m = max over kept; a row with every
// entry excluded gives zeros. Backward: dx = scale y (dy - sum(dy y)).
// Kernels (tecupy/kernels/softmax.py picks one; PERFLOG.md): softmax_fwd_stream on Hopper
// (rows streamed through shared memory, G warps per row), softmax_{fwd,bwd}_block for rows
// of 16-byte vectors (a block per row, the row in registers), and for every other row
// softmax_fwd / softmax_bwd: one block per row, 128 threads, the row read three times (max,
// sum, write; the second and third reads hit L1/L2).
#include "bulk.cuh"
#include "common.cuh"

template <bool HAS_MASK>
__device__ __forceinline__ bool kept(const unsigned char* mask, long long r, int j, int i,
                                     int causal, int sk) {
    if (causal && j > i) return false;
    return !HAS_MASK || mask[r * sk + j] == 0;
}

template <typename T, bool HAS_MASK>
__global__ void softmax_fwd(const T* __restrict__ x, const unsigned char* __restrict__ mask,
                            T* __restrict__ y, int sq, int sk, float scale, int causal) {
    PDL_WAIT();
    const long long r = blockIdx.x;
    const int i = (int)(r % sq);
    const T* xr = x + r * sk;
    float m = -kInf;
    for (int j = threadIdx.x; j < sk; j += blockDim.x)
        if (kept<HAS_MASK>(mask, r, j, i, causal, sk)) m = fmaxf(m, scale * to_float(xr[j]));
    m = block_max(m, -kInf);
    if (m == -kInf) m = 0.f;  // nothing kept (or only -inf): the row becomes zeros
    float s = 0.f;
    for (int j = threadIdx.x; j < sk; j += blockDim.x)
        if (kept<HAS_MASK>(mask, r, j, i, causal, sk)) s += expf(scale * to_float(xr[j]) - m);
    s = block_sum(s);
    const float denom = s > 0.f ? s : 1.f;
    for (int j = threadIdx.x; j < sk; j += blockDim.x) {
        const bool k = kept<HAS_MASK>(mask, r, j, i, causal, sk);
        y[r * sk + j] = from_float<T>(k ? expf(scale * to_float(xr[j]) - m) / denom : 0.f);
    }
}

template <typename T>
__global__ void softmax_bwd(const T* __restrict__ dy, const T* __restrict__ y,
                            T* __restrict__ dx, int sk, float scale) {
    PDL_WAIT();
    const long long off = (long long)blockIdx.x * sk;
    float dot = 0.f;
    for (int j = threadIdx.x; j < sk; j += blockDim.x)
        dot += to_float(dy[off + j]) * to_float(y[off + j]);
    dot = block_sum(dot);
    for (int j = threadIdx.x; j < sk; j += blockDim.x)
        dx[off + j] =
            from_float<T>(scale * to_float(y[off + j]) * (to_float(dy[off + j]) - dot));
}

// One chunk of the backward: dx = scale y (dy - dot), rounded once to T.
template <typename T, int VEC>
__device__ __forceinline__ void store_dx(T* dst, const Vec<T, VEC>& y, const Vec<T, VEC>& dy,
                                         float dot, float scale) {
    Vec<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j)
        out.v[j] = from_float<T>(scale * to_float(y.v[j]) * (to_float(dy.v[j]) - dot));
    store_vec<VEC>(dst, out);
}

// ---- one block per row (issue 3; the defaults for 16-byte rows: CHUNKS 4 fwd, 2 bwd) -------
// Long rows (sk = 4096 needed 16 chunks per lane in a warp-per-row kernel: 167 registers,
// few rows per SM; PERFLOG.md) split over a block: thread t keeps chunks c = t + k blockDim (k < CHUNKS) in
// registers, so x is read once. The forward is exp2 of x scale log2(e) (one MUFU op instead of
// expf's dozen instructions: at 4 TB/s the exponentials are half of the time budget) with one
// multiply by 1 / sum per entry, and one block reduction of (max, sum) pairs (online
// softmax: each thread sums exp2(v - its own max); pairs merge as
// s = s1 exp2(m1 - m) + s2 exp2(m2 - m)). Grid-stride over rows; sk % VEC == 0, blockDim <= 512.
__device__ __forceinline__ float2 merge_max_sum(float2 a, float2 b) {
    const float m = fmaxf(a.x, b.x);
    if (m == -kInf) return make_float2(m, 0.f);
    return make_float2(m, a.y * exp2f(a.x - m) + b.y * exp2f(b.x - m));  // exp2(-inf) = 0
}

__device__ __forceinline__ float2 block_max_sum(float2 v) {
    __shared__ float2 partial_ms[32];
    for (int o = 16; o > 0; o >>= 1)
        v = merge_max_sum(v, make_float2(__shfl_xor_sync(0xffffffffu, v.x, o),
                                         __shfl_xor_sync(0xffffffffu, v.y, o)));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();  // partial_ms may still be read by the previous row
    if (lane == 0) partial_ms[warp] = v;
    __syncthreads();
    v = lane < (blockDim.x >> 5) ? partial_ms[lane] : make_float2(-kInf, 0.f);
    for (int o = 16; o > 0; o >>= 1)
        v = merge_max_sum(v, make_float2(__shfl_xor_sync(0xffffffffu, v.x, o),
                                         __shfl_xor_sync(0xffffffffu, v.y, o)));
    return v;
}

#define ROW_CHUNKS(k, c) \
    for (int k = 0, c = threadIdx.x * VEC; k < CHUNKS; ++k, c += blockDim.x * VEC)

template <typename T, int VEC, int CHUNKS, bool HAS_MASK>
__global__ void __launch_bounds__(512)
softmax_fwd_block(const T* __restrict__ x, const unsigned char* __restrict__ mask,
                  T* __restrict__ y, long long rows, int sq, int sk, float scale, int causal) {
    PDL_WAIT();
    const float scale2 = scale * 1.4426950408889634f;  // log2(e): exp(a) = exp2(a log2 e)
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const int qi = (int)(r % sq);
        Vec<T, VEC> a[CHUNKS];
        Vec<unsigned char, VEC> mk[CHUNKS];
#pragma unroll
        ROW_CHUNKS(k, c) if (c < sk) {
            a[k] = load_vec<VEC>(x + r * sk + c);
            if (HAS_MASK) mk[k] = load_vec<VEC>(mask + r * sk + c);
        }
        float v[CHUNKS][VEC], m = -kInf, s = 0.f;
#pragma unroll
        ROW_CHUNKS(k, c)
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const bool keep = c + j < sk && !(causal && c + j > qi) &&
                                  !(HAS_MASK && mk[k].v[j]);
                v[k][j] = keep ? scale2 * to_float(a[k].v[j]) : -kInf;
                m = fmaxf(m, v[k][j]);
            }
#pragma unroll
        ROW_CHUNKS(k, c)
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                v[k][j] = m == -kInf ? 0.f : exp2f(v[k][j] - m);  // excluded: exp2(-inf) = 0
                s += v[k][j];
            }
        const float2 t = block_max_sum(make_float2(m, s));
        // y = exp2(v - m) exp2(m - M) / S; a row with nothing kept becomes zeros.
        const float f = (t.x == -kInf || m == -kInf) ? 0.f : exp2f(m - t.x) / t.y;
#pragma unroll
        ROW_CHUNKS(k, c) if (c < sk) {
            Vec<T, VEC> out;
#pragma unroll
            for (int j = 0; j < VEC; ++j) out.v[j] = from_float<T>(v[k][j] * f);
            store_vec<VEC>(y + r * sk + c, out);
        }
    }
}

// Hopper: G warps per row, rows (and their mask rows) streamed through per-warp WarpRings
// by bulk copies, so many rows per SM load at once and none is held in registers. Warp m
// of a group owns a contiguous portion of the row's chunks (Portion, aligned so the mask's
// portion starts on 16 bytes) and streams only that. Three passes over the slot, each
// reduced across the warp and the group (group_share): the max of the kept x; the sum of
// exp2(x scale2 - max scale2); y = that exp2 / sum. With scale >= 0 (the launch's
// condition) max(x scale) = max(x) scale, so an entry costs one FMA and one ex2 per
// exponential (an online (max, sum) took ~19 instructions per entry, PERFLOG.md). Rows of
// x are 16-byte multiples and, with a mask, sk % 16 == 0. Each group's later rows come from
// RowTaker (bulk.cuh). The launch fixes `slots` and the dynamic shared memory (rings, then
// the scratch [2][warps] float4 and the takes [2][warps] uint32) and passes the row
// counters (null: the fixed split). CAUSAL is a template parameter: without a mask or the
// causal rule no entry pays for the keep test.
__device__ __forceinline__ float exp2_ftz(float x) {  // one MUFU.EX2; exp2(-inf) = 0
    float y;  // exp2f adds a denormal range fix-up (3 instructions) around it
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// chunk c of a slot, by value: one 16-byte shared load (unpack's word reads of a reference
// became two 8-byte loads)
template <typename V> __device__ __forceinline__ V load_chunk(const V* xs, int c) {
    return xs[c];
}

// entry j of chunk c of row qi (mod sq) is kept: not past the diagonal, not masked
template <int VEC, bool HAS_MASK, bool CAUSAL>
__device__ __forceinline__ bool kept(const Vec<unsigned char, VEC>& mk, int c, int j, int qi) {
    return !(CAUSAL && c * VEC + j > qi) && !(HAS_MASK && mk.v[j]);
}

// v over the warp, then over the G warps of the group (scratch half `parity`), by `op`
template <int G, typename Op>
__device__ __forceinline__ float group_reduce(float v, Op op, float4* scratch, int parity) {
    v = warp_reduce(v, op);
    if (G > 1) {
        const float4* p = group_share<G>(make_float4(v, 0.f, 0.f, 0.f), scratch, parity);
        v = p[0].x;
#pragma unroll
        for (int i = 1; i < G; ++i) v = op(v, p[i].x);
    }
    return v;
}

// causal (the argument) must equal CAUSAL.
template <typename T, int VEC, bool HAS_MASK, int G, bool CAUSAL>
__global__ void __launch_bounds__(512)
softmax_fwd_stream(const T* __restrict__ x, const unsigned char* __restrict__ mask,
                   T* __restrict__ y, long long rows, int sq, int sk, float scale, int causal,
                   unsigned* __restrict__ counters, int slots) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) unsigned char smem[];
    PDL_WAIT();
    using V = Vec<T, VEC>;
    using M = Vec<unsigned char, VEC>;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const Portion part(sk / VEC, G, warp % G, 16 / VEC);
    const int lo = part.lo, cnt = part.cnt;
    const unsigned xbytes = cnt * sizeof(V), mbytes = HAS_MASK ? cnt * VEC : 0;
    const unsigned xslot = part.per * sizeof(V);  // the mask portion follows at xslot
    const long long step = gridDim.x * (long long)(warps / G);
    const long long first = blockIdx.x * (long long)(warps / G) + warp / G;
    const float scale2 = scale * 1.4426950408889634f;  // log2(e): exp(a) = exp2(a log2 e)
    WarpRing ring(smem, slots, xslot + (HAS_MASK ? part.per * VEC : 0));
    float4* scratch = reinterpret_cast<float4*>(smem + WarpRing::smem_bytes(warps, slots,
                                                                            ring.bytes));
    unsigned* takes = reinterpret_cast<unsigned*>(scratch + 2 * warps);  // [2][warps]
    const T* xsrc = x + lo * VEC;
    const unsigned char* msrc = mask + (HAS_MASK ? lo * VEC : 0);
    auto fill = [&](int i, long long r) {  // lane 0: slot i gets row r (and its mask row)
        ring.fill(smem, i, xsrc + r * sk, xbytes, msrc + r * (HAS_MASK ? sk : 0), mbytes);
    };
    if (lane == 0) {  // one slot filled; the rest once it has come (WarpRing)
        for (int i = 0; i < slots; ++i) ring.mark(i, min(first + i * step, rows));
        if (cnt > 0 && first < rows) fill(0, first);
    }
    const bool taker = warp % G == 0 && lane == 0;  // later rows: RowTaker
    RowTaker rt(counters, warp / G, warps / G, gridDim.x, rows, slots, taker);
    int parity = 0;
    for (long long r, it = 0; (r = ring.row()) < rows; parity ^= 1, ++it) {
        const unsigned char* slot = cnt ? ring.at(smem) : smem;  // none: never waits
        if (r == first && lane == 0 && cnt > 0)  // the other slots (WarpRing)
            for (int i = 1; i < slots && r + i * step < rows; ++i) fill(i, r + i * step);
        if (it == 0 && taker) rt.start();
        if (G > 1 && taker && it > 0) takes[parity * warps + warp] = rt.p0;  // (group_reduce)
        const V* xs = reinterpret_cast<const V*>(slot) - lo;     // xs[c], ms[c]: chunk c
        const M* ms = reinterpret_cast<const M*>(slot + xslot) - lo;
        const int qi = (int)(r % sq);
        float mx = -kInf, sum = 0.f, f[VEC];
        M mk;
#pragma unroll 2
        for (int c = lo + lane; c < lo + cnt; c += 32) {
            unpack(load_chunk(xs, c), f);
            if (HAS_MASK) mk = ms[c];
#pragma unroll
            for (int j = 0; j < VEC; ++j)
                mx = fmaxf(mx, kept<VEC, HAS_MASK, CAUSAL>(mk, c, j, qi) ? f[j] : -kInf);
        }
        mx = group_reduce<G>(mx, MaxOp(), scratch, 0);
        // the reference's rule: a max that is not finite (all masked, or inf) counts as 0
        const float shift = isfinite(mx) ? mx * scale2 : 0.f;
#pragma unroll 2
        for (int c = lo + lane; c < lo + cnt; c += 32) {
            unpack(load_chunk(xs, c), f);
            if (HAS_MASK) mk = ms[c];
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const float e = exp2_ftz(fmaf(f[j], scale2, -shift));
                sum += kept<VEC, HAS_MASK, CAUSAL>(mk, c, j, qi) ? e : 0.f;
            }
        }
        sum = group_reduce<G>(sum, SumOp(), scratch, 1);
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll 2
        for (int c = lo + lane; c < lo + cnt; c += 32) {
            float o[VEC];
            if (CAUSAL && c * VEC > qi) {  // all past the diagonal: zeros, no exponentials
#pragma unroll
                for (int j = 0; j < VEC; ++j) o[j] = 0.f;
            } else {
                unpack(load_chunk(xs, c), f);
                if (HAS_MASK) mk = ms[c];
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const float e = exp2_ftz(fmaf(f[j], scale2, -shift)) * inv;
                    o[j] = kept<VEC, HAS_MASK, CAUSAL>(mk, c, j, qi) ? e : 0.f;
                }
            }
            store_vec<VEC>(y + r * sk + c * VEC, make_out<T, VEC>(o, 1.f));
        }
        __syncwarp();  // every lane has read the slot: refill it
        if (lane == 0) {
            const unsigned published = G > 1 ? takes[parity * warps + warp - warp % G] : 0u;
            const long long ahead = min(rt.next(r, it, taker, published), rows);
            ring.mark(ring.cur, ahead);
            if (ahead < rows && cnt > 0) fill(ring.cur, ahead);
        }
        ring.next();
        __syncwarp();  // (the mark)
    }
    rt.finish(taker);
    PDL_TRIGGER();
#endif
}

// dx = scale y (dy - sum(dy y)), dy and y held in registers: each read once.
template <typename T, int VEC, int CHUNKS>
__global__ void __launch_bounds__(512)
softmax_bwd_block(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
                  long long rows, int sk, float scale) {
    PDL_WAIT();
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        Vec<T, VEC> d[CHUNKS], p[CHUNKS];
        float dot = 0.f;
#pragma unroll
        ROW_CHUNKS(k, c) if (c < sk) {
            d[k] = load_vec<VEC>(dy + r * sk + c);
            p[k] = load_vec<VEC>(y + r * sk + c);
        }
#pragma unroll
        ROW_CHUNKS(k, c) if (c < sk)
#pragma unroll
            for (int j = 0; j < VEC; ++j) dot += to_float(d[k].v[j]) * to_float(p[k].v[j]);
        dot = block_sum(dot);
#pragma unroll
        ROW_CHUNKS(k, c) if (c < sk) store_dx(dx + r * sk + c, p[k], d[k], dot, scale);
    }
}
