"""Backend registry: priorities, supports(), TECUPY_BACKEND, TECUPY_OP_BACKENDS,
TECUPY_STRICT fallback, TECUPY_PLUGINS and the listing."""
import sys
import traceback
import types
import warnings

import numpy as np
import pytest

import tecupy
from tecupy import backends, loader


@pytest.fixture
def fake_op():
    """A throwaway op with three implementations; removed afterwards."""
    calls = []
    backends.register("demo_fwd", "reference")(lambda x: calls.append("reference") or "ref")
    backends.register("demo_fwd", "cuda", supports=lambda x: x > 0)(
        lambda x: calls.append("cuda") or "cuda")
    backends.register("demo_fwd", "cutlass", supports=lambda x: x > 10)(
        lambda x: calls.append("cutlass") or "cutlass")
    yield calls
    backends._registry.pop("demo_fwd")


def test_kept_order_follows_settings_and_registry(fake_op, monkeypatch):
    """dispatch keeps each op's last order (issue 21): a changed setting, a setting set
    again to its value, a registration, a list replaced or changed in place all count."""
    for var in ("TECUPY_BACKEND", "TECUPY_OP_BACKENDS"):
        monkeypatch.delenv(var, raising=False)
    assert backends.dispatch("demo_fwd", 20) == "cutlass"
    monkeypatch.setenv("TECUPY_BACKEND", "cuda")
    assert backends.dispatch("demo_fwd", 20) == "cuda"
    monkeypatch.setenv("TECUPY_BACKEND", "cuda")  # the same value, a new object
    assert backends.dispatch("demo_fwd", 20) == "cuda"
    monkeypatch.setenv("TECUPY_OP_BACKENDS", "demo=reference")
    assert backends.dispatch("demo_fwd", 20) == "ref"
    monkeypatch.delenv("TECUPY_OP_BACKENDS")
    monkeypatch.delenv("TECUPY_BACKEND")
    backends.register("demo_fwd", "cutlass", supports=lambda x: x > 100)(lambda x: "new")
    assert backends.dispatch("demo_fwd", 20) == "cuda"
    impls = backends._registry["demo_fwd"]
    impls.append(backends.Impl("demo_fwd", "mine", 99, lambda x: "mine", None))  # in place
    assert backends.dispatch("demo_fwd", 20) == "mine"
    backends._registry["demo_fwd"] = [i for i in impls if i.kind != "mine"]  # replaced
    assert backends.dispatch("demo_fwd", 20) == "cuda"


def test_priority_and_supports(fake_op, monkeypatch):
    for var in ("TECUPY_BACKEND", "TECUPY_OP_BACKENDS", "TECUPY_STRICT"):
        monkeypatch.delenv(var, raising=False)
    assert backends.dispatch("demo_fwd", 20) == "cutlass"
    assert backends.dispatch("demo_fwd", 5) == "cuda"
    assert backends.dispatch("demo_fwd", -1) == "ref"
    assert backends.chosen("demo_fwd", 5) == "cuda"
    assert [i.kind for i in backends.candidates("demo_fwd", 20)] == ["cutlass", "cuda",
                                                                      "reference"]


def test_env_preferences(fake_op, monkeypatch):
    monkeypatch.setenv("TECUPY_BACKEND", "reference")
    assert backends.dispatch("demo_fwd", 20) == "ref"
    monkeypatch.setenv("TECUPY_OP_BACKENDS", "layernorm=reference, demo=cuda|cutlass")
    assert backends.dispatch("demo_fwd", 20) == "cuda"  # per-op order beats TECUPY_BACKEND
    monkeypatch.setenv("TECUPY_OP_BACKENDS", "demo_fwd=cutlass")
    assert backends.dispatch("demo_fwd", 20) == "cutlass"
    monkeypatch.setenv("TECUPY_OP_BACKENDS", "demo")
    with pytest.raises(ValueError, match="op=kind"):
        backends.dispatch("demo_fwd", 20)


