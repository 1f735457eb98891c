"""The tape: accumulation, unbroadcasting, multiple outputs, structures, clear errors."""
import numpy as np
import pytest

import tecupy
from conftest import asnp


def test_array_used_twice_accumulates(xp, rng):
    x = xp.asarray(rng.standard_normal((5, 7)))
    w = xp.asarray(rng.standard_normal((3, 7)))
    with tecupy.Tape() as tape:
        y = tecupy.add(tecupy.linear(x, w), tecupy.linear(x, w))
    dy = xp.asarray(rng.standard_normal((5, 3)))
    dx, dw = tape.gradient(y, [x, w], output_grad=dy)
    np.testing.assert_allclose(asnp(dx), 2 * asnp(dy) @ asnp(w), rtol=1e-12)
    np.testing.assert_allclose(asnp(dw), 2 * asnp(dy).T @ asnp(x), rtol=1e-12)


def test_broadcast_add_is_unbroadcast(rng):
    a, b = rng.standard_normal((4, 6)), rng.standard_normal((6,))
    c = rng.standard_normal((4, 1))
    with tecupy.Tape() as tape:
        y = tecupy.add(tecupy.add(a, b), c)
    ga, gb, gc = tape.gradient(y, [a, b, c])
    np.testing.assert_array_equal(ga, np.ones((4, 6)))
    np.testing.assert_array_equal(gb, np.full(6, 4.0))
    np.testing.assert_array_equal(gc, np.full((4, 1), 6.0))


def test_default_output_grad_is_ones_and_multiple_outputs(rng):
    x = rng.standard_normal((4, 6))
    with tecupy.Tape() as tape:
        a, b = tecupy.split(x, [2, 4], axis=1)
        y1, y2 = tecupy.relu(a), tecupy.reshape(b, (8, 2))
    (gx,) = tape.gradient([y1, y2], [x])
    want = np.concatenate([(x[:, :2] > 0) * 1.0, np.ones((4, 4))], axis=1)
    np.testing.assert_array_equal(gx, want)


def test_unused_array_on_tape_gets_zeros_and_single_wrt(rng):
    x, z = rng.standard_normal(5), rng.standard_normal(5)
    with tecupy.Tape() as tape:
        y = tecupy.relu(x)
        tecupy.gelu(z)
    gz = tape.gradient(y, z)
    assert isinstance(gz, np.ndarray) and np.all(gz == 0)


def test_dict_and_module_wrt(rng):
    lin = tecupy.nn.Linear(6, 4, device="cpu", params_dtype=np.float64, seed=0)
    x = rng.standard_normal((3, 6))
    with tecupy.Tape() as tape:
        y = lin(x)
    g = tape.gradient(y, lin)
    assert set(g) == {"weight", "bias"}
    np.testing.assert_allclose(g["bias"], np.full(4, 3.0))
    g2 = tape.gradient(y, {"input": x})
    np.testing.assert_allclose(g2["input"], np.ones((3, 4)) @ lin.weight)


def test_nested_tapes_both_record(rng):
    x = rng.standard_normal(4)
    with tecupy.Tape() as outer:
        with tecupy.Tape() as inner:
            y = tecupy.relu(x)
        z = tecupy.gelu(y)
    assert inner.gradient(y, x).shape == (4,)
    assert outer.gradient(z, x).shape == (4,)
    with pytest.raises(ValueError, match="not produced"):
        inner.gradient(z, x)


def test_errors_are_clear(rng):
    x = rng.standard_normal((4, 4))
    with tecupy.Tape() as tape:
        y = tecupy.relu(x)
    with pytest.raises(ValueError, match=r"wrt\[0\].*not on this tape"):
        tape.gradient(y, [x[:2]])  # a slice is a new array
    with pytest.raises(ValueError, match="not produced by a tecupy op"):
        tape.gradient(x * 2, [x])
    with pytest.raises(ValueError, match="output_grad 0 has shape"):
        tape.gradient(y, [x], output_grad=np.ones(3))
    with pytest.raises(ValueError, match="1 outputs but 2 output grads"):
        tape.gradient(y, [x], output_grad=[np.ones((4, 4))] * 2)


def test_no_recording_without_tape(rng):
    x = rng.standard_normal(3)
    tecupy.relu(x)
    with tecupy.Tape() as tape:
        pass
    with pytest.raises(ValueError):
        tape.gradient(tecupy.relu(x), x)


def test_loss_is_an_array_that_chains(rng):
    logits, target = rng.standard_normal((6, 5)), rng.integers(0, 5, 6)
    with tecupy.Tape() as tape:
        loss = tecupy.cross_entropy(logits, target)
        total = tecupy.add(loss, tecupy.cross_entropy(logits, target, reduction="sum"))
    assert isinstance(loss, np.ndarray) and loss.shape == ()
    g = tape.gradient(total, logits)
    assert g.shape == logits.shape
