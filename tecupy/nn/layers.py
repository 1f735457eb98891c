"""Linear, LayerNorm, RMSNorm, LayerNormLinear, LayerNormMLP with Transformer Engine's names.

Constructors check their options before making any parameter (a bad option fails there,
not at the first forward); forwards check that the input's last dimension is the layer's
width, so the error names the input rather than the layer's weight.
"""
from .. import _check
from ..distributed.fp8_blocks import layernorm_linear_sp, layernorm_mlp_sp
from ..distributed.group import ProcessGroup
from ..distributed.tensor_parallel import (act_then_row_parallel, column_parallel_linear,
                                           replicated_grad, row_parallel_linear, shard,
                                           shard_parts)
from ..fp8_params import FIRST_MICROBATCH_DOC, check_first_microbatch, microbatch_weights
from ..fp8_state import FP8State
from ..ops import (add, layernorm, layernorm_linear, layernorm_mlp, linear, normalize,
                   rmsnorm)
from ..ops.activation import ACTIVATIONS, GATED
from ..ops.normalization import NORMALIZATIONS
from .module import Module


def check_norm_options(op, eps, normalization, zero_centered_gamma, eps_name="eps"):
    """The options of the modules with a choice of norm; -> eps as a float."""
    _check.choice(op, "normalization", normalization, NORMALIZATIONS)
    _check.flag(op, "zero_centered_gamma", zero_centered_gamma)
    return _check.real(op, eps_name, eps, low=0, low_open=True)


def check_tp_options(op, parallel_mode, tp_group, tp_size, in_features, out_features,
                     sequence_parallel=False, modes=("column", "row")):
    """Transformer Engine's tensor-parallel options -> tp_size (the group's size; 1 without
    a group). The split dimension must divide evenly; sequence_parallel needs a group."""
    if parallel_mode is not None:
        _check.choice(op, "parallel_mode", parallel_mode, modes)
    check_sequence_parallel(op, sequence_parallel, tp_group)
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


def check_sequence_parallel(op, sequence_parallel, tp_group):
    _check.flag(op, "sequence_parallel", sequence_parallel)
    if sequence_parallel and tp_group is None:
        raise ValueError(f"{op}: sequence_parallel=True needs a tp_group (the ranks that "
                         "hold the sequence's chunks)")


def set_tp(module, parallel_mode, tp_group, tp_size, sequence_parallel):
    """The TP attributes of a module, and its FP8 state's amax group (reduce_amax)."""
    module.parallel_mode, module.tp_group, module.tp_size = parallel_mode, tp_group, tp_size
    module.sequence_parallel = bool(sequence_parallel)
    module.fp8_state.amax_group = tp_group


def shard_rows(module, names, parts=None):
    """Keep this rank's rows of the parameters `names` (column parallel): contiguous
    chunks, or each of `parts` (sizes along the rows) chunked on its own (shard_parts)."""
    g = module.tp_group
    for name in names:
        p = getattr(module, name)
        if p is not None:
            setattr(module, name, shard(p, g, 0) if parts is None else shard_parts(p, g, parts))