def test_fallback_and_strict(monkeypatch):
    backends.register("demo2", "reference")(lambda: "ref")

    def broken():
        raise RuntimeError("kernel failed to compile")
    backends.register("demo2", "cuda")(broken)
    try:
        monkeypatch.delenv("TECUPY_STRICT", raising=False)
        with pytest.warns(RuntimeWarning, match="falling back to reference"):
            assert backends.dispatch("demo2") == "ref"
        monkeypatch.setenv("TECUPY_STRICT", "1")
        with pytest.raises(RuntimeError, match="compile"):
            backends.dispatch("demo2")
    finally:
        backends._registry.pop("demo2")


def test_plugins_env(monkeypatch):
    mod = types.ModuleType("tecupy_demo_plugin")

    def load():
        backends.register("relu_fwd", "demo", priority=99)(lambda x, *a: np.full_like(x, 7.0))
    mod.load = load
    monkeypatch.setitem(sys.modules, "tecupy_demo_plugin", mod)
    exec("import tecupy.backends as b\nb.register('relu_fwd', 'demo', priority=99)"
         "(lambda x, *a: x * 0 + 7)", mod.__dict__)
    monkeypatch.setenv("TECUPY_PLUGINS", "tecupy_demo_plugin")
    monkeypatch.setattr(backends, "_plugins_loaded", False)
    try:
        assert np.all(tecupy.relu(np.ones(3)) == 7)
        assert ("demo", 99) in backends.registered()["relu_fwd"]
    finally:
        backends._registry["relu_fwd"] = [i for i in backends._registry["relu_fwd"]
                                          if i.kind != "demo"]


def test_reference_registers_every_op_and_listing():
    ops = backends.registered()
    fams = {backends.family(o) for o in ops}
    assert fams >= {"gemm", "fp8_gemm", "cast_to_fp8", "fp8_dequantize", "amax", "layernorm",
                    "rmsnorm", "gelu", "relu", "swiglu", "geglu", "softmax", "dropout",
                    "attention", "cross_entropy", "add", "delayed_scaling_update"}
    assert all(("reference", 0) in impls for impls in ops.values())
    assert "layernorm_fwd" in backends.describe()
    with pytest.raises(KeyError, match="no implementation registered"):
        backends.dispatch("no_such_op")


# ---- remembered build/load failures (issue 19, point 6) -------------------------------

@pytest.fixture
def failing_op(monkeypatch):
    """A throwaway op "demo3_fwd" whose cuda implementation raises `box[0]` (counting its
    calls) and whose reference returns "ref"; removed afterwards with its failures."""
    for var in ("TECUPY_BACKEND", "TECUPY_OP_BACKENDS", "TECUPY_STRICT"):
        monkeypatch.delenv(var, raising=False)
    calls, box = [], [loader.CompileError("NVRTC failed to compile demo.cu\nlog line")]

    def broken(x):
        calls.append(x)
        raise box[0]
    backends.register("demo3_fwd", "reference")(lambda x: "ref")
    backends.register("demo3_fwd", "cuda")(broken)
    yield calls, box
    backends._registry.pop("demo3_fwd")
    backends.clear_failures()


def _warnings_of(fn, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args)
    return result, [str(w.message) for w in caught]


def test_build_failure_is_remembered_and_explained_once(failing_op):
    calls, _ = failing_op
    x = np.ones(3)
    out, texts = _warnings_of(backends.dispatch, "demo3_fwd", x)
    assert out == "ref" and len(calls) == 1 and len(texts) == 1
    text = texts[0]
    for part in ("cuda implementation of demo3_fwd", "failed to build or load", "CompileError",
                 "demo.cu", "runs on reference", f"{backends.DEFAULT_SLOWDOWN}x slower",
                 "estimate", "TECUPY_STRICT=1"):
        assert part in text, (part, text)
    for _ in range(3):  # skipped from now on: no second build, no second warning
        out, texts = _warnings_of(backends.dispatch, "demo3_fwd", x)
        assert out == "ref" and not texts and len(calls) == 1
    assert list(backends.failures()) == [("demo3_fwd", "cuda")]
    assert backends.chosen("demo3_fwd", x) == "reference"
    assert "demo3_fwd" in backends.describe().split("failed to build or load")[1]
    backends.clear_failures()  # tried again after a fix
    assert not backends.failures() and backends.chosen("demo3_fwd", x) == "cuda"
    _warnings_of(backends.dispatch, "demo3_fwd", x)
    assert len(calls) == 2


