// bulk.cuh — Hopper (sm_90) asynchronous copies into shared memory that complete on
// mbarriers (attention_sm90.cu), and WarpRing, a warp's ring of rows streamed in by them,
// with group_share for the G warps that split a row (the memory-bound row kernels of
// norm.cu and softmax.cu). Use inside
// `#if __CUDA_ARCH__ >= 900` or in Hopper-only files.
#pragma once

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
// Make this thread's mbarrier initializations visible to the async proxy (the copies).
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// 16-byte-aligned global -> shared bulk copy (bytes % 16 == 0) completing `bytes` on `bar`
__device__ __forceinline__ void bulk_load(unsigned dst, const void* src, unsigned bytes,
                                          unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1], %2, [%3];\n" ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// A warp's ring of `slots` slots of `bytes` bytes each, inside the block's dynamic shared
// memory `smem`: first one mbarrier and one row number per slot of every warp (padded to
// 128 bytes), then warp w's slots at [w * slots, (w + 1) * slots). A slot holds one row (of
// one or two tensors, back to back), filled by bulk copies that lane 0 issues. The warp
// waits for its current slot, reads it, and only then refills it with a later row, so
// slots - 1 rows per warp are loading while it works: bytes in flight cost shared memory,
// not registers. Call order per row: row() (the row in the current slot, set by lane 0's
// mark() at least one __syncwarp() before), at() ... reads ... __syncwarp(); lane 0:
// mark(cur, row), fill(cur, ...); next(); __syncwarp().
// The kernels fill one slot per warp first and the others once the first row has come: all
// slots filled at once were one burst of reads (~17 MB at 8192 x 4096), served interleaved,
// so every warp's first row came only at the burst's end (H200: ~5 us after the start,
// ~3.5 with one slot first; LN with FP8 out 75 -> 80% of copy: PERFLOG.md).
struct WarpRing {
    unsigned bar;     // shared address of this warp's first mbarrier
    unsigned offset;  // byte offset of this warp's first slot in smem
    unsigned bytes;
    long long* rows;  // this warp's row number per slot
    int slots, cur = 0;
    unsigned parity = 0;

    __device__ WarpRing(unsigned char* smem, int slots_, unsigned bytes_)
        : slots(slots_), bytes(bytes_) {
        const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
        bar = smem_addr(smem) + 8 * warp * slots;
        rows = reinterpret_cast<long long*>(smem + 8 * warps * slots) + warp * slots;
        offset = header(warps, slots) + warp * slots * bytes;
        if ((threadIdx.x & 31) == 0) {
            for (int i = 0; i < slots; ++i) mbar_init(bar + 8 * i, 1);
            mbar_init_fence();
        }
        __syncwarp();
    }
    __host__ __device__ static unsigned header(int warps, int slots) {
        return (16 * warps * slots + 127) & ~127;
    }
    // Shared bytes a block of `warps` warps needs (common.ring_plan has the same formula).
    __host__ __device__ static unsigned smem_bytes(int warps, int slots, unsigned bytes) {
        return header(warps, slots) + warps * slots * bytes;
    }
    // Lane 0 only: load n1 bytes from a (and n2 bytes from b after them) into slot i.
    __device__ void fill(unsigned char* smem, int i, const void* a, unsigned n1,
                         const void* b = nullptr, unsigned n2 = 0) const {
        const unsigned mb = bar + 8 * i, dst = smem_addr(smem) + offset + i * bytes;
        mbar_expect_tx(mb, n1 + n2);
        bulk_load(dst, a, n1, mb);
        if (n2) bulk_load(dst + n1, b, n2, mb);
    }
    __device__ void mark(int i, long long row) const { rows[i] = row; }  // lane 0
    __device__ long long row() const { return rows[cur]; }
    // Wait until the current slot is filled; its bytes.
    __device__ const unsigned char* at(const unsigned char* smem) const {
        mbar_wait(bar + 8 * cur, parity);
        return smem + offset + cur * bytes;
    }
    __device__ void next() {
        if (++cur == slots) cur = 0, parity ^= 1;
    }
};

