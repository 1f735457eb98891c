"""FP8Inspector (tecupy/inspect.py): its numbers against an independent NumPy computation of
Transformer Engine's cast (scale in float32, saturate to +-max, round to nearest even through
ml_dtypes, NaN stays NaN), its labels, steps, exports, the zero-cost path and its errors."""
import csv
import types

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
    # producer-fused casts (the norm writes FP8; the dGELU's cast of fc1's dy): from codes
    d = ins.to_dict()
    for label in ("layernorm_mlp.gemm0.input", "layernorm_mlp.gemm0.grad_output"):
        assert ins.counted_from[label] == "codes"
        assert d[label]["amax"][0] > 0 and d[label]["scale"][0] == 1.0
        assert 0 <= d[label]["underflow"][0] < 1 and np.isnan(d[label]["rel_error"][0])
    assert ins.counted_from["layernorm_mlp.gemm1.grad_output"] == "input"
    with FP8Inspector({"mlp": m.layernorm_mlp}, tensors=("weight",)) as ins:
        _train_step(m, x, recipe.DelayedScaling())
    assert ins.labels == ["mlp.gemm0.weight", "mlp.gemm1.weight"]


def test_functional_state_and_current_scaling(rng):
    x = rng.standard_normal((16, 32)).astype(np.float32)
    w = rng.standard_normal((16, 32)).astype(np.float32)
    state = tecupy.FP8State()
    with pytest.warns(UserWarning, match="records delayed scaling's casts only"):
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
    assert [(r["step"], r["tensor"], r["format"], r["counted_from"]) for r in rows] == [
        ("0", "state0.gemm0.grad_output", "e5m2", "input"),
        ("1", "state0.gemm0.grad_output", "e5m2", "input")]
    assert float(rows[1]["amax"]) == ins.to_dict()["state0.gemm0.grad_output"]["amax"][1]


def test_disabled_costs_no_hook_call(monkeypatch, rng):
    def boom(*args):
        raise AssertionError("record called with no inspector active")
    for hook in ("record", "record_dact", "record_quantize"):
        monkeypatch.setattr(FP8Inspector, hook, boom)
    m = nn.LayerNormMLP(32, 64, device="cpu", seed=0)  # its backward casts through dact_cast
    _train_step(m, rng.standard_normal((16, 32)).astype(np.float32), recipe.DelayedScaling())
    tecupy.quantize(rng.standard_normal(8).astype(np.float32), 1.0, "e4m3")
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


def code_stats(codes, fmt):
    """(zero codes, max codes) over the non-NaN codes, counted independently (ml_dtypes)."""
    v = codes.view(fmt.ml_dtype).astype(np.float64)
    valid = ~np.isnan(v)
    return (np.count_nonzero(valid & (v == 0)) / np.count_nonzero(valid),
            np.count_nonzero(np.abs(v) == fmt.max) / np.count_nonzero(valid))


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2])
def test_producer_fused_cast_counted_from_its_codes(rng, fmt):
    scale = 2.0 ** rng.integers(-3, 4)
    x, _, _ = known_input(rng, fmt, scale, n=int(rng.integers(500, 1500)))
    codes = np.asarray(fp8.quantize(x, scale, fmt).data)
    q = quantizer(np, fmt, scale)
    q.amax_out[...] = 7.5  # what the producer maxed into the slot
    with FP8Inspector() as ins:
        q.wrap(codes)
    r = ins.to_dict()["state0.gemm0.input"]
    zeros, at_max = code_stats(codes, fmt)
    assert 0 < zeros and 0 < at_max  # the boundaries of known_input are in both
    assert (r["underflow"][0], r["overflow"][0]) == (zeros, at_max)
    assert r["amax"][0] == 7.5 and r["scale"][0] == scale and np.isnan(r["rel_error"][0])
    assert ins.counted_from == {"state0.gemm0.input": "codes"}


def _dact_inputs(rng, rows=48, cols=40):
    """dy, h, b (float32) whose dx = dy * gelu'(h + b) flushes and saturates in E5M2."""
    dy = (rng.standard_normal((rows, cols)) * 10.0 ** rng.integers(-9, 6, (rows, cols)))
    h = rng.standard_normal((rows, cols)) * 3
    b = rng.standard_normal(cols)
    return dy.astype(np.float32), h.astype(np.float32), b.astype(np.float32)


