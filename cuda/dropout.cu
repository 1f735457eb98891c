// dropout.cu — dropout with a Philox4x32-10 generator, fused with the residual add.
//
// Element i draws word (i % 4) of philox(counter = (i / 4, offset), key = seed);
// u = (word >> 8) 2^-24 in [0, 1); keep = u >= p;
//   dropout_fwd: y[i] = x[i] keep factor (+ residual[i] when RES), keep[i] stored as a byte
//   dropout_bwd: dx[i] = dy[i] keep[i] factor
// factor = 1 / (1 - p) (0 when p = 1), computed on the host in float; seed_ptr: see
// philox_key (common.cuh). Same bits as the
// NumPy reference (tecupy/reference/dropout.py). Launch: 1-D grid-stride over groups of
// VEC = 4 elements (one Philox call each; n % 4 == 0) or single elements (VEC = 1).
#include "common.cuh"

template <typename T, int VEC, bool RES>
__global__ void dropout_fwd(const T* __restrict__ x, const T* __restrict__ residual,
                            T* __restrict__ y, unsigned char* __restrict__ keep, long long n,
                            float p, float factor, unsigned long long seed,
                            const unsigned long long* __restrict__ seed_ptr,
                            unsigned long long offset) {
    PDL_WAIT();
    const uint2 key = philox_key(seed, seed_ptr);
    for (long long i = VEC * (blockIdx.x * (long long)blockDim.x + threadIdx.x); i < n;
         i += (long long)VEC * gridDim.x * blockDim.x) {
        const unsigned long long g = i >> 2;
        const uint4 w4 = philox4x32_10(make_uint4((unsigned)g, (unsigned)(g >> 32),
                                                  (unsigned)offset, (unsigned)(offset >> 32)),
                                       key);
        const unsigned w[4] = {w4.x, w4.y, w4.z, w4.w};
        const Vec<T, VEC> a = load_vec<VEC>(x + i);
        Vec<T, VEC> r, out;
        Vec<unsigned char, VEC> k;
        if (RES) r = load_vec<VEC>(residual + i);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const bool kj = keep_word(w[(i + j) & 3], p);
            // __fmul_rn: no fused multiply-add, so the rounding is the reference's
            float v = __fmul_rn(to_float(a.v[j]), kj ? factor : 0.f);
            if (RES) v += to_float(r.v[j]);
            out.v[j] = from_float<T>(v);
            k.v[j] = kj;
        }
        store_vec<VEC>(y + i, out);
        store_vec<VEC>(keep + i, k);
    }
}

template <typename T, int VEC>
__global__ void dropout_bwd(const T* __restrict__ dy, const unsigned char* __restrict__ keep,
                            T* __restrict__ dx, long long n, float factor) {
    PDL_WAIT();
    for (long long i = VEC * (blockIdx.x * (long long)blockDim.x + threadIdx.x); i < n;
         i += (long long)VEC * gridDim.x * blockDim.x) {
        const Vec<T, VEC> d = load_vec<VEC>(dy + i);
        const Vec<unsigned char, VEC> k = load_vec<VEC>(keep + i);
        Vec<T, VEC> out;
#pragma unroll
        for (int j = 0; j < VEC; ++j)
            out.v[j] = from_float<T>(to_float(d.v[j]) * (k.v[j] ? factor : 0.f));
        store_vec<VEC>(dx + i, out);
    }
}

// add: y = a + b (the residual add with no dropout, and the tape's sum of two gradients),
// float32 sum rounded once to T, as the reference. ROW: b is a row of nb elements (nb %
// VEC == 0) broadcast over a's rows (a bias added after a tensor-parallel reduction):
// b[i % nb]; else b is a's shape (nb unused). RES: then + r[i] (a's shape), the rounded sum
// plus r rounded again: two adds' bits in one pass. Launch as dropout_bwd (n % VEC == 0).
template <typename T, int VEC, bool ROW, bool RES>
__global__ void add(const T* __restrict__ a, const T* __restrict__ b, const T* __restrict__ r,
                    T* __restrict__ y, long long n, long long nb) {
    PDL_WAIT();
    for (long long i = VEC * (blockIdx.x * (long long)blockDim.x + threadIdx.x); i < n;
         i += (long long)VEC * gridDim.x * blockDim.x) {
        const Vec<T, VEC> x = load_vec<VEC>(a + i), z = load_vec<VEC>(b + (ROW ? i % nb : i));
        Vec<T, VEC> out, w;
        if (RES) w = load_vec<VEC>(r + i);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            out.v[j] = from_float<T>(to_float(x.v[j]) + to_float(z.v[j]));
            if (RES) out.v[j] = from_float<T>(to_float(out.v[j]) + to_float(w.v[j]));
        }
        store_vec<VEC>(y + i, out);
    }
}