// Rows of a ring kernel: group g = b K + k (block b, k-th of the block's K groups; G =
// groups) starts with rows g, g + G, ... in its `slots` slots and refills the first with
// row g + slots G; every later refill takes the row `slots` G further (the fixed split,
// without counters) or (with counters) the next row of counter k: row G (slots + 1) + k +
// K t, t from counter k of the launch (common.ring_counters), so groups on SMs that get more
// of the memory bandwidth take more rows and all end within about a row of each other
// (with the fixed split, LN's warps ended between 21 and 38 us at 8192 x 4096: H200
// timeline, PERFLOG.md; 16384 x 4096: LN, RMS and softmax +9 points). K counters 128 bytes
// apart each serve one group per block (one counter for all serialized the takes). Lane 0
// of the group's first warp (the taker) takes twice once its first row has come (taking at
// the start delayed the first bulk copies), then once per refill, two refills ahead of use,
// so the atomic's latency is hidden behind a row; it shares each take (p0, stored before
// the group's barrier) with the group's other warps. A group with rows takes once more
// than it does rows, so counter k gets an exact count of takes (< 2^32); the group that got
// the last number, which then has no row left, puts it back to zero at its end.
struct RowTaker {
    unsigned* counter;  // nullptr: the fixed split
    unsigned last = 0;  // the launch's last take of this counter
    unsigned p0 = 0, p1 = 0;  // the taker's takes for its next two refills
    long long first, step;    // the counter's first row, G (slots + 1) + k; G slots
    int K;

    __device__ RowTaker(unsigned* counters, int k, int K_, long long blocks, long long rows,
                        int slots, bool taker)
        : counter(counters ? counters + 32 * k : nullptr),
          first(blocks * K_ * (slots + 1) + k), step(blocks * K_ * slots), K(K_) {
        if (!taker || !counter) return;
        // rows of this counter's groups (their first slots + 1, then its own), plus one take
        // per group that has a row
        long long done = ceil_div(rows - first, K);
        for (int i = 0; i <= slots; ++i)
            done += min(blocks, ceil_div(rows - k - i * blocks * K, K));
        last = (unsigned)(done + min(blocks, ceil_div(rows - k, K)) - 1);
    }
    __device__ static long long ceil_div(long long n, long long d) {  // 0 for n <= 0
        return n > 0 ? (n + d - 1) / d : 0;
    }
    // The taker, once its first row has come.
    __device__ void start() {
        if (counter) p0 = atomicAdd(counter, 1u), p1 = atomicAdd(counter, 1u);
    }
    // Lane 0 of each warp, refilling the slot of its `it`-th row `row`: the row it gets
    // (rows or more: none). The group's other warps pass the taker's p0 as `published`.
    __device__ long long next(long long row, int it, bool taker, unsigned published) {
        if (!counter || it == 0) return row + step;
        const unsigned t = taker ? p0 : published;
        if (taker) p0 = p1, p1 = atomicAdd(counter, 1u);
        return first + (long long)K * t;
    }
    __device__ void finish(bool taker) const {  // the taker's last two takes are unused
        if (taker && counter && (p0 == last || p1 == last)) atomicExch(counter, 0u);
    }
};

// Chunks [lo, lo + cnt) of a row of n chunks that warp `member` of a group of G owns:
// contiguous portions of `per` chunks, per = ceil(n / G) rounded up to a multiple of
// `align` (so every portion but the last starts on a 16-byte boundary of a narrower
// companion row, e.g. a byte mask).
struct Portion {
    int lo, cnt, per;
    __device__ Portion(int n, int G, int member, int align) {
        per = ((n + G - 1) / G + align - 1) / align * align;
        lo = min(n, member * per);
        cnt = min(n, lo + per) - lo;
    }
};

// The G warps of a group (warps g G .. g G + G - 1 of the block) each publish a float4 and
// get the group's G values back: one named barrier (1 + g, so at most 15 groups per
// block). `scratch` [2][warps] float4 in shared memory is double-buffered by `parity` (the
// row's), so the next row's writes need no second barrier.
template <int G>
__device__ __forceinline__ const float4* group_share(float4 v, float4* scratch, int parity) {
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if ((threadIdx.x & 31) == 0) scratch[parity * warps + warp] = v;
    asm volatile("bar.sync %0, %1;\n" ::"r"(1 + warp / G), "r"(32 * G) : "memory");
    return scratch + parity * warps + (warp / G) * G;
}
