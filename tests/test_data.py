"""tecupy.data: the shipped text, the character tokenizer, the split and the seeded batch
loader (issue 23)."""
import hashlib
import json

import numpy as np
import pytest

from tecupy import data
from conftest import asnp


@pytest.fixture(scope="module")
def text():
    return data.load_text()


def test_shipped_text_is_the_documented_file(text):
    """Byte for byte the file its README names (karpathy/char-rnn's tinyshakespeare)."""
    assert len(text) == 1115394 and text.startswith("First Citizen:\nBefore we proceed")
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert digest == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    with pytest.raises(ValueError, match="unknown text 'nope'.*shakespeare"):
        data.load_text("nope")


def test_char_tokenizer_round_trip(text):
    tok = data.CharTokenizer.from_text(text)
    assert tok.vocab_size == 65 and tok.vocab[0] == "\n" and tok.vocab == sorted(tok.vocab)
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.shape == (len(text),)
    assert tok.decode(ids[:5000]) == text[:5000]
    assert tok.decode(ids[:3].tolist()) == text[:3]
    saved = json.loads(json.dumps(tok.vocab))  # a plain list: goes into a checkpoint's extra
    np.testing.assert_array_equal(data.CharTokenizer(saved).encode(text[:1000]), ids[:1000])


def test_char_tokenizer_errors():
    tok = data.CharTokenizer.from_text("abc")
    assert tok.encode("").shape == (0,) and tok.decode([]) == ""
    with pytest.raises(ValueError, match=r"not in the vocab: \['z', 'é'\]"):
        tok.encode("abzcé")
    with pytest.raises(ValueError, match=r"1-D ids in \[0, 3\)"):
        tok.decode([0, 3])
    with pytest.raises(ValueError, match="distinct one-character"):
        data.CharTokenizer(["a", "a"])
    with pytest.raises(ValueError, match="distinct one-character"):
        data.CharTokenizer(["ab"])


def test_train_val_split():
    tokens = np.arange(1000, dtype=np.int32)
    train, val = data.train_val_split(tokens)
    assert len(train) == 900 and len(val) == 100 and val[0] == 900 and train[-1] == 899
    assert len(data.train_val_split(tokens, 0.0)[1]) == 0
    with pytest.raises(ValueError, match="val_fraction"):
        data.train_val_split(tokens, 1.0)


def test_batches_shift_and_determinism(xp):
    tokens = np.arange(5000, dtype=np.int64)
    b = data.Batches(tokens, batch=4, seq_len=16, seed=1, xp=xp)
    x, y = next(b)
    assert type(x) is xp.ndarray and x.dtype == np.int32 and x.shape == (4, 16)
    assert x.flags.c_contiguous and y.flags.c_contiguous
    x, y = asnp(x), asnp(y)
    np.testing.assert_array_equal(y, x + 1)  # arange: the next token is +1
    assert int(x.min()) >= 0 and int(y.max()) < 5000
    same = data.Batches(tokens, 4, 16, seed=1, xp=xp)
    other = data.Batches(tokens, 4, 16, seed=2, xp=xp)
    np.testing.assert_array_equal(asnp(next(same)[0]), x)
    assert not np.array_equal(asnp(next(other)[0]), x)
    assert not np.array_equal(asnp(next(b)[0]), x)  # the next batch is another one


def test_batches_resume_and_cover_every_window():
    tokens = np.arange(40, dtype=np.int32)
    a = data.Batches(tokens, 8, 5, seed=0)
    seen = np.concatenate([next(a)[0][:, 0] for _ in range(50)])
    assert seen.min() == 0 and seen.max() == 40 - 6  # the last full window is reachable
    b = data.Batches(tokens, 8, 5, seed=0)
    state = json.loads(json.dumps({"step": 7, "seed": 0}))
    b.load_state_dict(state)
    np.testing.assert_array_equal(next(b)[0], a.batch_at(7)[0])
    assert b.state_dict() == {"seed": 0, "step": 8}
    with pytest.raises(ValueError, match="saved seed 1 differs"):
        b.load_state_dict({"seed": 1, "step": 0})
    with pytest.raises(ValueError, match="expected"):
        b.load_state_dict({"step": 0})
    assert b.step == 8  # refused states change nothing


def test_batches_errors():
    with pytest.raises(ValueError, match="1-D integer"):
        data.Batches(np.zeros(10, np.float32), 2, 4)
    with pytest.raises(ValueError, match="hold no window"):
        data.Batches(np.zeros(4, np.int32), 2, 4)
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        data.Batches(np.zeros(10, np.int32), 0, 4)
    with pytest.raises(ValueError, match="seed and step"):
        data.Batches(np.zeros(10, np.int32), 2, 4, seed=-1)


def test_shakespeare_pipeline(text):
    tok = data.CharTokenizer.from_text(text)
    train, val = data.train_val_split(tok.encode(text))
    x, y = next(data.Batches(val, 2, 64, seed=0))
    assert tok.decode(x[0]) in text[len(text) - len(val):]
    assert tok.decode(y[0])[:-1] == tok.decode(x[0])[1:]
