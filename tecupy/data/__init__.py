"""Training data for a small language model: the shipped text, a character tokenizer, a
train/validation split and a seeded batch loader whose position can be saved and restored.

    text = load_text()                            # tiny shakespeare, 1.1 MB (README.md here)
    tok = CharTokenizer.from_text(text)           # 65 characters
    train, val = train_val_split(tok.encode(text))  # last 10% is validation
    batches = Batches(train, batch=8, seq_len=256, seed=0, xp=cupy)
    x, y = next(batches)                          # int32 [8, 256]; y[:, t] = x[:, t + 1]
    extra = {"data": batches.state_dict(), "vocab": tok.vocab}  # JSON: tecupy.save's extra

Batch i depends only on (seed, i): resuming at step i (load_state_dict) sees the batches an
uninterrupted run would have seen, whatever happened in between.
"""
import numbers
from importlib import resources

import numpy as np

TEXTS = {"shakespeare": "tinyshakespeare.txt"}


def load_text(name="shakespeare"):
    """The text of a shipped data set as a str (names: TEXTS)."""
    if name not in TEXTS:
        raise ValueError(f"load_text: unknown text {name!r}; shipped: {sorted(TEXTS)}")
    return resources.files(__name__).joinpath(TEXTS[name]).read_text(encoding="utf-8")


class CharTokenizer:
    """One token per character; ids are positions in `vocab` (a list of one-character
    strings, sorted when built from a text). Save the tokenizer as `tok.vocab` (a plain list,
    JSON-able) and rebuild it with CharTokenizer(vocab)."""

    def __init__(self, vocab):
        vocab = list(vocab)
        bad = [c for c in vocab if not (isinstance(c, str) and len(c) == 1)]
        if bad or len(set(vocab)) != len(vocab) or not vocab:
            raise ValueError("CharTokenizer: vocab must be a non-empty list of distinct "
                             f"one-character strings; got {bad[:5] or 'duplicates or none'}")
        self.vocab = vocab
        self._ids = {c: i for i, c in enumerate(vocab)}
        # a lookup table over code points makes encode a single numpy gather
        self._table = np.full(max(map(ord, vocab)) + 1, -1, np.int32)
        self._table[[ord(c) for c in vocab]] = np.arange(len(vocab), dtype=np.int32)

    @classmethod
    def from_text(cls, text):
        return cls(sorted(set(text)))

    @property
    def vocab_size(self):
        return len(self.vocab)

    def __repr__(self):
        return f"CharTokenizer(vocab_size={self.vocab_size})"

    def encode(self, text):
        """int32 ids [len(text)]; a character outside the vocab is a ValueError naming it."""
        codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        ids = self._table[np.minimum(codes, len(self._table) - 1)]
        bad = (ids < 0) | (codes >= len(self._table))
        if bad.any():
            chars = sorted({text[i] for i in np.flatnonzero(bad)[:100]})
            raise ValueError(f"CharTokenizer.encode: characters not in the vocab: {chars}")
        return ids

    def decode(self, ids):
        """The text of a 1-D sequence of ids (numpy, cupy or a list)."""
        ids = np.asarray(ids.get() if hasattr(ids, "get") else ids)
        if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size)):
            raise ValueError(f"CharTokenizer.decode: expected 1-D ids in [0, {self.vocab_size})"
                             f", got shape {ids.shape}")
        return "".join(self.vocab[i] for i in ids.tolist())


def train_val_split(tokens, val_fraction=0.1):
    """(train, val): the first (1 - val_fraction) of `tokens` and the rest, as views.
    Deterministic and contiguous, so no validation text leaks into training windows."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"train_val_split: val_fraction must be in [0, 1), got {val_fraction}")
    n = len(tokens) - int(round(len(tokens) * val_fraction))
    return tokens[:n], tokens[n:]


def _positive_int(name, v):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise ValueError(f"Batches: {name} must be an int >= 1, got {v!r}")
    return int(v)


class Batches:
    """Random windows of a 1-D token array: next(batches) -> (x, y), int32 [batch, seq_len]
    arrays of `xp` (numpy or cupy), y = x shifted by one token. Batch i takes its start
    offsets from numpy's default_rng([seed, i]) (uniform over every full window), so the
    state is just (seed, step): state_dict() / load_state_dict() save and restore it."""

    def __init__(self, tokens, batch, seq_len, seed=0, xp=np):
        tokens = np.asarray(tokens.get() if hasattr(tokens, "get") else tokens)
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ValueError("Batches: tokens must be a 1-D integer array, got "
                             f"{tokens.dtype} of shape {tokens.shape}")
        self.batch, self.seq_len = _positive_int("batch", batch), _positive_int("seq_len", seq_len)
        if len(tokens) < self.seq_len + 1:
            raise ValueError(f"Batches: {len(tokens)} tokens hold no window of seq_len + 1 = "
                             f"{self.seq_len + 1}")
        self.seed = _seed(seed)
        self.step = 0
        self.xp = xp
        self.tokens = xp.asarray(tokens.astype(np.int32))  # one copy to the device, up front
        self._cols = xp.arange(self.seq_len + 1, dtype=np.int32)

    def __iter__(self):
        return self

    def __next__(self):
        out = self.batch_at(self.step)
        self.step += 1
        return out

    def batch_at(self, step):
        """Batch number `step` (what next() returns at that step), without moving."""
        rng = np.random.default_rng([self.seed, _seed(step)])
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch)
        idx = self.xp.asarray(starts.astype(np.int32))[:, None] + self._cols
        window = self.tokens[idx]  # [batch, seq_len + 1], gathered on the device
        xp = self.xp
        return xp.ascontiguousarray(window[:, :-1]), xp.ascontiguousarray(window[:, 1:])

    def state_dict(self):
        """{"seed": int, "step": int}: JSON-able, for tecupy.save(..., extra=...)."""
        return {"seed": self.seed, "step": self.step}

    def load_state_dict(self, state):
        """Continue from a state_dict(); the seed must be this loader's (another seed is
        another data order: a ValueError, nothing changes)."""
        if not isinstance(state, dict) or set(state) != {"seed", "step"}:
            raise ValueError(f"Batches.load_state_dict: expected {{'seed', 'step'}}, got {state!r}")
        if _seed(state["seed"]) != self.seed:
            raise ValueError(f"Batches.load_state_dict: saved seed {state['seed']} differs from "
                             f"this loader's {self.seed}")
        self.step = _seed(state["step"])
        return self


def _seed(v):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
        raise ValueError(f"Batches: seed and step must be ints >= 0, got {v!r}")
    return int(v)
