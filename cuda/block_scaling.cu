// block_scaling.cu — FP8 block quantization (Float8BlockScaling): one float32 scale per
// block of 128 values, from the block's own amax, as Transformer Engine's
// quantize_transpose_{vector,square}_blockwise.cu with compute_scale_from_amax.
//
// Per block (reference/block_scaling.py is the spec, bit for bit):
//   amax  = max |x| over the block (fmaxf: NaN ignored; past the tensor's edge: 0)
//   a     = max(amax, eps);  scale = 1 where a is 0, inf or NaN, else fp8_max / a (IEEE),
//           an infinite quotient -> inf_value (the input dtype's largest finite value),
//           POW2: mantissa bits cleared (a power of two, rounded down)
//   q     = F8(x * scale)  (round to nearest even, __NV_SATFINITE; NaN -> 0x7F)
//   scale_inv = 1 / scale  (IEEE float32, subnormals kept: no fast math)
//
// block_quantize<T, F8, TILE2D>: x [rows, cols] of T (float, __half, __nv_bfloat16) ->
//   q [rows, cols] and, with qt != nullptr, the column-wise copy qt [cols, rows], from ONE
//   read of x. One CUDA block of 256 threads per 128 x 128 tile (grid: cols / 128 tiles in
//   x, rows / 128 in y, rounded up). Thread t holds rows 8a .. 8a+7 (a = t / 16) of columns
//   8b .. 8b+7 (b = t % 16) of its tile in registers: 64 values (Piece).
//   !TILE2D (1x128 blocks): a row's amax over the tile's 128 columns is a shuffle among the
//     16 lanes of one a; a column's over the 128 rows is a shuffle (lanes b, b + 16), then
//     the 8 warps' partials through shared memory.
//       s [ceil(cols / 128), rows]:  s[tile x][row]   = 1 / the row's scale in this tile
//       st [ceil(rows / 128), cols]: st[tile y][col]  = 1 / the column's scale in this tile
//   TILE2D (128x128 blocks, weights): one amax for the whole tile (a block reduction);
//       s [ceil(rows / 128), ceil(cols / 128)], st its transpose [ceil(cols / 128), ...].
//   The column-wise codes go through shared memory: thread (a, b) writes, for each of its
//   8 columns, its 8 row bytes as one 8-byte word at tt[col][a ^ b] (XOR-swizzled: a warp's
//   stores hit 16 distinct 8-byte bank pairs), then each warp copies two 128-byte rows of
//   tt to qt.
//   DBIAS (1x128 blocks with qt: the backward's cast of dy): also the float32 sums of each
//   column over the tile's 128 rows, part [ceil(rows / 128), cols] (part[tile y][col]),
//   from the same registers (lanes b, b + 16, then the 8 warps through shared memory, as
//   the column amax); kernels/colsum.py's col_sum adds the partials up (dbias), as
//   cast_transpose_dbias's.
//   ACT (a struct of act_math.cuh, or void): x is h, and what is quantized is the
//   activation's output act(h + abias) rounded to T, bit for bit act.cu's act_fwd with a T
//   output (the same f, FAST where T is 16-bit) then this kernel: no [rows, cols] array of
//   it in memory (the input of the GEMM after an activation). abias: [cols] or null.
//   BWD (with ACT): x is dy and what is quantized is dx = dy * act'(h + abias) rounded to T,
//   bit for bit act_bwd then this kernel (with DBIAS, dbias of dx: fc1's dy in the
//   backward, from dy and h in one pass).
//   Needs rows % 8 == 0 and cols % 8 == 0 (8-byte code stores, whole 8 x 8 thread pieces);
//   x 32-byte aligned (two 16-byte loads of float per 8 values).
#include "act_math.cuh"
#include "common.cuh"

template <typename A> struct HasAct { static constexpr bool value = true; };
template <> struct HasAct<void> { static constexpr bool value = false; };

// v[0..7] <- act(v + bias) rounded to T (act_fwd's arithmetic with a T output)
template <typename ACT, typename T>
__device__ __forceinline__ void activate(float (&v)[8], const float (&b)[8]) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
        v[j] = to_float(from_float<T>(ACT::template f<(sizeof(T) < 4)>(v[j] + b[j])));
}

// ---- the scale -------------------------------------------------------------------------------
template <bool POW2>
__device__ __forceinline__ float block_scale(float amax, float fp8_max, float eps,
                                             float inf_value) {
    const float a = amax < eps ? eps : amax;  // (a NaN amax fails the test: kept)
    if (isinf(a) || isnan(a) || a == 0.f) return 1.f;
    float s = __fdiv_rn(fp8_max, a);
    if (isinf(s)) s = inf_value;
    if (POW2) s = __uint_as_float(__float_as_uint(s) & 0xFF800000u);
    return s;
}