class Linear(Module):
    """parallel_mode 'column' holds this rank's rows of the weight (and bias) and returns its
    slice of the output features; 'row' holds its columns, takes its slice of the input
    features and returns the full output, summed over tp_group (bias added once after).
    The shards are cut from the single-device initialisation of the same seed; in_features
    and out_features are then the local sizes, as in Transformer Engine.
    sequence_parallel: 'column' takes this rank's sequence chunk [s/tp, ...] and gathers it
    (as FP8 codes under fp8_autocast), 'row' returns its chunk of the output (reduce-scatter,
    the bias's gradient all-reduced). _column_parts: sizes of the output rows' parts that
    shard separately (MultiheadAttention's [q | k | v]); not a TE option."""

    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None,
                 seed=None, parallel_mode=None, tp_group=None, tp_size=None,
                 sequence_parallel=False, _column_parts=None):
        op = "Linear"
        in_features = _check.size(op, "in_features", in_features)
        out_features = _check.size(op, "out_features", out_features)
        _check.flag(op, "bias", bias)
        tp_size = check_tp_options(op, parallel_mode, tp_group, tp_size, in_features,
                                   out_features, sequence_parallel)
        super().__init__(params_dtype, device, _check.seed(op, "seed", seed))
        self.in_features, self.out_features = in_features, out_features
        self.fp8_state = FP8State(num_gemms=1)
        set_tp(self, parallel_mode, tp_group, tp_size, sequence_parallel)
        self.add_parameter("weight", (out_features, in_features), "normal")
        self.bias = None
        if bias:
            self.add_parameter("bias", (out_features,), "zeros")
        if tp_group is not None and parallel_mode is not None:
            self._shard(_column_parts)
        self.quantize_weights(("weight", 0))

    def _shard(self, parts):
        """Keep this rank's part of the full parameters (made first, so that the ranks
        together hold exactly the single-device layer of the same seed)."""
        if self.parallel_mode == "column":
            shard_rows(self, ("weight", "bias"), parts)
            self.out_features //= self.tp_size
        else:
            self.weight = shard(self.weight, self.tp_group, 1)
            self.in_features //= self.tp_size

    def forward(self, x, is_first_microbatch=None, residual=None):
        """residual: None or an array added to the output (y's shape: in the FP8 GEMM's
        epilogue, ops.linear's residual). {first}"""
        _check.last_dim("Linear", "x", x, self.in_features, "in_features")
        if self.tp_group is None or self.parallel_mode is None:
            qw = microbatch_weights(self, "Linear", is_first_microbatch, ("weight", 0))
            return linear(x, self.weight, self.bias, fp8_state=self.fp8_state,
                          residual=residual, qweight=None if qw is None else qw[0])
        check_first_microbatch("Linear", is_first_microbatch)  # (TP: changes nothing)
        if self.parallel_mode == "row":  # (the residual in the bias's pass)
            return row_parallel_linear(x, self.weight, self.bias, self.tp_group,
                                       fp8_state=self.fp8_state,
                                       sequence_parallel=self.sequence_parallel,
                                       residual=residual)
        y = column_parallel_linear(x, self.weight, self.bias, self.tp_group,
                                   fp8_state=self.fp8_state,
                                   sequence_parallel=self.sequence_parallel)
        return y if residual is None else add(y, residual)


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
    """norm then linear. parallel_mode 'column' with tp_group: this rank's rows of the
    weight and bias (cut from the single-device initialisation of the same seed;
    out_features is then the local size) and its slice of the output features; the norm's
    input is replicated (its gradient all-reduced). sequence_parallel: x is this rank's
    sequence chunk [s/tp, ...]; the norm runs on it, its output is all-gathered along the
    sequence before the GEMM (as FP8 codes under fp8_autocast) and the norm's parameters
    get their gradients all-reduced over tp_group; return_layernorm_output returns the
    chunk's norm output (TE's default, not the gathered one)."""

    def __init__(self, in_features, out_features, eps=1e-5, bias=True,
                 normalization="LayerNorm", zero_centered_gamma=False,
                 return_layernorm_output=False, params_dtype=None, device=None, seed=None,
                 parallel_mode=None, tp_group=None, tp_size=None, sequence_parallel=False,
                 _column_parts=None):
        op = "LayerNormLinear"
        in_features = _check.size(op, "in_features", in_features)
        out_features = _check.size(op, "out_features", out_features)
        eps = check_norm_options(op, eps, normalization, zero_centered_gamma)
        _check.flag(op, "bias", bias)
        _check.flag(op, "return_layernorm_output", return_layernorm_output)
        tp_size = check_tp_options(op, parallel_mode, tp_group, tp_size, in_features,
                                   out_features, sequence_parallel, modes=("column",))
        super().__init__(params_dtype, device, _check.seed(op, "seed", seed))
        self.in_features, self.out_features, self.eps = in_features, out_features, eps
        self.normalization, self.zero_centered_gamma = normalization, bool(zero_centered_gamma)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.fp8_state = FP8State(num_gemms=1)
        set_tp(self, parallel_mode, tp_group, tp_size, sequence_parallel)
        _add_norm_params(self, in_features, normalization, zero_centered_gamma)
        self.add_parameter("weight", (out_features, in_features), "normal")
        self.bias = None
        if bias:
            self.add_parameter("bias", (out_features,), "zeros")
        if tp_group is not None and parallel_mode is not None:
            shard_rows(self, ("weight", "bias"), _column_parts)
            self.out_features //= tp_size
        self.quantize_weights(("weight", 0))

    def forward(self, x, is_first_microbatch=None):
        """{first}"""
        op = "LayerNormLinear"
        _check.last_dim(op, "x", x, self.in_features, "in_features")
        if self.tp_group is None or self.parallel_mode is None:
            qw = microbatch_weights(self, op, is_first_microbatch, ("weight", 0))
            return layernorm_linear(x, self.layer_norm_weight, self.layer_norm_bias,
                                    self.weight, self.bias, self.eps, self.zero_centered_gamma,
                                    self.normalization, self.return_layernorm_output,
                                    fp8_state=self.fp8_state,
                                    qweight=None if qw is None else qw[0])
        check_first_microbatch(op, is_first_microbatch)  # (TP: changes nothing)
        if self.sequence_parallel:
            y = layernorm_linear_sp(self, x)  # (one FP8 node, or None)
            if y is not None:
                return y
        ln_out = parallel_norm(self, x)
        y = column_parallel_linear(ln_out, self.weight, self.bias, self.tp_group,
                                   fp8_state=self.fp8_state,
                                   sequence_parallel=self.sequence_parallel)
        return (y, ln_out) if self.return_layernorm_output else y


def parallel_norm(module, x):
    """The norm of a tensor-parallel block: on the sequence chunk under sequence parallel,
    with the norm parameters' gradients all-reduced over tp_group (each rank's are the
    chunk's partial sums); without it x is replicated and so are they."""
    w, b = module.layer_norm_weight, module.layer_norm_bias
    if module.sequence_parallel:
        w, b = replicated_grad(w, module.tp_group), replicated_grad(b, module.tp_group)
    return normalize(x, w, b, module.eps, module.zero_centered_gamma, module.normalization)


