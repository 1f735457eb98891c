"""Linear, LayerNorm, RMSNorm, LayerNormLinear, LayerNormMLP with Transformer Engine's names."""
from ..autocast import FP8State
from ..ops import layernorm, layernorm_linear, layernorm_mlp, linear, rmsnorm
from ..ops.activation import GATED
from .module import Module


class Linear(Module):
    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None,
                 seed=None):
        super().__init__(params_dtype, device, seed)
        self.in_features, self.out_features = in_features, out_features
        self.add_parameter("weight", (out_features, in_features), "normal")
        self.bias = None
        if bias:
            self.add_parameter("bias", (out_features,), "zeros")
        self.fp8_state = FP8State(num_gemms=1)

    def forward(self, x):
        return linear(x, self.weight, self.bias, fp8_state=self.fp8_state)


class _Norm(Module):
    def __init__(self, hidden_size, eps, zero_centered_gamma, params_dtype, device, seed, bias):
        super().__init__(params_dtype, device, seed)
        self.hidden_size, self.eps = hidden_size, eps
        self.zero_centered_gamma = zero_centered_gamma
        self.add_parameter("weight", (hidden_size,), "zeros" if zero_centered_gamma else "ones")
        if bias:
            self.add_parameter("bias", (hidden_size,), "zeros")


class LayerNorm(_Norm):
    def __init__(self, hidden_size, eps=1e-5, zero_centered_gamma=False, params_dtype=None,
                 device=None, seed=None):
        super().__init__(hidden_size, eps, zero_centered_gamma, params_dtype, device, seed, True)

    def forward(self, x):
        return layernorm(x, self.weight, self.bias, self.eps, self.zero_centered_gamma)


class RMSNorm(_Norm):
    def __init__(self, hidden_size, eps=1e-5, zero_centered_gamma=False, params_dtype=None,
                 device=None, seed=None):
        super().__init__(hidden_size, eps, zero_centered_gamma, params_dtype, device, seed, False)

    def forward(self, x):
        return rmsnorm(x, self.weight, self.eps, self.zero_centered_gamma)


def _add_norm_params(module, hidden, normalization, zero_centered_gamma):
    module.add_parameter("layer_norm_weight", (hidden,),
                         "zeros" if zero_centered_gamma else "ones")
    module.layer_norm_bias = None
    if normalization == "LayerNorm":
        module.add_parameter("layer_norm_bias", (hidden,), "zeros")
    elif normalization != "RMSNorm":
        raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")


class LayerNormLinear(Module):
    def __init__(self, in_features, out_features, eps=1e-5, bias=True,
                 normalization="LayerNorm", zero_centered_gamma=False,
                 return_layernorm_output=False, params_dtype=None, device=None, seed=None):
        super().__init__(params_dtype, device, seed)
        self.in_features, self.out_features, self.eps = in_features, out_features, eps
        self.normalization, self.zero_centered_gamma = normalization, zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        _add_norm_params(self, in_features, normalization, zero_centered_gamma)
        self.add_parameter("weight", (out_features, in_features), "normal")
        self.bias = None
        if bias:
            self.add_parameter("bias", (out_features,), "zeros")
        self.fp8_state = FP8State(num_gemms=1)

    def forward(self, x):
        return layernorm_linear(x, self.layer_norm_weight, self.layer_norm_bias, self.weight,
                                self.bias, self.eps, self.zero_centered_gamma,
                                self.normalization, self.return_layernorm_output,
                                fp8_state=self.fp8_state)


class LayerNormMLP(Module):
    def __init__(self, hidden_size, ffn_hidden_size, eps=1e-5, bias=True,
                 normalization="LayerNorm", activation="gelu", zero_centered_gamma=False,
                 return_layernorm_output=False, params_dtype=None, device=None, seed=None):
        super().__init__(params_dtype, device, seed)
        self.hidden_size, self.ffn_hidden_size, self.eps = hidden_size, ffn_hidden_size, eps
        self.normalization, self.activation = normalization, activation
        self.zero_centered_gamma = zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        _add_norm_params(self, hidden_size, normalization, zero_centered_gamma)
        fc1_out = ffn_hidden_size * (2 if activation in GATED else 1)
        self.add_parameter("fc1_weight", (fc1_out, hidden_size), "normal")
        self.add_parameter("fc2_weight", (hidden_size, ffn_hidden_size), "normal")
        self.fc1_bias = self.fc2_bias = None
        if bias:
            self.add_parameter("fc1_bias", (fc1_out,), "zeros")
            self.add_parameter("fc2_bias", (hidden_size,), "zeros")
        self.fp8_state = FP8State(num_gemms=2)

    def forward(self, x):
        return layernorm_mlp(x, self.layer_norm_weight, self.layer_norm_bias, self.fc1_weight,
                             self.fc1_bias, self.fc2_weight, self.fc2_bias, self.eps,
                             self.zero_centered_gamma, self.normalization, self.activation,
                             self.return_layernorm_output, fp8_state=self.fp8_state)
