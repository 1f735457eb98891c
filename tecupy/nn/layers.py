"""Linear, LayerNorm, RMSNorm, LayerNormLinear, LayerNormMLP with Transformer Engine's names.

Constructors check their options before making any parameter (a bad option fails there,
not at the first forward); forwards check that the input's last dimension is the layer's
width, so the error names the input rather than the layer's weight.
"""
from .. import _check
from ..distributed.group import ProcessGroup
from ..distributed.tensor_parallel import column_parallel_linear, row_parallel_linear, shard
from ..fp8_state import FP8State
from ..ops import layernorm, layernorm_linear, layernorm_mlp, linear, rmsnorm
from ..ops.activation import ACTIVATIONS, GATED
from ..ops.normalization import NORMALIZATIONS
from .module import Module


def check_norm_options(op, eps, normalization, zero_centered_gamma, eps_name="eps"):
    """The options of the modules with a choice of norm; -> eps as a float."""
    _check.choice(op, "normalization", normalization, NORMALIZATIONS)
    _check.flag(op, "zero_centered_gamma", zero_centered_gamma)
    return _check.real(op, eps_name, eps, low=0, low_open=True)


def check_tp_options(op, parallel_mode, tp_group, tp_size, in_features, out_features):
    """Transformer Engine's tensor-parallel options -> tp_size (the group's size; 1 without
    a group). The split dimension must divide evenly."""
    if parallel_mode is not None:
        _check.choice(op, "parallel_mode", parallel_mode, ("column", "row"))
    if tp_group is not None and not isinstance(tp_group, ProcessGroup):
        _check.fail(op, "tp_group", "None or a tecupy.distributed ProcessGroup", tp_group,
                    TypeError)
    size = 1 if tp_group is None else tp_group.size
    if tp_size is not None and tp_size != size:
        _check.fail(op, "tp_size", f"None or the size of tp_group ({size})", tp_size)
    split = {"column": ("out_features", out_features), "row": ("in_features", in_features)}
    name, n = split.get(parallel_mode, ("", 0))
    if n % size:
        raise ValueError(f"{op}: parallel_mode={parallel_mode!r} splits {name} ({n}) over "
                         f"tp_size {size} ranks; it must be a multiple of it")
    return size


class Linear(Module):
    """parallel_mode 'column' holds this rank's rows of the weight (and bias) and returns its
    slice of the output features; 'row' holds its columns, takes its slice of the input
    features and returns the full output, summed over tp_group (bias added once after).
    The shards are cut from the single-device initialisation of the same seed; in_features
    and out_features are then the local sizes, as in Transformer Engine."""

    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None,
                 seed=None, parallel_mode=None, tp_group=None, tp_size=None):
        op = "Linear"
        in_features = _check.size(op, "in_features", in_features)
        out_features = _check.size(op, "out_features", out_features)
        _check.flag(op, "bias", bias)
        tp_size = check_tp_options(op, parallel_mode, tp_group, tp_size, in_features,
                                   out_features)
        super().__init__(params_dtype, device, _check.seed(op, "seed", seed))
        self.in_features, self.out_features = in_features, out_features
        self.parallel_mode, self.tp_group, self.tp_size = parallel_mode, tp_group, tp_size
        self.add_parameter("weight", (out_features, in_features), "normal")
        self.bias = None
        if bias:
            self.add_parameter("bias", (out_features,), "zeros")
        if tp_group is not None and parallel_mode is not None:
            self._shard()
        self.fp8_state = FP8State(num_gemms=1)
        self.quantize_weights(("weight", 0))

    def _shard(self):
        """Keep this rank's part of the full parameters (made first, so that the ranks
        together hold exactly the single-device layer of the same seed)."""
        if self.parallel_mode == "column":
            self.weight = shard(self.weight, self.tp_group, 0)
            self.bias = None if self.bias is None else shard(self.bias, self.tp_group, 0)
            self.out_features //= self.tp_size
        else:
            self.weight = shard(self.weight, self.tp_group, 1)
            self.in_features //= self.tp_size

    def forward(self, x):
        _check.last_dim("Linear", "x", x, self.in_features, "in_features")
        if self.tp_group is None or self.parallel_mode is None:
            return linear(x, self.weight, self.bias, fp8_state=self.fp8_state)
        parallel = column_parallel_linear if self.parallel_mode == "column" else \
            row_parallel_linear
        return parallel(x, self.weight, self.bias, self.tp_group, fp8_state=self.fp8_state)


class _Norm(Module):
    def __init__(self, op, hidden_size, eps, zero_centered_gamma, params_dtype, device, seed,
                 bias):
        hidden_size = _check.size(op, "hidden_size", hidden_size)
        eps = _check.real(op, "eps", eps, low=0, low_open=True)
        _check.flag(op, "zero_centered_gamma", zero_centered_gamma)
        super().__init__(params_dtype, device, _check.seed(op, "seed", seed))
        self.hidden_size, self.eps = hidden_size, eps
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.add_parameter("weight", (hidden_size,), "zeros" if zero_centered_gamma else "ones")
        if bias:
            self.add_parameter("bias", (hidden_size,), "zeros")

    def _check_input(self, x):
        _check.last_dim(type(self).__name__, "x", x, self.hidden_size, "hidden_size")