@pytest.mark.parametrize("exact", [False, True])
def test_dact_cast_is_seen(rng, exact):
    dy, h, b = _dact_inputs(rng)
    q = quantizer(np, fp8.E5M2, 2.0, "grad_output")
    with FP8Inspector(exact=exact) as ins:
        t, db = fp8.dact_cast(dy, h, b, "gelu", q.scale, q.fmt, q.amax_out, np.float32)
    r = ins.to_dict()["state0.gemm0.grad_output"]
    dx, _ = tecupy.backends.dispatch("gelu_bwd", dy, h, b)  # what the fused cast cast
    assert r["scale"][0] == 2.0 and r["numel"][0] == dx.size
    if exact:
        under, over, rel = numpy_stats(dx.reshape(-1), fp8.E5M2, 2.0)
        assert under > 0 and over > 0
        assert (r["underflow"][0], r["overflow"][0]) == (under, over)
        np.testing.assert_allclose(r["rel_error"][0], rel, rtol=1e-12)
        assert r["amax"][0] == np.abs(dx).max()
        assert ins.counted_from["state0.gemm0.grad_output"] == "input"
    else:
        zeros, at_max = code_stats(np.asarray(t.data), fp8.E5M2)
        assert (r["underflow"][0], r["overflow"][0]) == (zeros, at_max)
        assert r["amax"][0] == np.abs(dx).max() and np.isnan(r["rel_error"][0])
        assert ins.counted_from["state0.gemm0.grad_output"] == "codes"
    # a dact_cast with an amax slot of no quantizer: modules=None only
    with FP8Inspector() as ins:
        fp8.dact_cast(dy, h, b, "gelu", q.scale, q.fmt, np.zeros(1, np.float32))
        fp8.dact_cast(dy, h, None, "gelu", q.scale, q.fmt, None)
    assert ins.labels == ["dact_cast0", "dact_cast1"]
    assert np.isnan(ins.to_dict()["dact_cast1"]["amax"][0])
    with FP8Inspector({"s": tecupy.FP8State()}) as ins:
        fp8.dact_cast(dy, h, b, "gelu", q.scale, q.fmt, np.zeros(1, np.float32))
    assert ins.labels == []


def test_direct_quantize_is_seen_with_modules_none(rng):
    """tecupy.quantize is the user's own cast: recorded as quantize<n> where the inspector
    records every cast (modules=None), not where it watches modules."""
    fmt, scale = fp8.E4M3, 2.0 ** rng.integers(-3, 4)
    x, flushed, saturated = known_input(rng, fmt, scale)
    y = rng.standard_normal((16, 24)).astype(np.float32)
    with FP8Inspector() as ins:
        tecupy.quantize(x, scale, fmt)
        fp8.quantize_current(y, fmt, transpose=True, dbias_dtype=np.float32)
    d = ins.to_dict()
    under, over, rel = numpy_stats(x, fmt, scale)
    assert (d["quantize0"]["underflow"][0], d["quantize0"]["overflow"][0]) == (under, over)
    np.testing.assert_allclose(d["quantize0"]["rel_error"][0], rel, rtol=1e-12)
    assert d["quantize1"]["amax"][0] == np.abs(y).max() and d["quantize1"]["numel"][0] == y.size
    np.testing.assert_allclose(d["quantize1"]["scale"][0], 448 / np.abs(y).max(), rtol=1e-6)
    m = nn.Linear(16, 16, device="cpu", seed=0)
    with FP8Inspector(m) as ins:
        tecupy.quantize(x, scale, fmt)
    assert ins.labels == []


class _FakeStream:
    def __init__(self, status):
        self.ptr, self.status, self.asked = 0xC0FFEE, status, []
        self.cuda = types.SimpleNamespace(
            runtime=types.SimpleNamespace(streamIsCapturing=self._is_capturing),
            get_current_stream=lambda: types.SimpleNamespace(ptr=self.ptr))

    def _is_capturing(self, ptr):
        self.asked.append(ptr)
        return self.status