class LayerNormMLP(Module):
    """fc2(act(fc1(norm(x)))). With tp_group (TE's set_parallel_mode): fc1 column parallel
    (this rank's rows; of each half for a gated activation), fc2 row parallel (its columns,
    the bias replicated), one all-reduce of the output; ffn_hidden_size is then the local
    size. sequence_parallel as in LayerNormLinear: x and the output are this rank's
    sequence chunks, the norm's output all-gathered and fc2's reduce-scattered."""

    def __init__(self, hidden_size, ffn_hidden_size, eps=1e-5, bias=True,
                 normalization="LayerNorm", activation="gelu", zero_centered_gamma=False,
                 return_layernorm_output=False, params_dtype=None, device=None, seed=None,
                 tp_group=None, tp_size=None, sequence_parallel=False):
        op = "LayerNormMLP"
        hidden_size = _check.size(op, "hidden_size", hidden_size)
        ffn_hidden_size = _check.size(op, "ffn_hidden_size", ffn_hidden_size)
        eps = check_norm_options(op, eps, normalization, zero_centered_gamma)
        _check.choice(op, "activation", activation, ACTIVATIONS)
        _check.flag(op, "bias", bias)
        _check.flag(op, "return_layernorm_output", return_layernorm_output)
        tp_size = check_tp_options(op, None, tp_group, tp_size, hidden_size, ffn_hidden_size,
                                   sequence_parallel)
        if ffn_hidden_size % tp_size:
            raise ValueError(f"{op}: ffn_hidden_size ({ffn_hidden_size}) splits over tp_size "
                             f"{tp_size} ranks (fc1 by rows, fc2 by columns); it must be a "
                             "multiple of it")
        mode = None if tp_group is None else "column+row"  # (fc1, fc2: for reading only)
        super().__init__(params_dtype, device, _check.seed(op, "seed", seed))
        self.hidden_size, self.ffn_hidden_size, self.eps = hidden_size, ffn_hidden_size, eps
        self.normalization, self.activation = normalization, activation
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.fp8_state = FP8State(num_gemms=2)
        set_tp(self, mode, tp_group, tp_size, sequence_parallel)
        self._add_params(bias)
        if tp_group is not None:
            self._shard()
        self.quantize_weights(("fc1_weight", 0), ("fc2_weight", 1))

    def _shard(self):
        ffn, g = self.ffn_hidden_size, self.tp_group
        parts = [ffn] * (2 if self.activation in GATED else 1)
        shard_rows(self, ("fc1_weight", "fc1_bias"), parts)
        self.fc2_weight = shard(self.fc2_weight, g, 1)
        self.ffn_hidden_size //= self.tp_size

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

    def forward(self, x, is_first_microbatch=None, residual=None):
        """residual: None or an array added to the output (x itself for the pre-norm
        residual connection: in FP8, in fc2's GEMM epilogue, ops.layernorm_mlp's).
        {first} (fc1's and fc2's weights.)"""
        _check.last_dim("LayerNormMLP", "x", x, self.hidden_size, "hidden_size")
        if self.tp_group is not None:
            check_first_microbatch("LayerNormMLP", is_first_microbatch)  # (changes nothing)
            return self._parallel_forward(x, residual)
        qw = microbatch_weights(self, "LayerNormMLP", is_first_microbatch,
                                ("fc1_weight", 0), ("fc2_weight", 1)) or (None, None)
        return layernorm_mlp(x, self.layer_norm_weight, self.layer_norm_bias, self.fc1_weight,
                             self.fc1_bias, self.fc2_weight, self.fc2_bias, self.eps,
                             self.zero_centered_gamma, self.normalization, self.activation,
                             self.return_layernorm_output, fp8_state=self.fp8_state,
                             residual=residual, fc1_qweight=qw[0], fc2_qweight=qw[1])

    def _parallel_forward(self, x, residual=None):
        """The block composed from its ops around the collectives (the fused single-device
        op has no place for them): norm, fc1 column parallel, act + fc2 row parallel (the
        residual added in fc2 bias's pass)."""
        g, sp, st = self.tp_group, self.sequence_parallel, self.fp8_state
        y = layernorm_mlp_sp(self, x, residual) if sp else None  # (one FP8 node, or None)
        if y is not None:
            return y
        ln_out = parallel_norm(self, x)
        h = column_parallel_linear(ln_out, self.fc1_weight, None, g, fp8_state=st,
                                   gemm_index=0, sequence_parallel=sp)
        # act + fc2 row parallel, summed over the group (under sequence parallel a ring
        # reduce-scatter whose fc2 GEMMs run while the partial sums travel)
        y = act_then_row_parallel(self.xp, h, self.fc1_bias, self.activation,
                                  self.fc2_weight, self.fc2_bias, g, st, sp, residual)
        return (y, ln_out) if self.return_layernorm_output else y


for _cls in (Linear, LayerNormLinear, LayerNormMLP):  # (one text for the three forwards)
    _cls.forward.__doc__ = _cls.forward.__doc__.replace("{first}", FIRST_MICROBATCH_DOC)
del _cls
