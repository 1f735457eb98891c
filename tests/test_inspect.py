"""FP8Inspector (tecupy/inspect.py): its numbers against an independent NumPy computation of
Transformer Engine's cast (scale in float32, saturate to +-max, round to nearest even through
ml_dtypes, NaN stays NaN), its labels, steps, exports, the zero-cost path and its errors."""
import csv

import numpy as np
import pytest

import tecupy
from tecupy import fp8, nn, recipe
from tecupy.fp8_state import FP8Meta
from tecupy.inspect import ACTIVE_INSPECTOR, FIELDS, FP8Inspector
from tecupy.quantization import DelayedQuantizer


def min_subnormal(fmt):
    return 2.0 ** (1 - fmt.bias - fmt.mbits)


def known_input(rng, fmt, scale, n=1000):
    """float32 x with known counts: (x, flushed, saturated). Boundaries: exactly half the
    smallest subnormal rounds to even (0: flushed), a little above rounds up (kept); exactly
    max is kept, a little above and inf saturate. NaN and zeros are in neither count."""
    half = min_subnormal(fmt) / 2
    over = fmt.max * 1.03
    special = ([half, -half, half * 0.3] * 7 + [half * 1.01] * 5 + [over, -over] * 4
               + [np.inf, -np.inf, fmt.max] + [np.nan] * 6 + [0.0] * 9)
    m = n - len(special)
    bulk = rng.uniform(0.01, 0.9, m) * fmt.max * rng.choice([-1, 1], m)
    x = np.concatenate([np.array(special), bulk]) / scale
    x = rng.permutation(x).astype(np.float32)
    return x, 21, 10


def numpy_stats(x, fmt, scale):
    """(underflow, overflow, rel_error) computed independently with ml_dtypes."""
    v = x.astype(np.float32) * np.float32(scale)
    q = np.clip(v, -fmt.max, fmt.max).astype(fmt.ml_dtype).astype(np.float64)  # NaN stays
    valid = ~np.isnan(x)
    nonzero = valid & (x != 0)
    under = np.count_nonzero(nonzero & (q == 0)) / np.count_nonzero(nonzero)
    over = np.count_nonzero(valid & (np.abs(v) > fmt.max)) / np.count_nonzero(valid)
    fin = np.isfinite(x)
    deq = q * np.float64(np.float32(1) / np.float32(scale))
    rel = np.linalg.norm(deq[fin] - x[fin]) / np.linalg.norm(x[fin].astype(np.float64))
    return under, over, rel


def quantizer(xp, fmt, scale, which="input"):
    meta = FP8Meta(xp, 3, 4, fmt)
    meta.scale[...] = np.float32(scale)
    q = DelayedQuantizer(meta, 0, (id(meta), 0, which))
    q.meta = meta  # (alive: a freed meta's id could label the next one)
    return q


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2])
def test_counts_match_numpy_exactly(xp, rng, fmt):
    scale = 2.0 ** rng.integers(-3, 4)
    x, flushed, saturated = known_input(rng, fmt, scale)
    q = quantizer(xp, fmt, scale)
    with FP8Inspector(exact=True) as ins:
        q.quantize(xp.asarray(x))
    r = ins.to_dict()["state0.gemm0.input"]
    valid = np.count_nonzero(~np.isnan(x))
    nonzero = np.count_nonzero(~np.isnan(x) & (x != 0))
    under, over, rel = numpy_stats(x, fmt, scale)
    assert (under, over) == (flushed / nonzero, saturated / valid)
    assert r["underflow"][0] == under and r["overflow"][0] == over
    np.testing.assert_allclose(r["rel_error"][0], rel, rtol=1e-12)
    assert r["amax"][0] == np.max(np.abs(x[~np.isnan(x)]))  # inf here
    assert r["scale"][0] == scale and r["numel"][0] == x.size
    assert ins.formats == {"state0.gemm0.input": fmt.name}


def test_rel_error_on_a_strided_sample(rng):
    x = rng.standard_normal(1000).astype(np.float32)
    q = quantizer(np, fp8.E4M3, 64.0)
    with FP8Inspector(sample=100) as sampled:
        q.quantize(x)
    with FP8Inspector(exact=True, sample=100) as full:
        q.quantize(x)
    rel_sampled = sampled.to_dict()["state0.gemm0.input"]["rel_error"][0]
    rel_full = full.to_dict()["state0.gemm0.input"]["rel_error"][0]
    np.testing.assert_allclose(rel_sampled, numpy_stats(x[::10], fp8.E4M3, 64.0)[2], rtol=1e-12)
    np.testing.assert_allclose(rel_full, numpy_stats(x, fp8.E4M3, 64.0)[2], rtol=1e-12)
    # the counts are always over every element
    assert sampled.to_dict()["state0.gemm0.input"]["numel"][0] == 1000


def test_steps_aggregate_and_missing_steps_are_nan(rng):
    q = quantizer(np, fp8.E4M3, 1.0)
    w = quantizer(np, fp8.E4M3, 1.0, "weight")
    a, b = np.float32([1.0, 1e-5, 3.0]), np.float32([1000.0, 2.0])
    with FP8Inspector() as ins:
        q.quantize(a)
        q.quantize(b)  # the same tensor twice in a step (micro-batches): one row
        ins.step()
        w.quantize(a)
        ins.step()
        ins.step()  # an empty step counts
    d = ins.to_dict()
    assert ins.steps == 3 and ins.labels == ["state0.gemm0.input", "state1.gemm0.weight"]
    r = d["state0.gemm0.input"]
    assert r["amax"][0] == 1000.0 and r["numel"][0] == 5
    assert r["underflow"][0] == 1 / 5 and r["overflow"][0] == 1 / 5
    assert np.isnan(r["amax"][1:]).all()
    assert np.isnan(d["state1.gemm0.weight"]["amax"][[0, 2]]).all()
    assert set(r) == set(FIELDS)


