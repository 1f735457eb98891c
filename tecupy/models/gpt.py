"""A small GPT from tecupy.nn (issue 23): token embedding, N pre-LN TransformerLayers (causal
self-attention with RoPE, GELU MLP; Transformer Engine's options), a final LayerNorm and an
LM head tied to the embedding, trained with cross_entropy.

    cfg = GPTConfig(vocab_size=65, num_layers=6, hidden_size=384, num_heads=6, seq_len=256)
    model = GPT(cfg, device="cuda", seed=0)
    with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=recipe):
        loss = model(x, y)              # x, y: int [batch, seq] (the data loader's layout)
    opt.step(tape.gradient(loss, model))

Layout: the data loader gives [batch, seq]; TransformerLayer's default is sbhd, [seq, batch,
hidden]. The ids are transposed before the embedding (ids and targets are integers: nothing
differentiable moves, so the tape needs no transpose op) and every activation stays sbhd.
The LM head runs outside FP8 (a nested fp8_autocast(enabled=False)): vocabularies such as
65 break FP8's GEMM shape rule, and Transformer Engine's GPT recipes keep the head in
high precision too.
"""
import dataclasses

import numpy as np

from .. import _check
from ..autocast import fp8_autocast
from ..nn import Embedding, LayerNorm, Module, RotaryPositionEmbedding, TransformerLayer
from ..nn.module import resolve_dtype
from ..ops import cross_entropy, linear


@dataclasses.dataclass
class GPTConfig:
    """The model's sizes. ffn_hidden_size None: 4 * hidden_size. params_dtype: None
    (float32) or a floating dtype, e.g. tecupy.bfloat16; a str names one ("bfloat16")."""
    vocab_size: int = 65
    num_layers: int = 6
    hidden_size: int = 384
    num_heads: int = 6
    ffn_hidden_size: int = None
    seq_len: int = 256
    dropout: float = 0.0
    params_dtype: object = None

    def __post_init__(self):
        op = "GPTConfig"
        for name in ("vocab_size", "num_layers", "hidden_size", "num_heads", "seq_len"):
            setattr(self, name, _check.size(op, name, getattr(self, name)))
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        self.ffn_hidden_size = _check.size(op, "ffn_hidden_size", self.ffn_hidden_size)
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            _check.fail(op, "hidden_size", f"a multiple of num_heads ({self.num_heads}) with "
                        "an even head size (RoPE rotates pairs)", self.hidden_size)
        self.dropout = _check.real(op, "dropout", self.dropout, 0, 1, high_open=True)
        self.params_dtype = resolve_dtype(op, self.params_dtype)

    def to_dict(self):
        """JSON values (params_dtype by name), for a checkpoint's extra."""
        d = dataclasses.asdict(self)
        d["params_dtype"] = self.params_dtype.name
        return d

    @classmethod
    def from_dict(cls, d):
        return cls(**d)


class GPT(Module):
    """forward(ids [b, s], targets [b, s] or None) -> the mean cross entropy (float32 [])
    with targets, else the logits [s, b, vocab] (sbhd, like every activation inside)."""

    def __init__(self, config, device=None, seed=None):
        if not isinstance(config, GPTConfig):
            _check.fail("GPT", "config", "a tecupy.models.GPTConfig", config, TypeError)
        super().__init__(config.params_dtype, device, _check.seed("GPT", "seed", seed))
        self.config = c = config
        kw = self._child_kwargs
        self.embedding = Embedding(c.vocab_size, c.hidden_size, **kw())
        for i in range(c.num_layers):  # attributes, so named_parameters finds them
            setattr(self, f"layer{i}", TransformerLayer(
                c.hidden_size, c.ffn_hidden_size, c.num_heads, hidden_dropout=c.dropout,
                attention_dropout=c.dropout, self_attn_mask_type="causal",
                normalization="LayerNorm", activation="gelu", attn_input_format="sbhd",
                **kw()))
        self.final_norm = LayerNorm(c.hidden_size, **kw())
        self.rope = RotaryPositionEmbedding(c.hidden_size // c.num_heads, device=self.device)
        # RotaryPositionEmbedding takes no seed: its (unused) generator would be seeded from
        # the OS, and two runs' checkpoints would differ in rope.rng_state
        self.rope.rng = np.random.default_rng(kw()["seed"])
        self._freqs = {}

    @property
    def layers(self):
        return [getattr(self, f"layer{i}") for i in range(self.config.num_layers)]

    def freqs(self, seq_len):
        """RoPE frequencies [seq_len, 1, 1, head_dim], made once per length (a replayed CUDA
        graph reads the cached array)."""
        if seq_len not in self._freqs:
            self._freqs[seq_len] = self.rope(seq_len)
        return self._freqs[seq_len]

    def _check_ids(self, name, ids):
        xp, s = self.xp, self.config.seq_len
        if not (isinstance(ids, xp.ndarray) and ids.ndim == 2 and ids.dtype.kind in "iu"
                and 1 <= ids.shape[1] <= s):
            _check.fail("GPT", name, f"an int {xp.__name__} array [batch, seq <= {s}]", ids,
                        TypeError if not isinstance(ids, xp.ndarray) else ValueError)

    def forward(self, ids, targets=None):
        self._check_ids("ids", ids)
        xp = self.xp
        h = self.embedding(xp.ascontiguousarray(ids.T))  # [s, b, hidden]
        freqs = self.freqs(ids.shape[1])
        for layer in self.layers:
            h = layer(h, rotary_pos_emb=freqs)
        h = self.final_norm(h)
        with fp8_autocast(enabled=False):  # the LM head in high precision (module docstring)
            logits = linear(h, self.embedding.weight)
        if targets is None:
            return logits
        self._check_ids("targets", targets)
        if targets.shape != ids.shape:
            raise ValueError(f"GPT: targets must have the shape of ids {tuple(ids.shape)}, "
                             f"got {tuple(targets.shape)}")
        return cross_entropy(logits, xp.ascontiguousarray(targets.T))

    def num_parameters(self):
        return int(sum(np.prod(p.shape) for p in self.parameters()))
