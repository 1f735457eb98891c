// norm_bwd.cu — LayerNorm and RMSNorm backward (maths, shapes and the kernels: norm.cuh).
//
// dy, x [rows, hidden] of T, mu (LayerNorm) and rsigma [rows] float, gamma [hidden] -> dx
// [rows, hidden] of T and a dgamma/dbeta partial row per block, part [blocks, 2 hidden]
// float, which norm_bwd_reduce_vec (even hidden) or norm_bwd_reduce sums into dgamma and
// dbeta. Launches (tecupy/kernels/norm.py): norm_bwd_grp, one block per SM of up to 8
// groups of threads, rings in dynamic shared memory (Hopper, 16-byte rows of <= 2 chunks
// per thread); norm_bwd_ring, as many blocks as fit of up to 512 threads, the same rows
// elsewhere; norm_bwd, 512 threads per SM, every other row. All grid-stride over rows.
#include "bulk.cuh"
#include "norm.cuh"

// ---- a block per row (or two), from registers --------------------------------------------
// Each iteration takes ROWS rows at once (rows r, r + 1): their loads are in flight together
// and one barrier pair reduces all their sums. Registers hold the dgamma/dbeta sums and the
// packed x, dy; gamma is re-read (an L1 hit), which keeps the kernel free of spills at
// CHUNKS * VEC = 16. ACC_SMEM: the dgamma/dbeta sums in shared memory [2 hidden] instead
// (4+ chunks per thread would spill), column i + j at SLOT(i, j), so the lanes of a warp
// touch consecutive words (no bank conflicts).
#define SLOT(i, j) ((j) * (hidden / VEC) + (i) / VEC)

// dx[off..] = o, plus the gradient the norm's input already has from its other consumer
// (dres, nullptr where none: the residual's, in a pre-norm block): the tape's sum of the
// two in this pass, rounded once (issue 21: an add kernel over [rows, hidden] less).
template <typename T, int VEC>
__device__ __forceinline__ void store_dx(T* dx, const T* dres, long long off, float (&o)[VEC]) {
    if (dres != nullptr) {
        const Vec<T, VEC> r = load_vec<VEC>(dres + off);
#pragma unroll
        for (int j = 0; j < VEC; ++j) o[j] += to_float(r.v[j]);
    }
    store_vec<VEC>(dx + off, make_out<T, VEC>(o, 1.f));
}

template <typename T, int VEC, int CHUNKS, bool RMS, bool ACC_SMEM, int ROWS>
__global__ void __launch_bounds__(512)
norm_bwd(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mu,
         const float* __restrict__ rsigma, const T* __restrict__ gamma, T* __restrict__ dx,
         const T* __restrict__ dres, float* __restrict__ part, long long rows, int hidden,
         int zero_centered) {
    PDL_WAIT();
    static_assert(ROWS == 1 || ROWS == 2, "one reduction takes the sums of at most 2 rows");
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
                    const auto g = [&] { return to_float(gv.v[j]) + zc; };
                    if constexpr (ACC_SMEM)
                        bwd_sums(cx[q][k].v[j], cd[q][k].v[j], g, m[q], rs[q], s1[q], s2[q],
                                 acc[SLOT(i, j)], acc[hidden + SLOT(i, j)]);
                    else
                        bwd_sums(cx[q][k].v[j], cd[q][k].v[j], g, m[q], rs[q], s1[q], s2[q],
                                 dg[k][j], db[k][j]);
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
                float o[VEC];
#pragma unroll
                for (int j = 0; j < VEC; ++j)
                    o[j] = bwd_dx(cx[q][k].v[j], cd[q][k].v[j],
                                  [&] { return to_float(gv.v[j]) + zc; }, m[q], rs[q],
                                  RMS ? 0.f : mean1[q], mean2[q]);
                store_dx<T, VEC>(dx, dres, (row0 + q) * hidden + i, o);
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

// dgamma[c] = sum_b part[b, c], dbeta[c] = sum_b part[b, hidden + c] (odd hidden). Launch:
// blocks of (32, 8) threads, one block per 32 of the 2 hidden columns; the 8 rows of threads
// split the partials and meet in shared memory (one thread per column alone would leave
// most SMs idle).
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

// The same with 16-byte loads and several loads in flight per thread (even hidden): the
// partials are few rows of many columns, so the sum is latency-bound unless each thread
// keeps several loads outstanding. Launch: blocks of (32, 32), block b sums the 128 columns
// [128 b, 128 b + 128) of the 2 hidden; thread (x, y) takes 4 columns and the partial rows
// y, y + 32, ...; the 32 rows of threads meet in shared memory.
__device__ __forceinline__ void add4(float4& a, const float4& v) {
    a.x += v.x;
    a.y += v.y;
    a.z += v.z;
    a.w += v.w;
}

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
            for (int u = 0; u < 4; ++u) add4(a, v[u]);
        }
        for (; k < nparts; k += 32)
            add4(a, *reinterpret_cast<const float4*>(p + (long long)k * width));
    }
    acc[threadIdx.y][threadIdx.x] = a;
    __syncthreads();
    if (threadIdx.y != 0 || c >= width) return;
    float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int y = 0; y < 32; ++y) add4(t, acc[y][threadIdx.x]);
    const float tj[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if (c + j < hidden) dgamma[c + j] = from_float<T>(tj[j]);
        else if (has_beta) dbeta[c + j - hidden] = from_float<T>(tj[j]);
    }
}