class LayerNorm(_Norm):
    def __init__(self, hidden_size, eps=1e-5, zero_centered_gamma=False, params_dtype=None,
                 device=None, seed=None):
        super().__init__("LayerNorm", hidden_size, eps, zero_centered_gamma, params_dtype,
                         device, seed, True)

    def forward(self, x):
        self._check_input(x)
        return layernorm(x, self.weight, self.bias, self.eps, self.zero_centered_gamma)


class RMSNorm(_Norm):
    def __init__(self, hidden_size, eps=1e-5, zero_centered_gamma=False, params_dtype=None,
                 device=None, seed=None):
        super().__init__("RMSNorm", hidden_size, eps, zero_centered_gamma, params_dtype,
                         device, seed, False)

    def forward(self, x):
        self._check_input(x)
        return rmsnorm(x, self.weight, self.eps, self.zero_centered_gamma)


def _add_norm_params(module, hidden, normalization, zero_centered_gamma):
    module.add_parameter("layer_norm_weight", (hidden,),
                         "zeros" if zero_centered_gamma else "ones")
    module.layer_norm_bias = None
    if normalization == "LayerNorm":
        module.add_parameter("layer_norm_bias", (hidden,), "zeros")


class LayerNormLinear(Module):
    def __init__(self, in_features, out_features, eps=1e-5, bias=True,
                 normalization="LayerNorm", zero_centered_gamma=False,
                 return_layernorm_output=False, params_dtype=None, device=None, seed=None):
        op = "LayerNormLinear"
        in_features = _check.size(op, "in_features", in_features)
        out_features = _check.size(op, "out_features", out_features)
        eps = check_norm_options(op, eps, normalization, zero_centered_gamma)
        _check.flag(op, "bias", bias)
        _check.flag(op, "return_layernorm_output", return_layernorm_output)
        super().__init__(params_dtype, device, _check.seed(op, "seed", seed))
        self.in_features, self.out_features, self.eps = in_features, out_features, eps
        self.normalization, self.zero_centered_gamma = normalization, bool(zero_centered_gamma)
        self.return_layernorm_output = bool(return_layernorm_output)
        _add_norm_params(self, in_features, normalization, zero_centered_gamma)
        self.add_parameter("weight", (out_features, in_features), "normal")
        self.bias = None
        if bias:
            self.add_parameter("bias", (out_features,), "zeros")
        self.fp8_state = FP8State(num_gemms=1)
        self.quantize_weights(("weight", 0))

    def forward(self, x):
        _check.last_dim("LayerNormLinear", "x", x, self.in_features, "in_features")
        return layernorm_linear(x, self.layer_norm_weight, self.layer_norm_bias, self.weight,
                                self.bias, self.eps, self.zero_centered_gamma,
                                self.normalization, self.return_layernorm_output,
                                fp8_state=self.fp8_state)


class LayerNormMLP(Module):
    def __init__(self, hidden_size, ffn_hidden_size, eps=1e-5, bias=True,
                 normalization="LayerNorm", activation="gelu", zero_centered_gamma=False,
                 return_layernorm_output=False, params_dtype=None, device=None, seed=None):
        op = "LayerNormMLP"
        hidden_size = _check.size(op, "hidden_size", hidden_size)
        ffn_hidden_size = _check.size(op, "ffn_hidden_size", ffn_hidden_size)
        eps = check_norm_options(op, eps, normalization, zero_centered_gamma)
        _check.choice(op, "activation", activation, ACTIVATIONS)
        _check.flag(op, "bias", bias)
        _check.flag(op, "return_layernorm_output", return_layernorm_output)
        super().__init__(params_dtype, device, _check.seed(op, "seed", seed))
        self.hidden_size, self.ffn_hidden_size, self.eps = hidden_size, ffn_hidden_size, eps
        self.normalization, self.activation = normalization, activation
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.return_layernorm_output = bool(return_layernorm_output)
        self._add_params(bias)
        self.fp8_state = FP8State(num_gemms=2)
        self.quantize_weights(("fc1_weight", 0), ("fc2_weight", 1))

    def _add_params(self, bias):
        hidden, ffn = self.hidden_size, self.ffn_hidden_size
        _add_norm_params(self, hidden, self.normalization, self.zero_centered_gamma)
        fc1_out = ffn * (2 if self.activation in GATED else 1)
        self.add_parameter("fc1_weight", (fc1_out, hidden), "normal")
        self.add_parameter("fc2_weight", (hidden, ffn), "normal")
        self.fc1_bias = self.fc2_bias = None
        if bias:
            self.add_parameter("fc1_bias", (fc1_out,), "zeros")
            self.add_parameter("fc2_bias", (hidden,), "zeros")

    def forward(self, x):
        _check.last_dim("LayerNormMLP", "x", x, self.hidden_size, "hidden_size")
        return layernorm_mlp(x, self.layer_norm_weight, self.layer_norm_bias, self.fc1_weight,
                             self.fc1_bias, self.fc2_weight, self.fc2_bias, self.eps,
                             self.zero_centered_gamma, self.normalization, self.activation,
                             self.return_layernorm_output, fp8_state=self.fp8_state)
