// cast.cu — FP8 cast with amax (also with its transpose), and FP8 dequantize.
//
// cast_to_fp8<T, F8>:  q[i] = F8(x[i] * scale[0])   (round to nearest even, __NV_SATFINITE:
//                      overflow and inf saturate to +-max; a NaN of either sign gives
//                      0x7F, the canonical NaN of E4M3 and E5M2: cvt.rn.satfinite on
//                      sm_89+, and cuda_fp8.hpp's software path canonicalizes NaN to
//                      0x7FFFFFFF first, so every path of every kernel here agrees, as in
//                      Transformer Engine's casts, which convert the same way)
//                      amax[0] = max(amax[0], max_i |x[i]|)   (NaN ignored, as fmaxf)
//                      scale_inv[0] = 1 / scale[0] (IEEE division, no flush to zero: the
//                      FP8 tensor's dequantizing factor, written by one thread, as
//                      Transformer Engine's casts do; nullptr: not written. Python's
//                      1 / scale on CuPy runs under CuPy's -ftz=true: 0 above 2^126)
//   x [n] of T (float, double, __half, __nv_bfloat16), q [n] uint8,
//   scale/scale_inv/amax [1] float.
//   Launch: 1-D grid-stride over VEC-wide chunks (16-byte loads; n % VEC == 0 when
//   VEC > 1), blockDim 256; one atomicMax per block. amax must hold a value >= 0 before.
// fp8_dequantize<F8, T>: y[i] = T(float(F8 q[i]) * scale_inv[0]).
// cast_transpose_tiled<T, F8, G, DBIAS, RAGGED, DACT>: the cast, also writing the transpose
//   (below); scale_inv as in cast_to_fp8. DACT (a struct of act_math.cuh, or NoAct): the
//   tensor cast is an activation's backward, x = T(dy * f'(h + hbias)), dy the kernel's x
//   input (Transformer Engine's cast_transpose_dbias_dgelu). Fwd<A>: the tensor cast is
//   activation A's forward of x + hbias in float, as act.cu's act_fwd casts it (no rounding
//   to T first: the same codes and amax), with its transpose (fc2's input and wgrad's copy).
// cast_transpose_pair<T, F8>: two plain cast_transpose_tiled casts in one launch.
#include "act_math.cuh"
#include "common.cuh"

struct NoAct {};  // cast_transpose_tiled casts x itself
template <typename A> struct Fwd {};  // it casts act A's forward of x (+ hbias)
template <typename A> struct IsNoAct { static constexpr bool value = false; };
template <> struct IsNoAct<NoAct> { static constexpr bool value = true; };
template <typename A> struct IsFwd { static constexpr bool value = false; };
template <typename A> struct IsFwd<Fwd<A>> { static constexpr bool value = true; };
template <typename A> struct FwdAct { using type = A; };
template <typename A> struct FwdAct<Fwd<A>> { using type = A; };

// ---- cast ------------------------------------------------------------------------------
template <typename T, typename F8, int VEC>
__global__ void cast_to_fp8(const T* __restrict__ x, const float* __restrict__ scale,
                            unsigned char* __restrict__ q, float* __restrict__ scale_inv,
                            float* __restrict__ amax, unsigned* __restrict__ slot,
                            long long n) {
    PDL_WAIT();
    const float s = scale[0];
    write_scale_inv(scale_inv, s, blockIdx.x);
    float m = 0.f;
    for (long long i = VEC * (blockIdx.x * (long long)blockDim.x + threadIdx.x); i < n;
         i += (long long)VEC * gridDim.x * blockDim.x) {
        const Vec<T, VEC> a = load_vec<VEC>(x + i);
        float v[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            v[j] = to_float(a.v[j]);
            m = fmaxf(m, fabsf(v[j]));
        }
        store_vec<VEC>(reinterpret_cast<F8*>(q + i), make_out<F8, VEC>(v, s));
    }
    PDL_TRIGGER();
    grid_amax(m, amax, slot);
}

// ---- dequantize --------------------------------------------------------------------------
template <typename F8, typename T>
__global__ void fp8_dequantize(const unsigned char* __restrict__ q,
                               const float* __restrict__ scale_inv, T* __restrict__ y,
                               long long n) {
    const float s = scale_inv[0];
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        F8 v;
        v.__x = q[i];
        y[i] = from_float<T>(float(v) * s);
    }
}

