"""The lean eager path (issue 21), no GPU needed: what one FP8 linear dispatches, the
common-case checks agreeing with the full ones, and the CUDA wrappers' launch plans (the
kernel lookups faked, so the plan logic runs on a machine without a GPU)."""
import importlib

import numpy as np
import pytest

import tecupy
from tecupy import backends
from tecupy.fp8 import E4M3, E5M2
from tecupy.kernels import cast as cast_kernels
from tecupy.kernels import fp8_gemm as gemm_kernels
from tecupy.recipe import DelayedScaling

linear_op = importlib.import_module("tecupy.ops.linear")  # (tecupy.ops.linear: the function)


def _count_dispatches(monkeypatch, fn):
    seen, real = {}, backends.dispatch

    def dispatch(op, *args, **kwargs):
        seen[op] = seen.get(op, 0) + 1
        return real(op, *args, **kwargs)
    monkeypatch.setattr(backends, "dispatch", dispatch)
    fn()
    monkeypatch.setattr(backends, "dispatch", real)
    return seen


def test_fp8_linear_dispatches(monkeypatch, rng):
    """One FP8 nn.Linear forward under a Tape: two casts (with their transposes), one GEMM,
    the forward update at autocast exit; its backward: one cast of dy (with dbias), two
    GEMMs, the backward update. Each is a kernel launch or more on a GPU."""
    lin = tecupy.nn.Linear(32, 16, device="cpu", seed=0)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    recipe = DelayedScaling(amax_history_len=4)

    def step():
        with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=recipe):
            y = lin(x)
        step.grads = tape.gradient(y, lin, output_grad=y)
    step()  # (the state is made at the first call)
    assert _count_dispatches(monkeypatch, step) == {
        "cast_transpose": 2, "fp8_gemm": 3, "delayed_scaling_update": 2,
        "cast_transpose_dbias": 1}


@pytest.mark.parametrize("case", [
    ((4, 8), (3, 8), (3,), np.float32),
    ((2, 3, 8), (3, 8), None, np.float16),
    ((8,), (3, 8), (3,), np.float64)])
def test_common_case_check_accepts(case):
    xs, ws, bs, dt = case
    x, w = np.ones(xs, dt), np.ones(ws, dt)
    b = None if bs is None else np.ones(bs, dt)
    assert linear_op._plain(x, w, b) and linear_op._check_args("linear", x, w, b) is np


@pytest.mark.parametrize("args", [
    (np.ones((4, 8), np.float32), np.ones((3, 8), np.float16), None),   # dtypes differ
    (np.ones((4, 8), np.int32), np.ones((3, 8), np.int32), None),       # not floating
    (np.ones((4, 8), np.float32), np.ones((3, 7), np.float32), None),   # K differs
    (np.ones((4, 8), np.float32), np.ones((3, 8), np.float32), np.ones((4,), np.float32)),
    (np.ones((4, 8), np.float32), np.ones((3, 8), np.float32), np.ones((1, 3), np.float32)),
    (np.ones((), np.float32), np.ones((3, 1), np.float32), None),       # 0-d x
    (np.ones((4, 8), np.float32), np.ones((8,), np.float32), None),     # 1-d weight
    (None, np.ones((3, 8), np.float32), None)])
def test_common_case_check_refuses_what_the_full_check_refuses(args):
    assert not linear_op._plain(*args)
    with pytest.raises((TypeError, ValueError)):
        linear_op._check_args("linear", *args)


class _Kernel:
    """A stand-in for a loaded kernel: a name and the attribute the plans set."""
    def __init__(self, name):
        self.name, self.max_dynamic_shared_size_bytes = name, 0


def _fake_gpu(monkeypatch, module, sms=132):
    made = []

    def function(file, name, options=()):
        made.append(name)
        return _Kernel(name)
    monkeypatch.setattr(module.loader, "function", function)
    monkeypatch.setattr(module, "sm_count", lambda: sms)
    monkeypatch.setattr(module, "_device", lambda: 0)
    monkeypatch.setattr(module, "_plans", {})
    return made


