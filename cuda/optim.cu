// optim.cu — fused multi-tensor optimizer steps (AdamW, SGD with momentum) and the global
// gradient norm for clipping: every parameter in one or a few launches, no host sync.
//
// Maths (torch.optim.AdamW / torch.optim.SGD with dampening 0, no amsgrad), per element, in
// float, t = the steps taken including this one:
//   g = grad * coef, coef = min(1, max_norm / (||all grads||_2 + 1e-6)) (torch's
//       clip_grad_norm_; 1 without clipping). A non-finite norm is no error, as in torch:
//       coef is nan (norm nan) or 0 (norm inf: inf * 0 = nan), so the parameters go nan.
//   AdamW: p *= decay,  decay = 1 - lr * wd                       (decoupled weight decay)
//          m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g
//          p -= step_size * m / (sqrt(v) / bc2_sqrt + eps)
//          step_size = lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t)
//   SGD:   d = g + wd * p;  buf = momentum * buf + d;  d = nesterov ? d + momentum * buf : buf
//          p -= lr * d     (buf starts at 0, which equals torch's first buf = d; momentum 0:
//          no buf, d as it is)
// p is the float32 master copy where a parameter has one (16-bit parameters): the parameter
// then gets the master rounded to nearest even. Moments m, v (and buf) are float or bf16,
// computed in float and rounded when stored.
//
// Parameters live in a table built once (int64, n tensors): rows param, master, m (or buf),
// v, numel (a pointer 0 = none), then the chunk starts [n + 1] (a tensor of numel elements
// has ceil(numel / kChunk) chunks). Gradients are fresh arrays every step: their pointers
// come BY VALUE in a GradPack kernel argument (kPack pointers, 2 KB), so a step makes no
// host-to-device copy and a CUDA graph captures them with the launch. A launch covers the
// tensors [first, first + count) of one (param, grad) dtype pair: one block of kThreads per
// chunk, its tensor found by a binary search over the chunk starts.
// A step: grad_sumsq per launch group (clipping only: the sum of squares of each chunk into
// partials[chunk]), optim_prologue (1 block of 1024: the norm from the partials in a fixed
// order, so it is deterministic; step += 1; lr from the schedule; the step's scalars), then
// adamw_update / sgd_update per launch group, which read the scalars sc[]:
//   sc = {lr, coef, step_size, bc2_sqrt, decay, grad_norm}
#include "common.cuh"

constexpr int kThreads = 256;
constexpr int kIlp = 4;  // elements per thread in flight: loads batched before the maths
constexpr int kChunk = 4096;
constexpr int kPack = 256;
constexpr int kRows = 5;  // param, master, m, v, numel

struct GradPack {
    const void* g[kPack];
};

// The chunk of this block: tensor index (into the table), its element range [begin, end).
struct Chunk {
    int t;
    long long begin, end;
};

__device__ __forceinline__ Chunk find_chunk(const long long* table, int n, int first,
                                            int count) {
    const long long* starts = table + kRows * n;
    const long long c = starts[first] + blockIdx.x;
    int lo = first, hi = first + count - 1;  // the last tensor whose start <= c (an empty
    while (lo < hi) {                        // tensor's start equals the next one's)
        const int mid = (lo + hi + 1) >> 1;
        if (starts[mid] <= c) lo = mid; else hi = mid - 1;
    }
    const long long numel = table[4 * n + lo];
    const long long begin = (c - starts[lo]) * kChunk;
    return {lo, begin, begin + kChunk < numel ? begin + kChunk : numel};
}

// ---- the gradient norm --------------------------------------------------------------------
template <typename G>
__global__ void grad_sumsq(const long long* __restrict__ table, int n, GradPack grads,
                           int first, int count, float* __restrict__ partials) {
    const Chunk ck = find_chunk(table, n, first, count);
    const G* __restrict__ g = static_cast<const G*>(grads.g[ck.t - first]);
    float s = 0.f;
    for (long long i = ck.begin + threadIdx.x; i < ck.end; i += kThreads) {
        const float x = to_float(g[i]);
        s += x * x;
    }
    s = block_sum(s);
    if (threadIdx.x == 0) partials[table[5 * n + first] + blockIdx.x] = s;
}

