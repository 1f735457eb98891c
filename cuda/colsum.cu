// colsum.cu — column sums of a matrix in float: the bias gradients (dbias = sum over rows of
// dy of a linear, of dx of an activation with a bias, of x in cast_transpose_dbias).
//
// col_sum: out[s, c] = sum of x[r, c] over the rows r of split s (rows_per_split each),
// accumulated in float and rounded once to OUTT (nearest even: what a cast of the float sum
// gives). The Python side (tecupy/kernels/colsum.py) runs it twice: x [rows, ncols] -> float
// partials [splits, ncols] -> their sum [ncols] in dbias's own type (no cast launch after);
// two fixed stages instead of atomics, so dbias is deterministic. Launched with PDL: waits
// for the kernel before it (which wrote x) before touching memory.
// Launch: blocks of (32, 8) threads, grid (ceil(ncols / 32), splits); rows of threads stride
// the rows and meet in shared memory.
#include "common.cuh"

template <typename T, typename OUTT>
__global__ void col_sum(const T* __restrict__ x, OUTT* __restrict__ out, long long rows,
                        int ncols, long long rows_per_split) {
    __shared__ float acc[8][33];
    PDL_WAIT();
    const int c = blockIdx.x * 32 + threadIdx.x;
    const long long r0 = blockIdx.y * rows_per_split;
    const long long r1 = r0 + rows_per_split < rows ? r0 + rows_per_split : rows;
    float a = 0.f;
    if (c < ncols)
        for (long long r = r0 + threadIdx.y; r < r1; r += 8) a += to_float(x[r * ncols + c]);
    acc[threadIdx.y][threadIdx.x] = a;
    __syncthreads();
    if (threadIdx.y == 0 && c < ncols) {
        float t = 0.f;
#pragma unroll
        for (int y = 0; y < 8; ++y) t += acc[y][threadIdx.x];
        out[(long long)blockIdx.y * ncols + c] = from_float<OUTT>(t);
    }
}
