"""Differentiable ops: check inputs, dispatch to a backend, record the backward."""
from .activation import activation, geglu, gelu, relu, swiglu  # noqa: F401
from .attention import dot_product_attention  # noqa: F401
from .blocks import layernorm_linear, layernorm_mlp  # noqa: F401
from .embedding import embedding  # noqa: F401
from .elementwise import add, add_bias, dropout, reshape, softmax, split  # noqa: F401
from .linear import linear  # noqa: F401
from .loss import cross_entropy  # noqa: F401
from .rope import apply_rotary_pos_emb, apply_rotary_pos_emb_qkv  # noqa: F401
from .normalization import layernorm, normalize, rmsnorm  # noqa: F401
