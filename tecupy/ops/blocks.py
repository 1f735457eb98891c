"""The fused blocks of Transformer Engine: LayerNorm+Linear and LayerNorm+MLP.

Composed from the tecupy ops (each records its own backward); a backend with a fused
kernel can take over the pieces. FP8: `fp8_state` holds one GEMM for layernorm_linear and
two (fc1, fc2) for layernorm_mlp.
"""
from .activation import ACTIVATIONS, GATED, activation as apply_activation
from .linear import linear
from .normalization import normalize


def layernorm_linear(x, ln_weight, ln_bias, weight, bias=None, eps=1e-5,
                     zero_centered_gamma=False, normalization="LayerNorm",
                     return_layernorm_output=False, fp8_state=None):
    """linear(norm(x), weight, bias); norm is LayerNorm or RMSNorm (ln_bias None)."""
    ln_out = normalize(x, ln_weight, ln_bias, eps, zero_centered_gamma, normalization)
    y = linear(ln_out, weight, bias, fp8_state=fp8_state)
    return (y, ln_out) if return_layernorm_output else y


def layernorm_mlp(x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                  eps=1e-5, zero_centered_gamma=False, normalization="LayerNorm",
                  activation="gelu", return_layernorm_output=False, fp8_state=None):
    """fc2(act(fc1(norm(x)))). fc1_weight [ffn, hidden] ([2*ffn, hidden] for the gated
    swiglu/geglu), fc2_weight [hidden, ffn]."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"layernorm_mlp: activation must be one of {ACTIVATIONS}, "
                         f"got {activation!r}")
    ffn = fc1_weight.shape[0] // (2 if activation in GATED else 1)
    if fc2_weight.ndim != 2 or fc2_weight.shape[1] != ffn:
        raise ValueError(f"layernorm_mlp: fc2_weight must be [hidden, {ffn}] for fc1_weight "
                         f"{tuple(fc1_weight.shape)} and {activation}, "
                         f"got {tuple(fc2_weight.shape)}")
    if fp8_state is not None and fp8_state.num_gemms < 2:
        raise ValueError("layernorm_mlp: fp8_state must hold 2 GEMMs (FP8State(num_gemms=2))")
    ln_out = normalize(x, ln_weight, ln_bias, eps, zero_centered_gamma, normalization)
    h = linear(ln_out, fc1_weight, fc1_bias, fp8_state=fp8_state, gemm_index=0)
    y = linear(apply_activation(h, activation), fc2_weight, fc2_bias, fp8_state=fp8_state,
               gemm_index=1)
    return (y, ln_out) if return_layernorm_output else y
