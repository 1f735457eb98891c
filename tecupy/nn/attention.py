"""DotProductAttention and MultiheadAttention with Transformer Engine's names and options.

Constructors check every option (sizes, head counts, dropout, formats, mask types) before
making parameters; forwards check the inputs' shapes against the module's sizes.
"""
from .. import _check
from ..distributed.tensor_parallel import rank_seed
from ..fp8_params import check_first_microbatch
from ..ops import apply_rotary_pos_emb_qkv, dot_product_attention, reshape, split
from ..ops.attention import QKV_FORMATS, parse_mask
from .layers import LayerNormLinear, Linear, check_norm_options, check_tp_options
from .module import Module


def check_tp_heads(op, heads, groups, qkv_format, tp_group, tp_size, sequence_parallel,
                   format_name="qkv_format"):
    """Tensor-parallel options of attention -> tp_size: the heads and the GQA groups split
    over the ranks (Transformer Engine asserts the same), sequence parallel on sbhd only
    (its chunks are of the first axis)."""
    size = check_tp_options(op, None, tp_group, tp_size, 0, 0, sequence_parallel)
    for name, n in (("num_attention_heads", heads), ("num_gqa_groups", groups)):
        if n % size:
            raise ValueError(f"{op}: {name} ({n}) must be a multiple of tp_size ({size}): "
                             "tensor parallel splits the heads (and GQA groups) over the ranks")
    if sequence_parallel and qkv_format != "sbhd":
        _check.fail(op, format_name, "'sbhd' with sequence_parallel=True (the sequence "
                    "chunks are of the first axis)", qkv_format)
    return size


def check_heads(op, hidden_size, heads, kv_channels, groups):
    """Sizes of multi-head attention; -> (kv_channels, num_gqa_groups) with their defaults
    (hidden_size // heads, and heads: plain multi-head attention)."""
    heads = _check.size(op, "num_attention_heads", heads)
    if kv_channels is not None:
        kv_channels = _check.size(op, "kv_channels", kv_channels)
    elif hidden_size % heads:
        _check.fail(op, "hidden_size", f"a multiple of num_attention_heads ({heads}), or give "
                    "kv_channels", hidden_size)
    else:
        kv_channels = hidden_size // heads
    groups = heads if groups is None else _check.size(op, "num_gqa_groups", groups)
    if heads % groups:
        _check.fail(op, "num_gqa_groups", f"a divisor of num_attention_heads ({heads})", groups)
    return kv_channels, groups


def check_core_options(op, attention_dropout, qkv_format, attn_mask_type,
                       names=("qkv_format", "attn_mask_type")):
    """Core attention's options, under the caller's names for them; -> (the dropout as a
    float in [0, 1), the Mask)."""
    _check.choice(op, names[0], qkv_format, QKV_FORMATS)
    mask = parse_mask(op, names[1], attn_mask_type)
    return _check.real(op, "attention_dropout", attention_dropout, 0, 1, high_open=True), mask