// ---- a block per row, the next rows streamed by cp.async (16-byte rows) ------------------
// norm_bwd keeps at most two rows per block in flight, so an SM waits on load latency
// between rows. Here each thread copies its own chunks of the next STAGES - 1 rows into
// shared memory with cp.async (sm_80+) while it works on the current row: bytes in flight
// no longer cost registers. A thread reads back only the slots it filled itself, so the
// ring needs no barrier (cp.async.wait_group makes a thread's own copies visible to it).
// Slot (stage, tensor, k) of thread t is ring[((stage 2 + tensor) CHUNKS + k) blockDim + t]
// (tensor 0: x, 1: dy): a warp reads 512 consecutive bytes. Dynamic shared memory: STAGES 2
// CHUNKS blockDim 16 bytes. Needs VEC * sizeof(T) == 16.
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

template <typename T, int VEC, int CHUNKS, bool RMS, int STAGES>
__global__ void __launch_bounds__(512)
norm_bwd_ring(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mu,
              const float* __restrict__ rsigma, const T* __restrict__ gamma,
              T* __restrict__ dx, const T* __restrict__ dres, float* __restrict__ part,
              long long rows, int hidden, int zero_centered) {
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
    auto issue = [&](int stage, long long r) {  // rows r of x and dy into `stage`
        ring_issue<T, VEC, CHUNKS>(ring + (2 * stage) * tensor_size, x, r, rows, hidden);
        ring_issue<T, VEC, CHUNKS>(ring + (2 * stage + 1) * tensor_size, dy, r, rows, hidden);
        cp_async_commit_group();
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue(s, blockIdx.x + s * step);
    int stage = 0;
    // mu and rsigma one row ahead: loaded where the row is needed, their DRAM latency
    // stalled every row
    float m_next = 0.f, rs_next = 0.f;
    if (blockIdx.x < rows) {
        m_next = RMS ? 0.f : mu[blockIdx.x];
        rs_next = rsigma[blockIdx.x];
    }
    for (long long row = blockIdx.x; row < rows; row += step) {
        issue(stage == 0 ? STAGES - 1 : stage - 1, row + (STAGES - 1) * step);  // read last
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
        OWNED(k, i) if (i < hidden)
#pragma unroll
            for (int j = 0; j < VEC; ++j)
                bwd_sums(cx[k].v[j], cd[k].v[j], [&] { return gz[k][j]; }, m, rs, s1, s2,
                         dg[k][j], db[k][j]);
        const float2 s = block_sum2(s1, s2);
        const float mean1 = RMS ? 0.f : s.x / hidden, mean2 = s.y / hidden;
#pragma unroll
        OWNED(k, i) if (i < hidden) {
            float o[VEC];
#pragma unroll
            for (int j = 0; j < VEC; ++j)
                o[j] = bwd_dx(cx[k].v[j], cd[k].v[j], [&] { return gz[k][j]; }, m, rs, mean1,
                              mean2);
            store_dx<T, VEC>(dx, dres, row * hidden + i, o);
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

// ---- Hopper: groups of threads, each streaming its own rows by bulk copies ----------------
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

#define GOWNED(k, i) CHUNKS_OF(k, i, gt * VEC, tpg * VEC)

// Dynamic shared memory: GROUPS * STAGES mbarriers padded to 128 bytes (HEAD), then group
// g's slot s at HEAD + (g STAGES + s) 2 hidden sizeof(T): a row of x, then the row of dy.
// Needs rows of 16-byte vectors (VEC * sizeof(T) == 16).
template <typename T, int VEC, int CHUNKS, bool RMS, int STAGES, int GROUPS>
__global__ void __launch_bounds__(CHUNKS == 1 ? 1024 : 512)
norm_bwd_grp(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mu,
             const float* __restrict__ rsigma, const T* __restrict__ gamma,
             T* __restrict__ dx, const T* __restrict__ dres, float* __restrict__ part,
             long long rows, int hidden, int zero_centered) {
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
            for (int j = 0; j < VEC; ++j)
                grp_sums<RMS>(xf[j], df[j], gz[k][j], m, rs, s1, s2, dg[k][j], db[k][j]);
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
            for (int j = 0; j < VEC; ++j) o[j] = grp_dx(xf[j], df[j], gz[k][j], m, rs, c1, c2);
            store_dx<T, VEC>(dx, dres, row * hidden + i, o);
        }
        if (++slot == STAGES) slot = 0, parity ^= 1;
    }
    // groups 1.. leave their sums in the (now idle) rings; group 0 adds them up
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
#endif
}
