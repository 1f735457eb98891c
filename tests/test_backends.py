"""Backend registry: priorities, supports(), TECUPY_BACKEND, TECUPY_OP_BACKENDS,
TECUPY_STRICT fallback, TECUPY_PLUGINS and the listing."""
import sys
import types

import numpy as np
import pytest

import tecupy
from tecupy import backends


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