class DotProductAttention(Module):
    """Core attention over q, k, v in qkv_format ('sbhd' or 'bshd'); returns the heads
    flattened, [s, b, h*d] or [b, s, h*d], as Transformer Engine does."""

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None,
                 attention_dropout=0.0, qkv_format="sbhd", attn_mask_type="causal",
                 softmax_scale=None, params_dtype=None, device=None, seed=None):
        op = "DotProductAttention"
        kv_channels = _check.size(op, "kv_channels", kv_channels)
        _, groups = check_heads(op, None, num_attention_heads, kv_channels, num_gqa_groups)
        p, mask = check_core_options(op, attention_dropout, qkv_format, attn_mask_type)
        if softmax_scale is not None:
            softmax_scale = _check.real(op, "softmax_scale", softmax_scale)
        super().__init__(params_dtype, device, _check.seed(op, "seed", seed))
        self.num_attention_heads, self.kv_channels = int(num_attention_heads), kv_channels
        self.num_gqa_groups = groups
        self.attention_dropout, self.qkv_format = p, qkv_format
        self.mask, self.softmax_scale = mask, softmax_scale
        self.tp_rank = 0  # (MultiheadAttention's rank under tensor parallel: dropout seeds)

    @property
    def attn_mask_type(self):
        """Transformer Engine's attribute: the mask type's name (self.mask: what it means)."""
        return self.mask.name

    @attn_mask_type.setter
    def attn_mask_type(self, value):
        self.mask = parse_mask("DotProductAttention", "attn_mask_type", value)

    def _check_inputs(self, query, key, value):
        heads, groups, d = self.num_attention_heads, self.num_gqa_groups, self.kv_channels
        for name, t, h in (("query", query, heads), ("key", key, groups),
                           ("value", value, groups)):
            if getattr(t, "ndim", None) != 4 or tuple(t.shape[2:]) != (h, d):
                _check.fail("DotProductAttention", name, f"an array [*, *, {h}, {d}] "
                            f"({self.qkv_format}: {h} heads of kv_channels {d})", t)

    def forward(self, query, key, value, attn_mask_type=None, seqlens_q=None,
                seqlens_kv=None):
        self._check_inputs(query, key, value)
        p = self.attention_dropout if self.training else 0.0
        mask = self.mask if attn_mask_type is None else attn_mask_type  # the op parses it
        seed = None
        if p > 0:  # each tensor-parallel rank drops out its own heads: its own masks
            seed = rank_seed(self.next_seed(), self.tp_rank)
        o = dot_product_attention(query, key, value, mask, self.qkv_format, self.softmax_scale,
                                  p, seqlens_q, seqlens_kv, seed)
        return reshape(o, o.shape[:2] + (o.shape[2] * o.shape[3],))