// ---- cast + transpose ----------------------------------------------------------------------
// cast_transpose_tiled<T, F8, G>: the cast above, writing both q [rows, cols] and its
// transpose qt [cols, rows] in one pass (wgrad and dgrad need the column-wise copy).
// Tile: 128 G rows x 64 cols, 256 threads (G = 1 is declared: 256-row tiles measured
// slower, PERFLOG.md). Thread (a = t / 8, b = t % 8) casts rows 4a..4a+3 (+128 g) of columns
// 8b..8b+7 (16-byte loads of bf16); for each column it packs the 4 row bytes into one word
// (a 4 x 4 byte transpose in registers) and stores it to the transposed tile tt[col][row]
// (128 G bytes per col), so shared memory moves words, not bytes (the session-1 kernel's
// byte-wide transpose co-limited it with DRAM: 64% of copy against 80%).
// Each thread then copies 2 G 16-byte chunks of tt rows to qt: a warp writes whole 128-byte
// runs of qt rows. The 16-byte chunks of a tt row are XOR-swizzled by (col / 8) % 8, which
// makes both the word stores and the 16-byte loads conflict-free.
// DBIAS (dbias fused, Transformer Engine's cast_transpose_dbias): part[blockIdx.y][col] =
// the float32 sum of the tile's rows of x, for a second pass over the row blocks.
// h's and q's rows are ldh and ldq elements apart (cols, or a column chunk's of wider arrays:
// ops/blocks.py runs fc2's dgrad and the dact cast over column chunks, issue 22).
// Needs rows % 16 == 0, cols % 8 == 0, unless RAGGED (any shape; where cols % 8 != 0:
// element-wise loads, zeros past the edges, q by store_ragged; where rows % 16 != 0: qt by
// store_ragged). A grid-stride loop over the tiles (row-major), with no more blocks than
// fit on the GPU at once: each block's end costs a round trip (grid_amax), paid once.
template <int G>
__device__ __forceinline__ int tt_word(int col, int word) {  // word = 4-row group in col
    const int chunk = word >> 2, swz = (chunk & ~7) | ((chunk ^ (col >> 3)) & 7);
    return col * 32 * G + swz * 4 + (word & 3);
}

// row r, columns c .. c + 7 of x (c < cols; rows ld elements apart); RAGGED: rows past the
// end are zeros, and rows not 16-byte aligned (cols % 8 != 0) are read element-wise
template <bool RAGGED, typename T>
__device__ __forceinline__ Vec<T, 8> load_tile_row(const T* x, int r, int c, int rows, int cols,
                                                   long long ld) {
    if (!RAGGED || (cols % 8 == 0 && r < rows)) return load_vec<8>(x + r * ld + c);
    Vec<T, 8> v;
#pragma unroll
    for (int j = 0; j < 8; ++j)
        v.v[j] = r < rows && c + j < cols ? x[r * ld + c + j] : from_float<T>(0.f);
    return v;
}

// RAGGED: q (where cols % 8 != 0) and qt (where rows % 16 != 0) written from the transposed
// tile tt, each warp store 32 consecutive bytes of one row (rows of any length and
// alignment; a thread's own 8-byte q piece or 16-byte qt piece as byte stores touched
// 8-16x the L2 sectors: 5x slower)
template <int G>
__device__ __forceinline__ unsigned char tt_byte(const unsigned* tt, int col, int row) {
    return reinterpret_cast<const unsigned char*>(tt)[4 * tt_word<G>(col, row >> 2) + (row & 3)];
}

template <int G>
__device__ void store_ragged(const unsigned* tt, unsigned char* q, unsigned char* qt, int r0,
                             int c0, int rows, int cols, long long ldq) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int i = warp; i < 128 * G && r0 + i < rows && cols % 8; i += 8)  // q: tile rows
#pragma unroll
        for (int col = lane; col < 64; col += 32)
            if (c0 + col < cols) q[(r0 + i) * ldq + c0 + col] = tt_byte<G>(tt, col, i);
    for (int col = warp; col < 64 && c0 + col < cols && rows % 16; col += 8)  // qt: columns
#pragma unroll
        for (int i = lane; i < 128 * G; i += 32)
            if (r0 + i < rows) qt[(long long)(c0 + col) * rows + r0 + i] = tt_byte<G>(tt, col, i);
}

