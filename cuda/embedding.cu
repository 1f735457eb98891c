// embedding.cu — token embedding: a gather forward and a deterministic scatter-add backward.
//
// Shapes: weight / dweight [V, D], ids [n] (int or long long), out / dout [n, D].
//
// embedding_fwd: out[t, :] = weight[ids[t], :]. An id outside [0, V) gives a row of NaN: the
//   host never reads CuPy ids back (that would synchronise every call), so the bad id shows
//   as a NaN loss, never as another row's data or an illegal address.
//   Launch: blocks of (bx, by) threads, bx * by = 128: x over the VEC-element vectors of a
//   row, y over tokens; grid-stride over tokens.
//
// embedding_keys: key[t] = v * n + t, v = ids[t] when in [0, V), else V. The keys are unique,
//   so ANY sort of them gives one order: tokens grouped by id, ascending t within a group.
//   (Needs (V + 1) * n < 2**63.) Launch: 1-D grid-stride.
//
// embedding_bwd: dweight[v, c] = sum of dout[t, c] over the sorted keys of row v, added one
//   after the other in ascending t, in float (double for double). No atomics: every run adds
//   in the same order, and that order is the NumPy reference's np.add.at in float32, so the
//   two agree bit for bit. Rows no token picked get 0; out-of-range ids (v = V) add nowhere.
//   Launch: grid (V, ceil(D / 128)), 128 threads, a thread per column; each block finds its
//   row's keys [lo, hi) by binary search.
#include "common.cuh"

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

template <typename T> __device__ __forceinline__ typename Acc<T>::type widen(T v) {
    return to_float(v);
}
template <> __device__ __forceinline__ double widen(double v) { return v; }
template <typename T> __device__ __forceinline__ T narrow(float v) { return from_float<T>(v); }
template <typename T> __device__ __forceinline__ T narrow(double v) { return v; }

// ---- forward: gather ---------------------------------------------------------------------
template <typename T, typename I, int VEC>
__global__ void embedding_fwd(const T* __restrict__ weight, const I* __restrict__ ids,
                              T* __restrict__ out, long long n, long long V, int D) {
    PDL_WAIT();
    const int nvec = D / VEC;
    for (long long t = (long long)blockIdx.x * blockDim.y + threadIdx.y; t < n;
         t += (long long)gridDim.x * blockDim.y) {
        const long long id = (long long)ids[t];
        const bool ok = id >= 0 && id < V;
        const T* src = weight + (ok ? id : 0) * D;
        T* dst = out + t * D;
        for (int j = threadIdx.x; j < nvec; j += blockDim.x) {
            Vec<T, VEC> v = load_vec<VEC>(src + (long long)j * VEC);
            if (!ok) {
#pragma unroll
                for (int k = 0; k < VEC; ++k) v.v[k] = narrow<T>(__int_as_float(0x7fc00000));
            }
            store_vec<VEC>(dst + (long long)j * VEC, v);
        }
    }
}

// ---- backward: sort keys, then one ordered sum per vocabulary row ------------------------
template <typename I>
__global__ void embedding_keys(const I* __restrict__ ids, long long* __restrict__ keys,
                               long long n, long long V) {
    PDL_WAIT();
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < n;
         t += (long long)gridDim.x * blockDim.x) {
        const long long id = (long long)ids[t];
        keys[t] = (id >= 0 && id < V ? id : V) * n + t;
    }
}

// The first index i in [0, n) with keys[i] >= k (n when none).
__device__ __forceinline__ long long lower_bound(const long long* keys, long long n,
                                                 long long k) {
    long long lo = 0, hi = n;
    while (lo < hi) {
        const long long mid = (lo + hi) >> 1;
        if (keys[mid] < k) lo = mid + 1; else hi = mid;
    }
    return lo;
}

template <typename T>
__global__ void embedding_bwd(const T* __restrict__ dout, const long long* __restrict__ keys,
                              T* __restrict__ dweight, long long n, int D) {
    PDL_WAIT();
    using A = typename Acc<T>::type;
    const long long v = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= D) return;
    const long long base = v * n, lo = lower_bound(keys, n, base);
    const long long hi = lower_bound(keys, n, base + n);
    A a = 0;
    long long i = lo;
    // Four loads in flight, added in order: the sum stays the sequential one.
    for (; i + 4 <= hi; i += 4) {
        T x[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) x[k] = dout[(keys[i + k] - base) * D + c];
#pragma unroll
        for (int k = 0; k < 4; ++k) a += widen(x[k]);
    }
    for (; i < hi; ++i) a += widen(dout[(keys[i] - base) * D + c]);
    dweight[v * D + c] = narrow<T>(a);
}