@pytest.mark.parametrize("recording", [False, True])
def test_graph_recording_is_read_from_the_current_stream(recording):
    """A CuPy array module's current stream (runtime.streamIsCapturing of its pointer)
    tells whether a graph is being recorded; NumPy never asks."""
    fake = _FakeStream(recording)
    assert tecupy.inspect._in_graph(fake) is recording and fake.asked == [fake.ptr]
    assert tecupy.inspect._in_graph(np) is False
    if recording:
        with pytest.raises(RuntimeError, match="FP8 cast inside a CUDA graph"):
            tecupy.inspect._refuse_graph(fake)


def test_a_cast_under_make_graphed_step_is_a_clear_error(rng):
    """While make_graphed_step records a graph (graphs.capturing()), an inspected cast
    raises, and make_graphed_step's error wrapping passes the message on unchanged; the
    per-step read refuses too. Without an inspector, nothing is checked."""
    from tecupy import graphs
    q = quantizer(np, fp8.E4M3, 1.0)
    x = rng.standard_normal(64).astype(np.float32)
    with FP8Inspector() as ins:
        q.quantize(x)
        token = graphs._capturing.set(object())  # what graphs._capture sets
        try:
            assert graphs.capturing()
            for cast in (lambda: q.quantize(x), lambda: q.wrap(np.zeros(4, np.uint8)),
                         lambda: tecupy.quantize(x, 1.0, "e4m3")):
                with pytest.raises(RuntimeError, match="inside a CUDA graph") as err:
                    cast()
                assert graphs._capture_error(err.value) is err.value
            with pytest.raises(RuntimeError, match="make_graphed_step"):
                ins.step()
            with tecupy.inspect.paused():
                q.quantize(x)  # no inspector: no check
        finally:
            graphs._capturing.reset(token)
        ins.step()  # the record made before is kept
    assert ins.steps == 1 and ins.to_dict()["state0.gemm0.input"]["numel"][0] == 64


def test_many_casts_in_a_step_and_a_fresh_accumulator_per_step(rng):
    """More casts in a step than one accumulator holds (_Records.RECORDS rows): each keeps
    its own numbers; the next step starts from zero (nothing carried over)."""
    from tecupy.inspect import _Records
    fmt = fp8.E5M2
    xs = [known_input(rng, fmt, 2.0, n=int(rng.integers(60, 200)))[0]
          for _ in range(_Records.RECORDS + 9)]
    with FP8Inspector(exact=True) as ins:
        for _ in range(2):
            for x in xs:
                tecupy.quantize(x, 2.0, fmt)
            ins.step()
    d = ins.to_dict()
    assert ins.steps == 2 and len(d) == len(xs)
    for k, x in enumerate(xs):
        r = d[f"quantize{k}"]
        under, over, rel = numpy_stats(x, fmt, 2.0)
        for s in range(2):
            assert (r["underflow"][s], r["overflow"][s]) == (under, over)
            assert r["numel"][s] == x.size and r["amax"][s] == np.inf
            np.testing.assert_allclose(r["rel_error"][s], rel, rtol=1e-12)


def _block_stats(x, t):
    """(amax, scale, underflow, overflow, rel_error) of the block cast t of x, from its codes
    and scales decoded with ml_dtypes (an independent dequantize)."""
    from tecupy.reference.block_scaling import row_scales
    codes, sinv = np.asarray(t.data), np.asarray(t.scale_inv)
    per = np.repeat(row_scales(x.shape, sinv), 128, axis=1)[:, :x.shape[1]]
    deq = codes.view(t.fmt.ml_dtype).astype(np.float64) * per
    nonzero = x != 0
    under = np.count_nonzero(nonzero & ((codes & 0x7F) == 0)) / np.count_nonzero(nonzero)
    over = np.count_nonzero(np.abs(x) > t.fmt.max * per) / x.size
    rel = np.linalg.norm(deq - x) / np.linalg.norm(x.astype(np.float64))
    return np.float32(np.abs(x).max()), 1.0 / np.float64(sinv.max()), under, over, rel