def test_fp8_gemm_plan_is_the_default_then_the_tuned_config(monkeypatch, tmp_path):
    made = _fake_gpu(monkeypatch, gemm_kernels)
    monkeypatch.setenv("TECUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gemm_kernels, "_tuned_cache", {})
    args = (256, 4096, 4096, E4M3, E4M3, True, tecupy.bfloat16, False, False, False)
    fn, grid, smem, staged, out_dtype, bn, gelu = gemm_kernels._shape_plan(*args)
    config = gemm_kernels.default_config(256, 4096, True)
    assert fn.name == gemm_kernels.kernel_name("e4m3", "e4m3", "__nv_bfloat16", 1, False,
                                               config)
    assert (bn, smem, out_dtype) == (config[0], gemm_kernels.smem_bytes(config, staged),
                                     np.dtype(tecupy.bfloat16))
    assert fn.max_dynamic_shared_size_bytes == smem and not gelu
    assert grid == (min(2 * -(-4096 // bn), 132),)
    version = gemm_kernels._version[0]
    tuned = next(c for c in gemm_kernels.CANDIDATES[True] if c != config)
    gemm_kernels.remember(256, 4096, 4096, "e4m3", "e4m3", True, tuned)
    assert gemm_kernels._version[0] == version + 1  # (a new key: the plan is made again)
    assert gemm_kernels._shape_plan(*args)[0].name == made[-1] == gemm_kernels.kernel_name(
        "e4m3", "e4m3", "__nv_bfloat16", 1, False, tuned)


def test_fp8_gemm_fp8_output_needs_its_scale():
    with pytest.raises(ValueError, match="needs out_scale and amax_out"):
        gemm_kernels._check_fp8_out(E5M2, None, np.ones(1, np.float32))
    gemm_kernels._check_fp8_out(np.float32, None, None)


def test_cast_transpose_plan(monkeypatch):
    made = _fake_gpu(monkeypatch, cast_kernels, sms=100)
    monkeypatch.setattr(cast_kernels, "resident_blocks", lambda k, threads, smem: 4)
    k, grid = cast_kernels._ct_plan(256, 4096, tecupy.bfloat16, "e5m2", True)
    name = "cast_transpose_tiled<__nv_bfloat16, __nv_fp8_e5m2, 1, true, false>"
    assert made == [k.name] == [name]
    assert grid == (min(2 * 64, 400),)
    k, grid = cast_kernels._ct_plan(24, 40, np.dtype(np.float32), "e4m3",
                                     False)  # a tail: 40 % 16
    assert k.name.endswith("false, true>") and grid == (1,)


def test_fp8_gemm_tma_descriptors_are_kept(monkeypatch):
    class Array:  # what tma_desc reads of a CuPy array
        def __init__(self, ptr, shape, dtype):
            self.data = type("Mem", (), {"ptr": ptr})()
            self.shape, self.dtype = shape, np.dtype(dtype)
            self.itemsize = self.dtype.itemsize
    calls = []
    monkeypatch.setattr(gemm_kernels, "tma_encode", lambda *args: calls.append(args) or
                        len(calls))
    monkeypatch.setattr(gemm_kernels, "_descs", {})
    a = Array(1 << 20, (256, 4096), np.uint8)
    assert gemm_kernels.tma_desc(a, 128) == gemm_kernels.tma_desc(a, 128) == 1
    assert calls == [(1 << 20, np.dtype(np.uint8), (4096, 256), (4096,), (128, 128))]
    out = Array(1 << 20, (256, 64), tecupy.bfloat16)  # same address, another array
    assert gemm_kernels.tma_desc(out, 64) == 2
    assert calls[1] == (1 << 20, np.dtype(tecupy.bfloat16), (64, 256), (128,), (64, 64))