// The 8 x 8 values a thread holds: for a 16-bit T the loaded vectors themselves (32
// registers rather than 64 floats), unpacked where a row or a column is used; for float
// the floats. (Packed alone, ptxas unpacked them early and took more registers: see
// kMinBlocks.)
template <typename T> struct Piece {
    Vec<T, 8> r[8];
    __device__ __forceinline__ void load(int i, const T* p) { r[i] = load_vec<8>(p); }
    __device__ __forceinline__ void row(int i, float (&f)[8]) const { unpack(r[i], f); }
    __device__ __forceinline__ void set_row(int i, const float (&f)[8]) {  // (exact: T's)
#pragma unroll
        for (int j = 0; j < 8; ++j) r[i].v[j] = from_float<T>(f[j]);
    }
};
template <> struct Piece<float> {
    float v[8][8];
    __device__ __forceinline__ void load(int i, const float* p) {
        const Vec<float, 4> lo = load_vec<4>(p), hi = load_vec<4>(p + 4);
#pragma unroll
        for (int j = 0; j < 4; ++j) v[i][j] = lo.v[j], v[i][4 + j] = hi.v[j];
    }
    __device__ __forceinline__ void row(int i, float (&f)[8]) const {
#pragma unroll
        for (int j = 0; j < 8; ++j) f[j] = v[i][j];
    }
    __device__ __forceinline__ void set_row(int i, const float (&f)[8]) {
#pragma unroll
        for (int j = 0; j < 8; ++j) v[i][j] = f[j];
    }
};

// 8 codes (one 8-byte word pair) of v[0..7] * s[0..7]
template <typename F8>
__device__ __forceinline__ uint2 codes8(const float (&v)[8], const float (&s)[8]) {
    return make_uint2(fp8x4<F8>(v[0] * s[0], v[1] * s[1], v[2] * s[2], v[3] * s[3]),
                      fp8x4<F8>(v[4] * s[4], v[5] * s[5], v[6] * s[6], v[7] * s[7]));
}

// ---- block quantize, both copies from one read -------------------------------------------------
// Blocks per SM asked of ptxas (H100, session 19, [8192, 4096] bf16 unless said): with 1 the
// packed tile took 118-128 registers (2 blocks) and the dbias kernel ran 106 us against 67
// for the float tile; with 2 every variant is at the float tile's time or better (plain 64,
// dbias 68 us, ~2 TB/s), the activation's [8192, 16384] 312 us against 397; with 3 (80
// registers, a few spilled) the activation's 286 but dbias 91; with 4, all slower.
// The activation's backward (BWD) holds h's row beside dy's: 2.
template <typename ACT, bool BWD>
constexpr int kMinBlocks = HasAct<ACT>::value && !BWD ? 3 : 2;

template <typename T, typename F8, bool TILE2D, bool POW2, bool DBIAS = false,
          typename ACT = void, bool BWD = false>
__global__ void __launch_bounds__(256, kMinBlocks<ACT, BWD>)
block_quantize(const T* __restrict__ x, unsigned char* __restrict__ q,
               float* __restrict__ s, unsigned char* __restrict__ qt, float* __restrict__ st,
               int rows, int cols, float fp8_max, float eps, float inf_value,
               float* __restrict__ part, const T* __restrict__ abias,
               const T* __restrict__ h) {
    static_assert(!DBIAS || !TILE2D, "dbias: the gradient's 1x128 blocks, with qt");
    static_assert(!BWD || HasAct<ACT>::value, "BWD: an activation's backward");
    PDL_WAIT();
    __shared__ uint2 tt[128][16];      // column-wise codes: tt[col][(row / 8) ^ b]
    __shared__ float colmax[8][128];   // per warp: its 16 rows' amax of each column
    const int a = threadIdx.x >> 4, b = threadIdx.x & 15, warp = threadIdx.x >> 5;
    const int r0 = blockIdx.y * 128, c0 = blockIdx.x * 128;
    const int r = r0 + 8 * a, c = c0 + 8 * b;
    const bool in = r < rows && c < cols;  // (rows, cols % 8 == 0: all 64 values or none)
    Piece<T> v;
    float bv[8];  // the activation's bias of this thread's 8 columns
#pragma unroll
    for (int j = 0; j < 8; ++j) bv[j] = HasAct<ACT>::value && abias != nullptr && in
                                            ? to_float(abias[c + j]) : 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        if (in) {
            v.load(i, x + (long long)(r + i) * cols + c);
        } else {
            const float zero[8] = {};
            v.set_row(i, zero);
        }
    }
    if constexpr (BWD) {  // dx = dy * act'(h + bias) rounded to T (act.cu's act_bwd)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            if (!in) continue;
            Piece<T> hp;  // (one row of it live at a time)
            hp.load(i, h + (long long)(r + i) * cols + c);
            float f[8], g[8];
            v.row(i, f);
            hp.row(i, g);
#pragma unroll
            for (int j = 0; j < 8; ++j)
                f[j] = to_float(from_float<T>(f[j] *
                                              ACT::template df<(sizeof(T) < 4)>(g[j] + bv[j])));
            v.set_row(i, f);
        }
    } else if constexpr (HasAct<ACT>::value) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float f[8];
            v.row(i, f);
            activate<ACT, T>(f, bv);
            v.set_row(i, f);
        }
    }
    PDL_TRIGGER();
    float rs[8], cs[8];  // the scales of this thread's 8 rows and of its 8 columns
    if constexpr (TILE2D) {
        float m = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float f[8];
            v.row(i, f);
#pragma unroll
            for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(f[j]));
        }
        const float sc = block_scale<POW2>(block_max(m), fp8_max, eps, inf_value);
