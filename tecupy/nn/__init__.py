"""Modules with Transformer Engine's names and constructor options."""
from .attention import DotProductAttention, MultiheadAttention  # noqa: F401
from .embedding import Embedding, RotaryPositionEmbedding  # noqa: F401
from .layers import LayerNorm, LayerNormLinear, LayerNormMLP, Linear, RMSNorm  # noqa: F401
from .module import Module  # noqa: F401
from .transformer import TransformerLayer  # noqa: F401