__device__ __forceinline__ double block_sum_double(double v) {
    __shared__ double part[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    v = (threadIdx.x < (blockDim.x >> 5)) ? part[threadIdx.x] : 0.0;
    if (threadIdx.x < 32)
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;  // valid in thread 0
}

// warmup_cosine (tecupy/optim/schedule.py) at the 0-based step s, in double.
__device__ double warmup_cosine(long long s, double base, double min_lr, long long warmup,
                                long long total) {
    if (s < warmup) return base * ((double)(s + 1) / (double)warmup);
    if (s >= total) return min_lr;
    const double progress = (double)(s - warmup) / (double)(total - warmup);
    return min_lr + 0.5 * (base - min_lr) * (1.0 + cos(3.141592653589793 * progress));
}

// One block of 1024 threads. clip 0: coef 1 (partials unread, grad_norm left as it was).
// schedule 0: lr as set (set_lr); 1: warmup_cosine(step, base_lr, warmup, total, min_lr).
__global__ void optim_prologue(const float* __restrict__ partials, long long nchunks, int clip,
                               float max_norm, int* step, float* lr, float* sc, double beta1,
                               double beta2, double wd, int schedule, double base_lr,
                               double min_lr, long long warmup, long long total) {
    double s = 0.0;
    for (long long i = threadIdx.x; clip && i < nchunks; i += blockDim.x) s += partials[i];
    s = block_sum_double(s);
    if (threadIdx.x != 0) return;
    const long long t = (long long)step[0] + 1;
    double lr_t = schedule ? warmup_cosine(t - 1, base_lr, min_lr, warmup, total) : lr[0];
    float coef = 1.f;
    if (clip) {
        const float norm = (float)sqrt(s);
        coef = max_norm / (norm + 1e-6f);
        coef = coef > 1.f ? 1.f : coef;  // (a nan stays nan, as torch.clamp)
        sc[5] = norm;
    }
    step[0] = (int)t;
    lr[0] = (float)lr_t;
    lr_t = (float)lr_t;  // the kernels and the reference use the float32 lr
    sc[0] = (float)lr_t;
    sc[1] = coef;
    sc[2] = (float)(lr_t / (1.0 - pow(beta1, (double)t)));
    sc[3] = (float)sqrt(1.0 - pow(beta2, (double)t));
    sc[4] = (float)(1.0 - lr_t * wd);
}

// ---- the updates ---------------------------------------------------------------------------
// Every operation rounded on its own, in the reference's order (optim/reference.py): left to
// ptxas, p * decay was fused into the update's subtraction in some unrolled copies of
// adamw_update<float, float, ...> and in none of <float, __nv_bfloat16, ...>'s, so the same
// gradient in float32 (a ZeroOptimizer shard of FP8 weights) or in bf16 (the plain step) gave
// masters a few ulps apart.
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }

template <typename P, typename G, typename M>
__global__ void __launch_bounds__(kThreads)
adamw_update(const long long* __restrict__ table, int n, GradPack grads, int first, int count,
             const float* __restrict__ sc, float beta1, float beta2, float eps) {
    const Chunk ck = find_chunk(table, n, first, count);
    P* __restrict__ param = reinterpret_cast<P*>(table[ck.t]);
    float* __restrict__ master = reinterpret_cast<float*>(table[n + ck.t]);
    M* __restrict__ m = reinterpret_cast<M*>(table[2 * n + ck.t]);
    M* __restrict__ v = reinterpret_cast<M*>(table[3 * n + ck.t]);
    const G* __restrict__ grad = static_cast<const G*>(grads.g[ck.t - first]);
    const float coef = sc[1], step_size = sc[2], bc2_sqrt = sc[3], decay = sc[4];
    for (long long base = ck.begin + threadIdx.x; base < ck.end; base += kThreads * kIlp) {
        float g[kIlp], p[kIlp], mm[kIlp], vv[kIlp];
#pragma unroll
        for (int j = 0; j < kIlp; ++j) {
            const long long i = base + j * kThreads;
            if (i < ck.end) {
                g[j] = mul(to_float(grad[i]), coef);
                p[j] = master ? master[i] : to_float(param[i]);
                mm[j] = to_float(m[i]);
                vv[j] = to_float(v[i]);
            }
        }
#pragma unroll
        for (int j = 0; j < kIlp; ++j) {
            const long long i = base + j * kThreads;
            if (i >= ck.end) continue;
            p[j] = mul(p[j], decay);
            mm[j] = add(mul(beta1, mm[j]), mul(1.f - beta1, g[j]));
            vv[j] = add(mul(beta2, vv[j]), mul(mul(1.f - beta2, g[j]), g[j]));
            const float denom = add(__fdiv_rn(__fsqrt_rn(vv[j]), bc2_sqrt), eps);
            p[j] = sub(p[j], mul(step_size, __fdiv_rn(mm[j], denom)));
            m[i] = from_float<M>(mm[j]);
            v[i] = from_float<M>(vv[j]);
            if (master) master[i] = p[j];
            param[i] = from_float<P>(p[j]);
        }
    }
}

// momentum 0: no buffer (its table row is 0).
template <typename P, typename G>
__global__ void __launch_bounds__(kThreads)
sgd_update(const long long* __restrict__ table, int n, GradPack grads, int first, int count,
           const float* __restrict__ sc, float momentum, float wd, int nesterov) {
    const Chunk ck = find_chunk(table, n, first, count);
    P* __restrict__ param = reinterpret_cast<P*>(table[ck.t]);
    float* __restrict__ master = reinterpret_cast<float*>(table[n + ck.t]);
    float* __restrict__ buf = reinterpret_cast<float*>(table[2 * n + ck.t]);
    const G* __restrict__ grad = static_cast<const G*>(grads.g[ck.t - first]);
    const float lr = sc[0], coef = sc[1];
    for (long long base = ck.begin + threadIdx.x; base < ck.end; base += kThreads * kIlp) {
        float g[kIlp], p[kIlp], b[kIlp];
#pragma unroll
        for (int j = 0; j < kIlp; ++j) {
            const long long i = base + j * kThreads;
            if (i < ck.end) {
                g[j] = mul(to_float(grad[i]), coef);
                p[j] = master ? master[i] : to_float(param[i]);
                b[j] = buf ? buf[i] : 0.f;
            }
        }
#pragma unroll
        for (int j = 0; j < kIlp; ++j) {
            const long long i = base + j * kThreads;
            if (i >= ck.end) continue;
            float d = add(g[j], mul(wd, p[j]));
            if (buf) {
                b[j] = add(mul(momentum, b[j]), d);
                buf[i] = b[j];
                d = nesterov ? add(d, mul(momentum, b[j])) : b[j];
            }
            p[j] = sub(p[j], mul(lr, d));
            if (master) master[i] = p[j];
            param[i] = from_float<P>(p[j]);
        }
    }
}
