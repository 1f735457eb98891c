"""TransformerLayer: pre-norm self-attention and MLP blocks with residuals (TE's default).

    h   = x + dropout(MultiheadAttention(LayerNorm(x)))
    out = h + dropout(LayerNormMLP(h))

Tensor parallel (tp_group): the attention's heads and the MLP's ffn split over the ranks
(MultiheadAttention, LayerNormMLP), the residual adds and dropout on the full, replicated
[s, b, hidden] (every rank draws the same masks, from the module's seed: those of the
single device). sequence_parallel: x and the output are this rank's sequence chunks
[s/tp, b, hidden]; the residual adds and dropout run on the chunks, rank r's masks drawn
with rank_seed(seed, r) (tensor_parallel.py; rank 0 with the module's own seed), so they
are reproducible from the seed and the rank, but not those of the single device.
"""
from .. import _check
from ..distributed.tensor_parallel import rank_seed
from ..fp8_params import check_first_microbatch
from ..ops import dropout
from ..ops.activation import ACTIVATIONS
from .attention import (MultiheadAttention, call_mask, check_core_options, check_heads,
                        check_hidden_states, check_tp_heads)
from .layers import LayerNormMLP, check_norm_options
from .module import Module


def _check_options(hidden_size, ffn_hidden_size, num_attention_heads, num_gqa_groups,
                   layernorm_epsilon, hidden_dropout, attention_dropout, self_attn_mask_type,
                   normalization, activation, bias, zero_centered_gamma, kv_channels,
                   attn_input_format, tp_group=None, tp_size=None, sequence_parallel=False):
    """Every option, under TransformerLayer's names for them (the children would name their
    own: attn_mask_type for self_attn_mask_type)."""
    op = "TransformerLayer"
    hidden_size = _check.size(op, "hidden_size", hidden_size)
    _check.size(op, "ffn_hidden_size", ffn_hidden_size)
    _, groups = check_heads(op, hidden_size, num_attention_heads, kv_channels, num_gqa_groups)
    size = check_tp_heads(op, num_attention_heads, groups, attn_input_format, tp_group,
                          tp_size, sequence_parallel, "attn_input_format")
    if ffn_hidden_size % size:
        raise ValueError(f"{op}: ffn_hidden_size ({ffn_hidden_size}) must be a multiple of "
                         f"tp_size ({size}): tensor parallel splits it over the ranks")
    check_core_options(op, attention_dropout, attn_input_format, self_attn_mask_type,
                       ("attn_input_format", "self_attn_mask_type"))
    check_norm_options(op, layernorm_epsilon, normalization, zero_centered_gamma,
                       "layernorm_epsilon")
    _check.choice(op, "activation", activation, ACTIVATIONS)
    _check.flag(op, "bias", bias)
    return _check.real(op, "hidden_dropout", hidden_dropout, 0, 1)


class TransformerLayer(Module):
    def __init__(self, hidden_size, ffn_hidden_size, num_attention_heads, num_gqa_groups=None,
                 layernorm_epsilon=1e-5, hidden_dropout=0.1, attention_dropout=0.1,
                 self_attn_mask_type="causal", normalization="LayerNorm", activation="gelu",
                 bias=True, zero_centered_gamma=False, kv_channels=None,
                 attn_input_format="sbhd", params_dtype=None, device=None, seed=None,
                 tp_group=None, tp_size=None, sequence_parallel=False):
        hidden_dropout = _check_options(
            hidden_size, ffn_hidden_size, num_attention_heads, num_gqa_groups,
            layernorm_epsilon, hidden_dropout, attention_dropout, self_attn_mask_type,
            normalization, activation, bias, zero_centered_gamma, kv_channels,
            attn_input_format, tp_group, tp_size, sequence_parallel)
        super().__init__(params_dtype, device, _check.seed("TransformerLayer", "seed", seed))
        self.hidden_size, self.hidden_dropout = hidden_size, hidden_dropout
        self.tp_group, self.sequence_parallel = tp_group, bool(sequence_parallel)
        self.tp_size = 1 if tp_group is None else tp_group.size
        tp = dict(tp_group=tp_group, sequence_parallel=sequence_parallel)
        self.self_attention = MultiheadAttention(
            hidden_size, num_attention_heads, kv_channels, attention_dropout, layernorm_epsilon,
            self_attn_mask_type, num_gqa_groups, input_layernorm=True,
            normalization=normalization, bias=bias, zero_centered_gamma=zero_centered_gamma,
            qkv_format=attn_input_format, **self._child_kwargs(), **tp)
        self.layernorm_mlp = LayerNormMLP(
            hidden_size, ffn_hidden_size, layernorm_epsilon, bias, normalization, activation,
            zero_centered_gamma, **self._child_kwargs(), **tp)

    def _dropout_add(self, x, residual):
        """dropout(x) + residual in one pass (one kernel on the GPU); under sequence
        parallel on this rank's chunk, with its own masks (module doc)."""
        seed = self.next_seed()
        if self.sequence_parallel:
            seed = rank_seed(seed, self.tp_group.rank)
        return dropout(x, self.hidden_dropout, seed, training=self.training,
                       residual=residual)

    def forward(self, hidden_states, self_attn_mask_type=None, seqlens=None,
                rotary_pos_emb=None, is_first_microbatch=None):
        """hidden_states [s, b, hidden] ('sbhd') or [b, s, hidden] ('bshd'); rotary_pos_emb:
        RoPE freqs for the self-attention's q and k (MultiheadAttention.forward);
        is_first_microbatch: None, True or False, passed to every GEMM's module (nn.Linear's:
        FP8 weights kept across the microbatches of a minibatch)."""
        op = "TransformerLayer"
        first = check_first_microbatch(op, is_first_microbatch)
        check_hidden_states(op, hidden_states, self.hidden_size)
        mask = call_mask(op, "self_attn_mask_type", self_attn_mask_type,
                         self.self_attention.core_attention.mask, seqlens)
        if self.training and self.hidden_dropout > 0:
            attn = self.self_attention(hidden_states, mask, seqlens, rotary_pos_emb,
                                       is_first_microbatch=first)
            h = self._dropout_add(attn, hidden_states)
            return self._dropout_add(self.layernorm_mlp(h, first), h)
        # no dropout between the GEMMs and the residual adds: proj's and fc2's FP8 GEMMs add
        # them in their epilogues (the same bits as the add: ops/linear.py's residual); the
        # seeds are drawn as _dropout_add draws them, so later masks do not change
        self.next_seed()
        h = self.self_attention(hidden_states, mask, seqlens, rotary_pos_emb,
                                residual=hidden_states, is_first_microbatch=first)
        self.next_seed()
        return self.layernorm_mlp(h, first, residual=h)
