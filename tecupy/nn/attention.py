"""DotProductAttention and MultiheadAttention with Transformer Engine's names and options."""
from ..ops import dot_product_attention, reshape, split
from .layers import LayerNormLinear, Linear
from .module import Module


class DotProductAttention(Module):
    """Core attention over q, k, v in qkv_format ('sbhd' or 'bshd'); returns the heads
    flattened, [s, b, h*d] or [b, s, h*d], as Transformer Engine does."""

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None,
                 attention_dropout=0.0, qkv_format="sbhd", attn_mask_type="causal",
                 softmax_scale=None, params_dtype=None, device=None, seed=None):
        super().__init__(params_dtype, device, seed)
        self.num_attention_heads, self.kv_channels = num_attention_heads, kv_channels
        self.num_gqa_groups = num_gqa_groups or num_attention_heads
        if num_attention_heads % self.num_gqa_groups:
            raise ValueError(f"num_attention_heads ({num_attention_heads}) must be a multiple "
                             f"of num_gqa_groups ({self.num_gqa_groups})")
        self.attention_dropout, self.qkv_format = attention_dropout, qkv_format
        self.attn_mask_type, self.softmax_scale = attn_mask_type, softmax_scale

    def forward(self, query, key, value, attn_mask_type=None, seqlens_q=None,
                seqlens_kv=None):
        p = self.attention_dropout if self.training else 0.0
        o = dot_product_attention(query, key, value, attn_mask_type or self.attn_mask_type,
                                  self.qkv_format, self.softmax_scale, p, seqlens_q,
                                  seqlens_kv, self.next_seed() if p > 0 else None)
        return reshape(o, o.shape[:2] + (o.shape[2] * o.shape[3],))


class MultiheadAttention(Module):
    """(LayerNorm +) fused QKV projection, core attention, output projection.
    The QKV weight is laid out [q heads | k heads | v heads] x kv_channels."""

    def __init__(self, hidden_size, num_attention_heads, kv_channels=None,
                 attention_dropout=0.1, layernorm_epsilon=1e-5, attn_mask_type="causal",
                 num_gqa_groups=None, input_layernorm=False, normalization="LayerNorm",
                 bias=True, zero_centered_gamma=False, qkv_format="sbhd", params_dtype=None,
                 device=None, seed=None):
        super().__init__(params_dtype, device, seed)
        if kv_channels is None and hidden_size % num_attention_heads:
            raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of "
                             f"num_attention_heads ({num_attention_heads}), or give kv_channels")
        self.hidden_size, self.heads = hidden_size, num_attention_heads
        self.kv_channels = kv_channels or hidden_size // num_attention_heads
        self.groups = num_gqa_groups or num_attention_heads
        self.input_layernorm = input_layernorm
        qkv_out = (self.heads + 2 * self.groups) * self.kv_channels
        kw = self._child_kwargs
        if input_layernorm:
            self.layernorm_qkv = LayerNormLinear(hidden_size, qkv_out, layernorm_epsilon, bias,
                                                 normalization, zero_centered_gamma, **kw())
        else:
            self.qkv = Linear(hidden_size, qkv_out, bias, **kw())
        self.core_attention = DotProductAttention(
            num_attention_heads, self.kv_channels, self.groups, attention_dropout, qkv_format,
            attn_mask_type, **kw())
        self.proj = Linear(self.heads * self.kv_channels, hidden_size, bias, **kw())

    def forward(self, hidden_states, attn_mask_type=None, seqlens=None):
        """hidden_states [s, b, hidden] (sbhd) or [b, s, hidden] (bshd); seqlens [b] for
        padding masks."""
        qkv = (self.layernorm_qkv if self.input_layernorm else self.qkv)(hidden_states)
        qkv = reshape(qkv, qkv.shape[:2] + (self.heads + 2 * self.groups, self.kv_channels))
        q, k, v = split(qkv, [self.heads, self.groups, self.groups], axis=2)
        ctx = self.core_attention(q, k, v, attn_mask_type, seqlens, seqlens)
        return self.proj(ctx)
