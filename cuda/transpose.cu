// transpose_u8: out [cols, rows] = in [rows, cols]^T, one byte per element: the column-wise
// copy of an FP8 tensor whose cast made none (the FP8 outputs of the fused norm and
// activation kernels, which wgrad needs transposed). rows % 16 == 0 and cols % 16 == 0 (FP8
// GEMM operands are). Launch: 256 threads per 64 x 64 tile, grid (ceil(cols / 64),
// ceil(rows / 64)). Each thread loads one 16-byte row chunk, the tile turns in shared
// memory, and each thread stores one 16-byte chunk of an output row. Launched with PDL
// (tecupy/kernels/transpose.py's Launcher): waits for the kernel that wrote `in` first.
#include "common.cuh"

__global__ void __launch_bounds__(256)
transpose_u8(const unsigned char* __restrict__ in, unsigned char* __restrict__ out, int rows,
             int cols) {
    __shared__ unsigned tile[64][64 / 4 + 1];  // words; the pad spreads a column over banks
    PDL_WAIT();
    const int r0 = blockIdx.y * 64, c0 = blockIdx.x * 64;
    const int tr = threadIdx.x >> 2, tc = (threadIdx.x & 3) * 16;
    if (r0 + tr < rows && c0 + tc < cols) {
        const uint4 v = *reinterpret_cast<const uint4*>(in + (long long)(r0 + tr) * cols + c0 + tc);
        tile[tr][tc / 4] = v.x;
        tile[tr][tc / 4 + 1] = v.y;
        tile[tr][tc / 4 + 2] = v.z;
        tile[tr][tc / 4 + 3] = v.w;
    }
    __syncthreads();
    // output row c0 + tr (input column c0 + tr), bytes of input rows r0 + tc .. r0 + tc + 15
    if (c0 + tr < cols && r0 + tc < rows) {
        unsigned w[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            w[q] = 0;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned word = tile[tc + 4 * q + j][tr >> 2];
                w[q] |= ((word >> (8 * (tr & 3))) & 0xffu) << (8 * j);
            }
        }
        *reinterpret_cast<uint4*>(out + (long long)(c0 + tr) * rows + r0 + tc) =
            make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// copy_u4: y = x in 16-byte words, U loads in flight per thread before its stores, grid-
// stride. Not an op: the benchmark's measure of what a plain stream of SM loads and stores
// reaches (python -m tecupy.bench kernels prints it beside the device-to-device memcpy).
template <int U>
__global__ void __launch_bounds__(256)
copy_u4(const uint4* __restrict__ x, uint4* __restrict__ y, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += U * stride) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (i + u * stride < n) v[u] = x[i + u * stride];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (i + u * stride < n) y[i + u * stride] = v[u];
    }
}