#pragma unroll
        for (int i = 0; i < 8; ++i) rs[i] = cs[i] = sc;
        if (threadIdx.x == 0) {
            const int tx = blockIdx.x, ty = blockIdx.y, nx = gridDim.x, ny = gridDim.y;
            s[ty * nx + tx] = 1.f / sc;
            if (st != nullptr) st[tx * ny + ty] = 1.f / sc;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) {  // row amax: the 16 lanes of this a
            float m = 0.f, f[8];
            v.row(i, f);
#pragma unroll
            for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(f[j]));
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
            rs[i] = block_scale<POW2>(m, fp8_max, eps, inf_value);
        }
        if (b == 0 && r < rows) {  // 8 consecutive floats of s's row for this tile
#pragma unroll
            for (int i = 0; i < 8; ++i) s[(long long)blockIdx.x * rows + r + i] = 1.f / rs[i];
        }
        if (qt != nullptr) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {  // column amax: lanes b, b + 16, then the 8 warps
                float m = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    float f[8];
                    v.row(i, f);
                    m = fmaxf(m, fabsf(f[j]));
                }
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
                if ((threadIdx.x & 31) < 16) colmax[warp][8 * b + j] = m;
            }
            __syncthreads();
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                float m = 0.f;
#pragma unroll
                for (int w = 0; w < 8; ++w) m = fmaxf(m, colmax[w][8 * b + j]);
                cs[j] = block_scale<POW2>(m, fp8_max, eps, inf_value);
            }
            if (a == 0 && c < cols) {
#pragma unroll
                for (int j = 0; j < 8; ++j) st[(long long)blockIdx.y * cols + c + j] = 1.f / cs[j];
            }
            if constexpr (DBIAS) {  // (rows past the edge hold zeros: they add nothing)
                __syncthreads();  // every warp has read colmax: its rows take the sums
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    float t = 0.f;
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        float f[8];
                        v.row(i, f);
                        t += f[j];
                    }
                    t += __shfl_xor_sync(0xffffffffu, t, 16);
                    if ((threadIdx.x & 31) < 16) colmax[warp][8 * b + j] = t;
                }
                __syncthreads();
                if (a == 0 && c < cols) {
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        float t = 0.f;
#pragma unroll
                        for (int w = 0; w < 8; ++w) t += colmax[w][8 * b + j];
                        part[(long long)blockIdx.y * cols + c + j] = t;
                    }
                }
            }
        }
    }
    if (in) {  // row-wise codes: 8 bytes per row
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float sv[8], f[8];
            v.row(i, f);
#pragma unroll
            for (int j = 0; j < 8; ++j) sv[j] = rs[i];
            *reinterpret_cast<uint2*>(q + (long long)(r + i) * cols + c) = codes8<F8>(f, sv);
        }
    }
    if (qt == nullptr) return;
#pragma unroll
    for (int j = 0; j < 8; ++j) {  // column 8b + j: its 8 rows' codes as one word
        float col[8], sv[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float f[8];
            v.row(i, f);
            col[i] = f[j], sv[i] = cs[j];
        }
        tt[8 * b + j][a ^ b] = codes8<F8>(col, sv);
    }
    __syncthreads();
    // each warp: tile columns 2 at a time, 16 lanes per column, 8 bytes (8 rows) per lane
    const int lane = threadIdx.x & 31;
    for (int cc = 2 * warp + (lane >> 4); cc < 128; cc += 16) {
        const int k = lane & 15;  // 8-row group
        if (c0 + cc < cols && r0 + 8 * k < rows)
            *reinterpret_cast<uint2*>(qt + (long long)(c0 + cc) * rows + r0 + 8 * k) =
                tt[cc][k ^ (cc >> 3)];
    }
}
