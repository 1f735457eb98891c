"""Embedding (token table) and RotaryPositionEmbedding (RoPE frequencies), what a GPT needs
around its transformer layers besides the LM head (a linear on the embedding's weight)."""
import numpy as np

from .. import _check
from ..ops.embedding import embedding
from .module import Module

EMBEDDING_STD = 0.02  # GPT-2's and Megatron's init of the token table (not TE's 0.023)


class Embedding(Module):
    """weight [num_embeddings, embedding_dim] ~ normal(0, 0.02); forward(ids [...]) ->
    [..., embedding_dim]. Tie an LM head with tecupy.linear(h, emb.weight): the tape sums
    the two gradients into the one weight."""

    def __init__(self, num_embeddings, embedding_dim, params_dtype=None, device=None,
                 seed=None):
        op = "Embedding"
        num_embeddings = _check.size(op, "num_embeddings", num_embeddings)
        embedding_dim = _check.size(op, "embedding_dim", embedding_dim)
        super().__init__(params_dtype, device, _check.seed(op, "seed", seed))
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        host = self.rng.normal(0.0, EMBEDDING_STD, size=(num_embeddings, embedding_dim))
        self.weight = self.xp.asarray(host.astype(self.params_dtype))
        self._param_names.append("weight")

    def forward(self, ids):
        return embedding(self.weight, ids)


class RotaryPositionEmbedding(Module):
    """Transformer Engine's RotaryPositionEmbedding: call(max_seq_len, offset=0) -> freqs
    [max_seq_len, 1, 1, d2] float32, d2 = int(dim * rotary_percent) (even), each row
    cat(f, f) with f[i] = pos * rotary_base ** (-2i / d2) (the non-interleaved layout that
    apply_rotary_pos_emb takes). pos = arange + offset, divided by
    seq_len_interpolation_factor when given (position interpolation); with
    pretrained_max_position_embeddings too, by max_seq_len / pretrained when max_seq_len
    exceeds pretrained * factor (TE's dynamic scaling). Computed on the device (no copy
    from the host: capturable in a CUDA graph)."""

    def __init__(self, dim, rotary_percent=1.0, seq_len_interpolation_factor=None,
                 rotary_base=10000.0, pretrained_max_position_embeddings=None, device=None):
        op = "RotaryPositionEmbedding"
        dim = _check.size(op, "dim", dim)
        pct = _check.real(op, "rotary_percent", rotary_percent, 0, 1, low_open=True)
        d2 = int(dim * pct) if pct < 1.0 else dim
        if d2 < 2 or d2 % 2:
            _check.fail(op, "rotary_percent", f"a fraction of dim ({dim}) giving an even "
                        "rotary dimension >= 2", rotary_percent)
        self.rotary_base = _check.real(op, "rotary_base", rotary_base, 0, low_open=True)
        self.seq_len_interpolation_factor = self._optional(op, "seq_len_interpolation_factor",
                                                           seq_len_interpolation_factor)
        self.pretrained_max_position_embeddings = self._optional(
            op, "pretrained_max_position_embeddings", pretrained_max_position_embeddings)
        super().__init__(None, device, None)
        exps = np.arange(0, d2, 2, dtype=np.float32) / np.float32(d2)
        self.inv_freq = self.xp.asarray(1.0 / np.float32(self.rotary_base) ** exps)
        self.dim = d2

    @staticmethod
    def _optional(op, name, value):
        return None if value is None else _check.real(op, name, value, 0, low_open=True)

    def forward(self, max_seq_len, offset=0):
        op = "RotaryPositionEmbedding"
        max_seq_len = _check.size(op, "max_seq_len", max_seq_len)
        offset = _check.integer(op, "offset", offset, 0)
        xp = self.xp
        seq = xp.arange(max_seq_len, dtype=np.float32) + np.float32(offset)
        factor, pretrained = self.seq_len_interpolation_factor, \
            self.pretrained_max_position_embeddings
        if factor is not None:
            if pretrained is not None and max_seq_len > pretrained * factor:
                seq *= np.float32(1 / (max_seq_len / pretrained))
            else:
                seq *= np.float32(1 / factor)
        f = xp.outer(seq, self.inv_freq).astype(np.float32)
        return xp.concatenate([f, f], axis=-1).reshape(max_seq_len, 1, 1, self.dim)
