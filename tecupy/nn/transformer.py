"""TransformerLayer: pre-norm self-attention and MLP blocks with residuals (TE's default).

    h   = x + dropout(MultiheadAttention(LayerNorm(x)))
    out = h + dropout(LayerNormMLP(h))
"""
from ..ops import dropout
from .attention import MultiheadAttention
from .layers import LayerNormMLP
from .module import Module


class TransformerLayer(Module):
    def __init__(self, hidden_size, ffn_hidden_size, num_attention_heads, num_gqa_groups=None,
                 layernorm_epsilon=1e-5, hidden_dropout=0.1, attention_dropout=0.1,
                 self_attn_mask_type="causal", normalization="LayerNorm", activation="gelu",
                 bias=True, zero_centered_gamma=False, kv_channels=None,
                 attn_input_format="sbhd", params_dtype=None, device=None, seed=None):
        super().__init__(params_dtype, device, seed)
        self.hidden_dropout = hidden_dropout
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

    def forward(self, hidden_states, self_attn_mask_type=None, seqlens=None):
        """hidden_states [s, b, hidden] ('sbhd') or [b, s, hidden] ('bshd')."""
        attn = self.self_attention(hidden_states, self_attn_mask_type, seqlens)
        h = self._dropout_add(attn, hidden_states)
        return self._dropout_add(self.layernorm_mlp(h), h)
