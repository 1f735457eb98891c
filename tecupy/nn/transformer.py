"""TransformerLayer: pre-norm self-attention and MLP blocks with residuals (TE's default).

    h   = x + dropout(MultiheadAttention(LayerNorm(x)))
    out = h + dropout(LayerNormMLP(h))
"""
from .. import _check
from ..ops import dropout
from ..ops.activation import ACTIVATIONS
from .attention import (MultiheadAttention, call_mask, check_core_options, check_heads,
                        check_hidden_states)
from .layers import LayerNormMLP, check_norm_options
from .module import Module


def _check_options(hidden_size, ffn_hidden_size, num_attention_heads, num_gqa_groups,
                   layernorm_epsilon, hidden_dropout, attention_dropout, self_attn_mask_type,
                   normalization, activation, bias, zero_centered_gamma, kv_channels,
                   attn_input_format):
    """Every option, under TransformerLayer's names for them (the children would name their
    own: attn_mask_type for self_attn_mask_type)."""
    op = "TransformerLayer"
    hidden_size = _check.size(op, "hidden_size", hidden_size)
    _check.size(op, "ffn_hidden_size", ffn_hidden_size)
    check_heads(op, hidden_size, num_attention_heads, kv_channels, num_gqa_groups)
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
                 attn_input_format="sbhd", params_dtype=None, device=None, seed=None):
        hidden_dropout = _check_options(
            hidden_size, ffn_hidden_size, num_attention_heads, num_gqa_groups,
            layernorm_epsilon, hidden_dropout, attention_dropout, self_attn_mask_type,
            normalization, activation, bias, zero_centered_gamma, kv_channels,
            attn_input_format)
        super().__init__(params_dtype, device, _check.seed("TransformerLayer", "seed", seed))
        self.hidden_size, self.hidden_dropout = hidden_size, hidden_dropout
        self.self_attention = MultiheadAttention(
            hidden_size, num_attention_heads, kv_channels, attention_dropout, layernorm_epsilon,
            self_attn_mask_type, num_gqa_groups, input_layernorm=True,
            normalization=normalization, bias=bias, zero_centered_gamma=zero_centered_gamma,
            qkv_format=attn_input_format, **self._child_kwargs())
        self.layernorm_mlp = LayerNormMLP(
            hidden_size, ffn_hidden_size, layernorm_epsilon, bias, normalization, activation,
            zero_centered_gamma, **self._child_kwargs())

    def _dropout_add(self, x, residual):
        """dropout(x) + residual in one pass (one kernel on the GPU)."""
        return dropout(x, self.hidden_dropout, self.next_seed(), training=self.training,
                       residual=residual)

    def forward(self, hidden_states, self_attn_mask_type=None, seqlens=None,
                rotary_pos_emb=None):
        """hidden_states [s, b, hidden] ('sbhd') or [b, s, hidden] ('bshd'); rotary_pos_emb:
        RoPE freqs for the self-attention's q and k (MultiheadAttention.forward)."""
        op = "TransformerLayer"
        check_hidden_states(op, hidden_states, self.hidden_size)
        mask = call_mask(op, "self_attn_mask_type", self_attn_mask_type,
                         self.self_attention.core_attention.mask, seqlens)
        attn = self.self_attention(hidden_states, mask, seqlens, rotary_pos_emb)
        h = self._dropout_add(attn, hidden_states)
        return self._dropout_add(self.layernorm_mlp(h), h)