class MultiheadAttention(Module):
    """(LayerNorm +) fused QKV projection, core attention, output projection.
    The QKV weight is laid out [q heads | k heads | v heads] x kv_channels.

    tp_group (TE's set_parallel_mode): the heads and GQA groups split over the ranks, each
    rank holding its heads' rows of q, k and v (column parallel, cut from the single-device
    initialisation of the same seed) and their columns of proj (row parallel: one
    all-reduce of the output). sequence_parallel (sbhd): hidden_states and the output are
    this rank's sequence chunks [s/tp, b, hidden]; the norm's output is all-gathered before
    the QKV GEMM, proj's output reduce-scattered. Attention dropout masks are per rank:
    rank r draws with rank_seed(seed, r) (rank 0 with the module's seed)."""

    def __init__(self, hidden_size, num_attention_heads, kv_channels=None,
                 attention_dropout=0.1, layernorm_epsilon=1e-5, attn_mask_type="causal",
                 num_gqa_groups=None, input_layernorm=False, normalization="LayerNorm",
                 bias=True, zero_centered_gamma=False, qkv_format="sbhd", params_dtype=None,
                 device=None, seed=None, tp_group=None, tp_size=None, sequence_parallel=False):
        op = "MultiheadAttention"
        hidden_size = _check.size(op, "hidden_size", hidden_size)
        kv_channels, groups = check_heads(op, hidden_size, num_attention_heads, kv_channels,
                                          num_gqa_groups)
        check_core_options(op, attention_dropout, qkv_format, attn_mask_type)
        check_norm_options(op, layernorm_epsilon, normalization, zero_centered_gamma,
                           "layernorm_epsilon")
        for name, v in (("input_layernorm", input_layernorm), ("bias", bias)):
            _check.flag(op, name, v)
        tp_size = check_tp_heads(op, num_attention_heads, groups, qkv_format, tp_group, tp_size,
                                 sequence_parallel)
        super().__init__(params_dtype, device, _check.seed(op, "seed", seed))
        self.hidden_size, self.heads = hidden_size, int(num_attention_heads)
        self.kv_channels, self.groups = kv_channels, groups
        self.tp_group, self.tp_size = tp_group, tp_size
        self.sequence_parallel = bool(sequence_parallel)
        self.local_heads, self.local_groups = self.heads // tp_size, groups // tp_size
        self.input_layernorm = bool(input_layernorm)
        self._make_children(layernorm_epsilon, bias, normalization, zero_centered_gamma,
                            attention_dropout, qkv_format, attn_mask_type)

    def _make_children(self, eps, bias, normalization, zcg, attention_dropout, qkv_format,
                       attn_mask_type):
        d, kw = self.kv_channels, self._child_kwargs
        parts = [self.heads * d, self.groups * d, self.groups * d]
        tp = dict(tp_group=self.tp_group, sequence_parallel=self.sequence_parallel)
        col = dict(tp, parallel_mode="column" if self.tp_group else None, _column_parts=parts)
        if self.input_layernorm:
            self.layernorm_qkv = LayerNormLinear(self.hidden_size, sum(parts), eps, bias,
                                                 normalization, zcg, **kw(), **col)
        else:
            self.qkv = Linear(self.hidden_size, sum(parts), bias, **kw(), **col)
        self.core_attention = DotProductAttention(
            self.heads, d, self.groups, attention_dropout, qkv_format, attn_mask_type, **kw())
        if self.tp_group is not None:  # this rank's heads (checked in full above)
            ca = self.core_attention
            ca.num_attention_heads, ca.num_gqa_groups = self.local_heads, self.local_groups
            ca.tp_rank = self.tp_group.rank
        self.proj = Linear(self.heads * d, self.hidden_size, bias, **kw(), **tp,
                           parallel_mode="row" if self.tp_group else None)

    def forward(self, hidden_states, attn_mask_type=None, seqlens=None, rotary_pos_emb=None,
                residual=None, is_first_microbatch=None):
        """hidden_states [s, b, hidden] (sbhd) or [b, s, hidden] (bshd); seqlens [b] for
        padding masks; rotary_pos_emb: RotaryPositionEmbedding's freqs [>= s, 1, 1, d2] (or
        a pair for q and k), applied to q and k after the QKV projection, as TE does.
        residual: None or an array added to the output (in proj's FP8 GEMM epilogue where
        it can be: nn.Linear's residual). is_first_microbatch: None, True or False, passed
        to the QKV and output projections (nn.Linear's: FP8 weights kept across
        microbatches)."""
        op = "MultiheadAttention"
        check_hidden_states(op, hidden_states, self.hidden_size)
        is_first_microbatch = check_first_microbatch(op, is_first_microbatch)
        mask = call_mask(op, "attn_mask_type", attn_mask_type, self.core_attention.mask,
                         seqlens)
        qkv = (self.layernorm_qkv if self.input_layernorm else self.qkv)(
            hidden_states, is_first_microbatch)
        h, g = self.local_heads, self.local_groups  # (all of them without tensor parallel)
        qkv = reshape(qkv, qkv.shape[:2] + (h + 2 * g, self.kv_channels))
        if rotary_pos_emb is not None:  # one kernel, packed in and out (ops/rope.py)
            qkv = apply_rotary_pos_emb_qkv(qkv, rotary_pos_emb, h, g,
                                           self.core_attention.qkv_format)
        q, k, v = split(qkv, [h, g, g], axis=2)
        ctx = self.core_attention(q, k, v, mask, seqlens, seqlens)
        return self.proj(ctx, is_first_microbatch, residual=residual)


def check_hidden_states(op, x, hidden_size):
    """x is [s, b, hidden_size] (or [b, s, hidden_size]): 3-D, of the layer's width."""
    _check.last_dim(op, "hidden_states", x, hidden_size, "hidden_size")
    if x.ndim != 3:
        _check.fail(op, "hidden_states", f"a 3-D array [s, b, {hidden_size}] or "
                    f"[b, s, {hidden_size}]", x)


def call_mask(op, name, value, default, seqlens):
    """A forward's Mask: value (a mask type named `name`, a Mask, or None for the module's
    `default`), checked against seqlens: a padding mask needs them (named as the module
    names them; the op would ask for seqlens_q)."""
    mask = default if value is None else parse_mask(op, name, value)
    if seqlens is None and mask.padding:
        _check.fail(op, "seqlens", f"an int array [batch] with {name}={mask.name!r}", None)
    return mask