def _train_step(m, x, rec):
    with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=rec):
        y = m(x)
    tape.gradient(y, [x], np.ones_like(y))


def test_module_labels_and_filters(rng):
    m = nn.TransformerLayer(32, 64, 2, hidden_dropout=0.0, attention_dropout=0.0,
                            device="cpu", seed=0)
    x = rng.standard_normal((2, 8, 32)).astype(np.float32)
    with FP8Inspector(m) as ins:
        _train_step(m, x, recipe.DelayedScaling())
    assert {"self_attention.proj.gemm0.input", "self_attention.proj.gemm0.grad_output",
            "layernorm_mlp.gemm1.weight"} <= set(ins.labels)
    # a producer-fused cast (the norm writes FP8): amax and scale only
    fused = ins.to_dict()["layernorm_mlp.gemm0.input"]
    assert fused["amax"][0] > 0 and fused["scale"][0] == 1.0
    assert np.isnan([fused[f][0] for f in ("underflow", "overflow", "rel_error")]).all()
    with FP8Inspector({"mlp": m.layernorm_mlp}, tensors=("weight",)) as ins:
        _train_step(m, x, recipe.DelayedScaling())
    assert ins.labels == ["mlp.gemm0.weight", "mlp.gemm1.weight"]


def test_functional_state_and_current_scaling(rng):
    x = rng.standard_normal((16, 32)).astype(np.float32)
    w = rng.standard_normal((16, 32)).astype(np.float32)
    state = tecupy.FP8State()
    with FP8Inspector({"lin": state}) as ins:
        with tecupy.fp8_autocast():
            tecupy.linear(x, w, fp8_state=state)
            tecupy.linear(x, w)  # current scaling (no state): not in `modules`
    assert ins.labels == ["lin.gemm0.input", "lin.gemm0.weight"]
    with FP8Inspector() as ins:
        with tecupy.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
            tecupy.linear(x, w)
            tecupy.linear(x * 1000, w)
    d = ins.to_dict()
    assert d["current1.input"]["amax"][0] == np.float32(np.abs(x * 1000).max())
    np.testing.assert_allclose(d["current0.input"]["scale"][0], 448 / np.abs(x).max(), rtol=1e-6)


def test_to_csv(tmp_path, rng):
    q = quantizer(np, fp8.E5M2, 1.0, "grad_output")
    with FP8Inspector() as ins:
        for _ in range(2):
            q.quantize(rng.standard_normal(50).astype(np.float32))
            ins.step()
    ins.to_csv(tmp_path / "f.csv")
    with open(tmp_path / "f.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["tensor"], r["format"]) for r in rows] == [
        ("0", "state0.gemm0.grad_output", "e5m2"), ("1", "state0.gemm0.grad_output", "e5m2")]
    assert float(rows[1]["amax"]) == ins.to_dict()["state0.gemm0.grad_output"]["amax"][1]


def test_disabled_costs_no_hook_call(monkeypatch, rng):
    def boom(*args):
        raise AssertionError("record called with no inspector active")
    monkeypatch.setattr(FP8Inspector, "record", boom)
    m = nn.LayerNormMLP(32, 64, device="cpu", seed=0)
    _train_step(m, rng.standard_normal((16, 32)).astype(np.float32), recipe.DelayedScaling())
    assert ACTIVE_INSPECTOR.get() is None


def test_exit_on_error_and_reentry():
    ins = FP8Inspector()
    with pytest.raises(KeyError):
        with ins:
            raise KeyError
    assert ACTIVE_INSPECTOR.get() is None
    with ins:
        with pytest.raises(RuntimeError, match="already active"):
            ins.__enter__()


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(modules=5), TypeError, "modules"),
    (dict(modules={"a": 5}), TypeError, "modules"),
    (dict(tensors="input"), TypeError, "tensors"),
    (dict(tensors=("input", "output")), ValueError, "tensors"),
    (dict(tensors=()), ValueError, "tensors"),
    (dict(exact="yes"), TypeError, "exact"),
    (dict(sample=0), ValueError, "sample"),
    (dict(sample=1.5), TypeError, "sample"),
])
def test_bad_arguments_name_the_argument(kwargs, exc, name):
    with pytest.raises(exc, match=f"FP8Inspector: {name} must be"):
        FP8Inspector(**kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, tecupy.bfloat16])
def test_cupy_path_equals_numpy_path(rng, dtype):
    import cupy
    x = (rng.standard_normal((256, 128)) * 30).astype(np.float32)
    x[::7, ::5] = 1e-6
    x = x.astype(dtype)
    out = []
    for xp in (np, cupy):
        with FP8Inspector(sample=1000) as ins:
            quantizer(xp, fp8.E4M3, 8.0).quantize(xp.asarray(x), transpose=True)
        out.append(ins.to_dict()["state0.gemm0.input"])
    for f in FIELDS:
        np.testing.assert_allclose(out[1][f], out[0][f], rtol=1e-12, err_msg=f)
