// act_math.cuh — the activations' maths in float (Transformer Engine's definitions): one
// struct per function, with f(x) and its derivative df(x). Shared by cuda/act.cu and the FP8
// GEMM's gelu epilogue (cutlass_templates/fp8_gemm.cu), so the two cannot drift; the `cuda`
// field of a row of tecupy/activation_table.py names the struct. No includes and only
// builtins: it compiles inside the CUTLASS template as well as beside common.cuh.
//
// gelu (tanh): 0.5 x (1 + tanh(u)), u = k0 (x + k1 x^3); relu: max(x, 0); silu: x / (1 + e^-x).
//
// FAST (16-bit and FP8 results): gelu as x sigmoid(2u) (0.5 (1 + tanh(u)) = sigmoid(2u)) and
// silu's sigmoid from ex2.approx and a fast division: ~1e-7 relative error, far below the
// result's rounding, in ~8 instructions where tanhf / expf took ~25 (gelu + bias -> FP8 was
// issue-bound). float32 results (and the GEMM epilogue) keep tanhf / expf.
#pragma once

__device__ __forceinline__ float fast_sigmoid(float z) { return __fdividef(1.f, 1.f + __expf(-z)); }

struct Gelu {
    static constexpr float kK0 = 0.7978845608028654f, kK1 = 0.044715f;  // sqrt(2/pi), cubic

    template <bool FAST> __device__ static __forceinline__ float f(float x) {
        const float u = kK0 * x * (1.f + kK1 * x * x);
        return FAST ? x * fast_sigmoid(2.f * u) : 0.5f * x * (1.f + tanhf(u));
    }

    template <bool FAST> __device__ static __forceinline__ float df(float x) {
        const float u = kK0 * x * (1.f + kK1 * x * x), du = kK0 * (1.f + 3.f * kK1 * x * x);
        if (FAST) {  // 0.5 (1 + t) = s, 0.5 (1 - t^2) = 2 s (1 - s)
            const float s = fast_sigmoid(2.f * u);
            return s + 2.f * x * s * (1.f - s) * du;
        }
        const float t = tanhf(u);
        return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * du;
    }
};

struct Relu {
    template <bool FAST> __device__ static __forceinline__ float f(float x) {
        return fmaxf(x, 0.f);
    }

    template <bool FAST> __device__ static __forceinline__ float df(float x) {
        return x > 0.f ? 1.f : 0.f;
    }
};

struct Silu {
    template <bool FAST> __device__ static __forceinline__ float f(float x) {
        return FAST ? x * fast_sigmoid(x) : x / (1.f + expf(-x));
    }

    template <bool FAST> __device__ static __forceinline__ float df(float x) {
        const float s = FAST ? fast_sigmoid(x) : 1.f / (1.f + expf(-x));
        return s * (1.f + x * (1.f - s));
    }
};