def test_block_scaling_casts_are_seen(xp, rng):
    """Under Float8BlockScaling every cast of a linear's forward and backward is recorded
    ("block<n>.<tensor>"): amax, the smallest block scale, the flushed and saturated
    fractions and the round-trip error against the codes and per-block scales decoded
    independently (x 1x128 blocks, w 128x128, dy 1x128); values spanning 2^30 within a
    block flush."""
    from tecupy.quantization import BlockQuantizer
    rs = lambda *s: rng.standard_normal(s) * 10.0 ** rng.integers(-9, 2, s)  # noqa: E731
    x, w, dy = (rs(*s).astype(np.float32) for s in ((96, 384), (160, 384), (96, 160)))
    r = recipe.Float8BlockScaling()
    xs, ws = xp.asarray(x), xp.asarray(w)
    with FP8Inspector(exact=True) as ins:
        with tecupy.Tape() as tape:
            with tecupy.fp8_autocast(fp8_recipe=r):
                y = tecupy.linear(xs, ws)
        tape.gradient(y, [xs, ws], output_grad=xp.asarray(dy))
    d = ins.to_dict()
    assert sorted(d) == ["block0.grad_output", "block0.input", "block0.weight"]
    assert set(ins.counted_from.values()) == {"input"}
    for label, a, dim, q in (("block0.input", x, 1, r.fp8_quant_fwd_inp),
                             ("block0.weight", w, 2, r.fp8_quant_fwd_weight),
                             ("block0.grad_output", dy, 1, r.fp8_quant_bwd_grad)):
        t = BlockQuantizer(fp8.E4M3, dim, q).quantize(a)
        amax, scale, under, over, rel = _block_stats(a, t)
        got = d[label]
        assert got["amax"][0] == amax and got["scale"][0] == scale, label
        assert got["underflow"][0] == under and 0 < under < 1, label
        assert got["overflow"][0] == over == 0 and got["numel"][0] == a.size, label
        np.testing.assert_allclose(got["rel_error"][0], rel, rtol=1e-12, err_msg=label)


@pytest.mark.parametrize("make", [recipe.Float8CurrentScaling, recipe.Float8BlockScaling])
def test_a_module_inspector_warns_under_a_stateless_recipe(rng, make):
    """FP8Inspector(module) records delayed scaling's casts (their states name the module);
    current and block scaling keep no state per module, so it records none of theirs: it
    says so once (a warning naming FP8Inspector()) instead of an empty record."""
    mlp = nn.LayerNormMLP(128, 256, device="cpu", seed=0)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    with pytest.warns(UserWarning, match=r"records delayed scaling's casts only.*"
                      r"FP8Inspector\(\)") as caught:
        with FP8Inspector(mlp) as ins:
            for _ in range(2):
                with tecupy.Tape() as tape:
                    with tecupy.fp8_autocast(fp8_recipe=make()):
                        y = mlp(x)
                tape.gradient(y, mlp, output_grad=np.ones_like(y))
                ins.step()
    assert len([w for w in caught if "FP8Inspector" in str(w.message)]) == 1
    assert not ins.labels


def test_block_scaling_fused_activation_cast_counted_from_its_codes(rng):
    """LayerNormMLP under Float8BlockScaling quantizes fc2's input in the activation's own
    kernel (block_quantize_act): that cast is counted from its codes (amax NaN, the
    smallest block scale), the others from their inputs."""
    mlp = nn.LayerNormMLP(128, 256, device="cpu", seed=0)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    with FP8Inspector() as ins:
        with tecupy.Tape() as tape:
            with tecupy.fp8_autocast(fp8_recipe=recipe.Float8BlockScaling()):
                y = mlp(x)
        tape.gradient(y, mlp, output_grad=np.ones_like(y))
    codes = [k for k, v in ins.counted_from.items() if v == "codes"]
    assert codes and all(k.startswith("block") for k in ins.labels)
    d = ins.to_dict()
    for k in codes:
        assert np.isnan(d[k]["amax"][0]) and np.isnan(d[k]["rel_error"][0])
        assert 0 < d[k]["scale"][0] < np.inf