// The value cast at element j of a row's 8 columns: x itself; with Fwd<A> the activation's
// forward f(x + hbias) in float (act_fwd's FP8 output: FAST maths, not rounded to T); with
// DACT the activation's backward, dy f'(h + hbias) rounded to T as act.cu's act_bwd writes
// dx (same FAST maths).
template <typename DACT, typename T>
__device__ __forceinline__ float cast_input(const Vec<T, 8>& x, const Vec<T, 8>& h,
                                            const float* hb, int j) {
    if constexpr (IsNoAct<DACT>::value) {
        return to_float(x.v[j]);
    } else if constexpr (IsFwd<DACT>::value) {
        return FwdAct<DACT>::type::template f<true>(to_float(x.v[j]) + hb[j]);
    } else {
        const float d = DACT::template df<(sizeof(T) < 4)>(to_float(h.v[j]) + hb[j]);
        return to_float(from_float<T>(to_float(x.v[j]) * d));
    }
}

// The body of cast_transpose_tiled for block blk of nblk (a grid-stride loop over the tiles
// with nblk blocks; cast_transpose_pair runs two in one grid).
template <typename T, typename F8, int G, bool DBIAS, bool RAGGED, typename DACT>
__device__ __forceinline__ void
cast_transpose_body(const T* __restrict__ x, const float* __restrict__ scale,
                    unsigned char* __restrict__ q, unsigned char* __restrict__ qt,
                    float* __restrict__ scale_inv, float* __restrict__ amax,
                    unsigned* __restrict__ slot, float* __restrict__ part, int rows, int cols,
                    const T* __restrict__ h, const T* __restrict__ hbias, long long ldh,
                    long long ldq, int blk, int nblk) {
    constexpr bool ACT = !IsNoAct<DACT>::value;  // hbias read (forward or backward)
    constexpr bool DH = ACT && !IsFwd<DACT>::value;  // h read: the backward's
    __shared__ __align__(16) unsigned tt[64 * 32 * G];
    __shared__ float colsum[DBIAS ? 8 : 1][64];  // per warp: its 16 rows' column sums
    const float s = scale[0];
    write_scale_inv(scale_inv, s, blk);
    const int tiles_x = (cols + 63) / 64, tiles = tiles_x * ((rows + 128 * G - 1) / (128 * G));
    const int a = threadIdx.x >> 3, b = threadIdx.x & 7;
    float m = 0.f;
    // every load of a tile issued before any is used; the next tile's as soon as this
    // one's are converted, so they are in flight while this tile's transpose is written
    Vec<T, 8> in[G][4], hin[DH ? G : 1][4];  // hin: h, with a backward DACT only
    auto load = [&](int tile) {
        const int r0 = tile / tiles_x * 128 * G, c = (tile % tiles_x) * 64 + 8 * b;
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = r0 + 128 * g + 4 * a + i;
                if ((RAGGED || r < rows) && c < cols) {
                    in[g][i] = load_tile_row<RAGGED>(x, r, c, rows, cols, cols);
                    if constexpr (DH)
                        hin[g][i] = load_tile_row<RAGGED>(h, r, c, rows, cols, ldh);
                }
            }
    };
    if (blk < tiles) load(blk);
    for (int tile = blk; tile < tiles; tile += nblk) {
        const int by = tile / tiles_x, r0 = by * 128 * G, c0 = (tile % tiles_x) * 64;
        const int c = c0 + 8 * b;
        float cs[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // this thread's rows, columns c .. c + 7
        float hb[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // DACT: hbias of columns c .. c + 7
        if (ACT && hbias != nullptr)
#pragma unroll
            for (int j = 0; j < 8; ++j) hb[j] = c + j < cols ? to_float(hbias[c + j]) : 0.f;
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const int r = r0 + 128 * g + 4 * a;  // rows % 16 == 0: all 4 rows or none
            if (r >= rows || c >= cols) continue;  // (RAGGED: rows past the end are zeros)
            unsigned pair[4][4];  // pair[i][k]: codes of row i, columns c + 2k, c + 2k + 1
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float f[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    f[j] = cast_input<DACT>(in[g][i], hin[DH ? g : 0][i], hb, j);
                    m = fmaxf(m, fabsf(f[j]));
                    if (DBIAS) cs[j] += f[j];
                }
#pragma unroll
                for (int k = 0; k < 4; ++k)
                    pair[i][k] = fp8x2<F8>(f[2 * k] * s, f[2 * k + 1] * s);
                if (!RAGGED || (cols % 8 == 0 && r + i < rows))  // (else q from tt below)
                    *reinterpret_cast<uint2*>(q + (r + i) * ldq + c) =
                        make_uint2(__byte_perm(pair[i][0], pair[i][1], 0x5410),
                                   __byte_perm(pair[i][2], pair[i][3], 0x5410));
            }
            // word of column c + j: its 4 row bytes (a 4 x 4 byte transpose by byte permutes)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const unsigned r01 = __byte_perm(pair[0][k], pair[1][k], 0x5410);
                const unsigned r23 = __byte_perm(pair[2][k], pair[3][k], 0x5410);
                tt[tt_word<G>(8 * b + 2 * k, 32 * g + a)] = __byte_perm(r01, r23, 0x6420);
                tt[tt_word<G>(8 * b + 2 * k + 1, 32 * g + a)] = __byte_perm(r01, r23, 0x7531);
            }
        }
        if (tile + nblk < tiles) load(tile + nblk);
        if (DBIAS) {  // lanes with the same b (columns) differ in a by lane / 8
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                cs[j] += __shfl_xor_sync(0xffffffffu, cs[j], 8);
                cs[j] += __shfl_xor_sync(0xffffffffu, cs[j], 16);
                if ((threadIdx.x & 31) < 8) colsum[threadIdx.x >> 5][8 * b + j] = cs[j];
            }
        }
        __syncthreads();
        if (DBIAS && threadIdx.x < 64 && c0 + threadIdx.x < cols) {
            float t = 0.f;
#pragma unroll
            for (int w = 0; w < 8; ++w) t += colsum[w][threadIdx.x];
            part[(long long)by * cols + c0 + threadIdx.x] = t;
        }
        if (RAGGED) store_ragged<G>(tt, q, qt, r0, c0, rows, cols, ldq);