def test_slowdown_factor_follows_the_op_family(failing_op, monkeypatch):
    monkeypatch.setitem(backends.SLOWDOWN, "demo3", 37)
    _, texts = _warnings_of(backends.dispatch, "demo3_fwd", np.ones(2))
    assert "roughly 37x slower" in texts[0] and "estimate for demo3" in texts[0]
    assert backends.SLOWDOWN["fp8_gemm"] >= 20 and backends.SLOWDOWN["attention"] >= 20


def test_driver_load_failure_is_remembered(failing_op):
    from cupy.cuda import driver

    class NoBinary(driver.CUDADriverError):  # the real one needs a driver to be made
        def __init__(self):
            RuntimeError.__init__(self, "CUDA_ERROR_NO_BINARY_FOR_GPU: no kernel image")
    calls, box = failing_op
    box[0] = NoBinary()
    _, texts = _warnings_of(backends.dispatch, "demo3_fwd", np.ones(2))
    _warnings_of(backends.dispatch, "demo3_fwd", np.ones(2))
    assert len(calls) == 1 and "NO_BINARY_FOR_GPU" in texts[0]


def test_strict_raises_at_once_every_time(failing_op, monkeypatch):
    calls, _ = failing_op
    monkeypatch.setenv("TECUPY_STRICT", "1")
    for n in (1, 2):
        with pytest.raises(loader.CompileError, match="demo.cu"):
            backends.dispatch("demo3_fwd", np.ones(2))
        assert len(calls) == n
    assert not backends.failures()


def test_strict_raises_a_remembered_failure(failing_op, monkeypatch):
    calls, _ = failing_op
    _warnings_of(backends.dispatch, "demo3_fwd", np.ones(2))
    monkeypatch.setenv("TECUPY_STRICT", "1")
    with pytest.raises(loader.CompileError, match="demo.cu"):
        backends.dispatch("demo3_fwd", np.ones(2))
    assert len(calls) == 1 and backends.chosen("demo3_fwd", np.ones(2)) == "cuda"


@pytest.mark.parametrize("exc", [TypeError("x has dtype int8"), ValueError("bad shape")])
def test_bad_input_propagates_unchanged(failing_op, exc):
    calls, box = failing_op
    box[0] = exc
    for n in (1, 2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(type(exc)) as info:
                backends.dispatch("demo3_fwd", np.ones(2))
        assert info.value is exc and len(calls) == n
    assert not backends.failures()


def test_other_failures_fall_back_each_call_unremembered(failing_op):
    calls, box = failing_op
    box[0] = RuntimeError("out of luck")
    for n in (1, 2):
        out, texts = _warnings_of(backends.dispatch, "demo3_fwd", np.ones(2))
        assert out == "ref" and len(calls) == n and "falling back to reference" in texts[0]
    assert not backends.failures()


def test_remembered_failure_without_fallback_reraises_without_rebuilding(monkeypatch):
    monkeypatch.delenv("TECUPY_STRICT", raising=False)
    calls = []

    def broken():
        calls.append(1)
        raise loader.CompileError("no")
    backends.register("demo4", "cuda")(broken)
    try:
        depths = []
        for _ in range(3):
            with pytest.raises(loader.CompileError) as info:
                backends.dispatch("demo4")
            depths.append(len(traceback.extract_tb(info.value.__traceback__)))
        assert len(calls) == 1
        assert depths[1] == depths[2]  # the stored error's traceback does not grow
    finally:
        backends._registry.pop("demo4")
        backends.clear_failures()