#pragma unroll
        for (int h = 0; h < 2 * G && (!RAGGED || rows % 16 == 0); ++h) {
            const int v = threadIdx.x + 256 * h, col = v / (8 * G), chunk = v % (8 * G);
            const int r = r0 + 16 * chunk;
            if (r < rows && c0 + col < cols)
                store_vec<16>(qt + (long long)(c0 + col) * rows + r,
                              *reinterpret_cast<const Vec<unsigned char, 16>*>(
                                  &tt[tt_word<G>(col, 4 * chunk)]));
        }
        __syncthreads();  // tt and colsum are the next tile's
    }
    PDL_TRIGGER();
    grid_amax(m, amax, slot);  // (a slot counts the whole grid's blocks: null in the pair)
}

template <typename T, typename F8, int G, bool DBIAS, bool RAGGED, typename DACT = NoAct>
__global__ void __launch_bounds__(256)
cast_transpose_tiled(const T* __restrict__ x, const float* __restrict__ scale,
                     unsigned char* __restrict__ q, unsigned char* __restrict__ qt,
                     float* __restrict__ scale_inv, float* __restrict__ amax,
                     unsigned* __restrict__ slot, float* __restrict__ part, int rows,
                     int cols, const T* __restrict__ h, const T* __restrict__ hbias,
                     long long ldh, long long ldq) {
    PDL_WAIT();
    cast_transpose_body<T, F8, G, DBIAS, RAGGED, DACT>(x, scale, q, qt, scale_inv, amax, slot,
                                                       part, rows, cols, h, hbias, ldh, ldq,
                                                       blockIdx.x, gridDim.x);
}

// cast_transpose_pair<T, F8>: two plain casts (no dbias, no activation, rows % 16 == 0,
// cols % 8 == 0) in one launch: an FP8 linear's input and weight, one launch less per
// forward (issue 21). Blocks [0, blocks_a) cast a, the rest b, each set a grid-stride loop
// over its own tiles; each amax maxed in by atomicMax (no slot), each scale_inv written.
template <typename T, typename F8>
__global__ void __launch_bounds__(256)
cast_transpose_pair(const T* __restrict__ xa, const float* __restrict__ sa,
                    unsigned char* __restrict__ qa, unsigned char* __restrict__ qta,
                    float* __restrict__ inva, float* __restrict__ amaxa, int rowsa, int colsa,
                    const T* __restrict__ xb, const float* __restrict__ sb,
                    unsigned char* __restrict__ qb, unsigned char* __restrict__ qtb,
                    float* __restrict__ invb, float* __restrict__ amaxb, int rowsb, int colsb,
                    int blocks_a) {
    PDL_WAIT();
    const bool a = blockIdx.x < blocks_a;
    const int cols = a ? colsa : colsb;
    cast_transpose_body<T, F8, 1, false, false, NoAct>(
        a ? xa : xb, a ? sa : sb, a ? qa : qb, a ? qta : qtb, a ? inva : invb,
        a ? amaxa : amaxb, nullptr, nullptr, a ? rowsa : rowsb, cols, nullptr, nullptr, cols,
        cols, a ? blockIdx.x : blockIdx.x - blocks_a, a ? blocks_a : gridDim.x - blocks_a);
}
